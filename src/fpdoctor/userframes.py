"""Which stack frames are the user's: the line a finding names is the user's, never torch's,
fpdoctor's or the standard library's, except the casebook's models, which stand in for the user's.

Torch-free (torch's directory is found without importing it): whatever reads a user's line
imports this, the trace, the audit, compare and the crash readers alike.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
from collections.abc import Iterator
from types import FrameType

__all__ = ["CASEBOOK_DIR", "OWN_DIR", "called_from", "function_at", "is_user_file", "user_location"]

OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep  # fpdoctor's package directory
CASEBOOK_DIR = os.path.join(OWN_DIR, "casebook") + os.sep


def _package_dir(name: str) -> str | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(spec.origin) + os.sep


_TORCH_DIR = _package_dir("torch")
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_USER_FILES: dict[str, bool] = {}  # file name -> is_user_file: looked up for every frame walked


def is_user_file(filename: str) -> bool:
    """Code the user wrote (or a casebook model): not fpdoctor's, torch's nor the standard library's."""
    if filename.startswith(OWN_DIR):
        return filename.startswith(CASEBOOK_DIR)
    if (_TORCH_DIR is not None and filename.startswith(_TORCH_DIR)) or filename.startswith("<frozen"):
        return False
    # the standard library, but not packages installed beside it (no virtual environment)
    return not filename.startswith(_STDLIB_DIR) or any(s in filename for s in _SITE)


def user_location(frame: FrameType | None) -> tuple[str, int, str] | None:
    """The innermost frame outside torch, fpdoctor and the standard library: the user's line. Under a
    frame that calls the user's model again (`called_from`: a replay), the line that first called it."""
    return user_place(frame)[1]


def user_place(frame: FrameType | None) -> tuple[FrameType | None, tuple[str, int, str] | None]:
    """(the user's innermost frame, its line), as user_location; under `called_from`, (None, the line
    that first called the model) where no user frame inside the model is found first."""
    if not _CALLED_FROM:
        found = user_frame(frame)
        return found, frame_location(found)
    while frame is not None:
        first = _CALLED_FROM.get(id(frame))
        if first is not None:
            return None, first
        if _is_user(frame.f_code.co_filename):
            return frame, frame_location(frame)
        frame = frame.f_back
    return None, None


# id of a live frame of fpdoctor's that calls the user's model again -> the user's line that called it first
_CALLED_FROM: dict[int, tuple[str, int, str]] = {}


@contextlib.contextmanager
def called_from(frame: FrameType, first: tuple[str, int, str] | None) -> Iterator[None]:
    """While `frame` (fpdoctor's, which calls the user's model again: a replay of a training forward)
    runs, an op that no user frame inside the model holds (a torch module's, nn.Sequential's layers) is
    at `first`, the user's line that called the model in the step replayed, not at the line the replay
    runs under (the optimizer's step, where the replay is decided)."""
    if first is None:
        yield
        return
    _CALLED_FROM[id(frame)] = first
    try:
        yield
    finally:
        _CALLED_FROM.pop(id(frame), None)


def frame_location(frame: FrameType | None) -> tuple[str, int, str] | None:
    """A frame's (file, line, function)."""
    return (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name) if frame is not None else None


def user_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside torch, fpdoctor and the standard library: the user's."""
    while frame is not None:
        code = frame.f_code
        if _is_user(code.co_filename):
            return frame
        frame = frame.f_back
    return None


def _is_user(filename: str) -> bool:
    # by file name: code objects compare equal across files when their bodies do
    user = _USER_FILES.get(filename)
    if user is None:
        if len(_USER_FILES) > 50_000:  # files made up at run time must not grow it forever
            _USER_FILES.clear()
        user = _USER_FILES[filename] = is_user_file(filename)
    return user


def _dataset(owner: object) -> bool:
    """Whether `owner` is a torch Dataset (by its classes' names: this module imports no torch)."""
    return any(c.__name__ == "Dataset" and c.__module__.startswith("torch.utils.data") for c in type(owner).__mro__)


def dataset_item(frame: FrameType | None) -> int | None:
    """The index a Dataset's `__getitem__` was called with, where the user's innermost frame is one
    (an op that ran while a DataLoader read one item): its first argument after `self`, if whole."""
    while frame is not None:
        code = frame.f_code
        if _USER_FILES.get(code.co_filename) or is_user_file(code.co_filename):
            if code.co_name != "__getitem__" or code.co_argcount < 2 or not _dataset(frame.f_locals.get("self")):
                return None
            value = frame.f_locals.get(code.co_varnames[1])
            if value is not None and hasattr(value, "__index__") and not isinstance(value, bool):
                try:
                    return int(value.__index__())
                except (TypeError, RuntimeError):  # a tensor of more than one value
                    return None
            return None
        frame = frame.f_back
    return None


def user_frames(frame: FrameType | None, most: int = 8) -> list[tuple[str, int, str]]:
    """The user's frames from `frame` outwards (innermost first, at most `most`): a call inside a
    helper, and the helper's call."""
    found: list[tuple[str, int, str]] = []
    while frame is not None and len(found) < most:
        code = frame.f_code
        user = _USER_FILES.get(code.co_filename)
        if user is None:
            user = _USER_FILES[code.co_filename] = is_user_file(code.co_filename)
        if user:
            found.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return found


def function_at(tree: ast.Module, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The innermost function of a parsed source file whose lines hold `line`; None at module level."""
    holding = [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (node.end_lineno or 0)
    ]
    return max(holding, key=lambda node: node.lineno, default=None)
