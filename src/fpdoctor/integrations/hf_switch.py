"""The Hugging Face callback switched on in every `transformers.Trainer` made under a watch.

The Trainer has no callback factory that an installed package can join (Lightning has one:
entry_point.py), so while a watch is entered `Trainer.__init__` is wrapped: a Trainer made then
gets `FpDoctorCallback` unless the script passed one itself (one judge per step: the script's
wins). The callback judges its Trainer's steps; `fpdoctor watch` leaves that optimizer to it and
adds its findings to its own report. Nothing is imported that the script does not import: where
transformers is not loaded yet, the wrap waits for the script's own import of `transformers.trainer`.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

_TRAINER = "transformers.trainer"


def _wrapped(trainer: Any) -> Callable[[], None]:
    """Wrap `trainer.__init__`; the undo puts the original back."""
    original = trainer.__dict__["__init__"]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            from fpdoctor.integrations.hf import FpDoctorCallback

            if not any(isinstance(c, FpDoctorCallback) for c in self.callback_handler.callbacks):
                self.add_callback(FpDoctorCallback())
        except Exception:  # an older transformers: the watch's own hooks judge the steps instead
            pass

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    trainer.__init__ = __init__

    def undo() -> None:
        if trainer.__dict__.get("__init__") is __init__:
            trainer.__init__ = original

    return undo


class _Loader(importlib.abc.Loader):
    """The module's own loader, then `then(module)`."""

    def __init__(self, loader: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._then(module)


class _WhenImported(importlib.abc.MetaPathFinder):
    """Calls `then(module)` once `name` has been imported (by the script)."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then
        self._local = threading.local()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = importlib.util.find_spec(fullname)  # the finders after this one
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, self._then)
        return spec


@contextlib.contextmanager
def callback_in_trainers() -> Iterator[None]:
    """Inside the block, every Trainer made gets the fpdoctor callback (unless it has one)."""
    undo: list[Callable[[], None]] = []

    def wrap(module: ModuleType) -> None:
        trainer = getattr(module, "Trainer", None)
        if isinstance(trainer, type) and "__init__" in trainer.__dict__:
            undo.append(_wrapped(trainer))

    finder: _WhenImported | None = None
    loaded = sys.modules.get(_TRAINER)
    if loaded is not None:
        wrap(loaded)
    else:
        finder = _WhenImported(_TRAINER, wrap)
        sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        if finder is not None and finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for done in undo:
            done()
