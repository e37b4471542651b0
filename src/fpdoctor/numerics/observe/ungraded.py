"""Parameters an optimizer holds, that require gradients, and that no backward reaches: part of the
model's forward runs without gradients (a `torch.no_grad()` around a call meant for logging, a
`.detach()` of its output), and that part never trains.

The optimizer steps, the loss falls through the rest of the model, nothing is NaN: a judge of values
sees a healthy run. Sampled at three steps (`SAMPLED`), one look per parameter each; the module is
the largest submodule whose parameters all had none, and it is said only where the user's source shows
the line that stops its gradients (a `with torch.no_grad():` holding its call, a `.detach()` of its
output): an output the loss does not use (a pooler beside the hidden states) leaves no gradient either,
and is no bug. A module frozen on purpose is told to say so with requires_grad_(False)."""

from __future__ import annotations

import ast
import inspect
import linecache
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fpdoctor.userframes import is_user_file

# the optimizer's step counts (from 0) at which the gradients are read: of different remainders by 2 to 10, so
# that heads or tasks taken in turn (every other step, one in five) each had a gradient at one of them
SAMPLED = (0, 11, 23)
_STOPS = ("no_grad", "inference_mode")


@dataclass
class Ungraded:
    """One optimizer's parameters with no gradient at every sampled step so far."""

    none: set[int] | None = None  # ids of trainable parameters with no gradient at every sample
    samples: int = 0
    files: list[str] = field(default_factory=list)  # the user's files on the stack at the first sample
    model: str = "model"  # the script's name for the model, where a user frame binds one

    def sample(self, params: list[torch.Tensor]) -> None:
        """A sampled step: which parameters have no gradient (where some do: all None is a clear's)."""
        missing = {id(p) for p in params if p.grad is None}
        if len(missing) == len(params):
            return
        self.none = missing if self.none is None else self.none & missing
        self.samples += 1


def modules(model: nn.Module, none: set[int]) -> list[tuple[str, list[str]]]:
    """The largest submodules of `model` whose parameters all had no gradient: (path, parameter names)."""
    chosen: list[tuple[str, list[str]]] = []
    for path, module in model.named_modules():
        own = list(module.named_parameters())
        if not own or path == "" or any(path.startswith(c + ".") for c, _ in chosen):
            continue
        if all(id(p) in none for _, p in own):
            chosen.append((path, [f"{path}.{n}" for n, _ in own]))
    return chosen


def written(path: str) -> str:
    """A module path as Python reads it: `blocks.0` -> `blocks[0]`."""
    out = ""
    for part in path.split("."):
        out += f"[{part}]" if part.isdigit() else (f".{part}" if out else part)
    return out


def model_files(model: nn.Module) -> list[str]:
    """The user's files that define the model's module classes: where its forward can stop gradients."""
    found = []
    for module in model.modules():
        try:
            path = inspect.getsourcefile(type(module))
        except TypeError:
            continue
        if path and is_user_file(path):
            found.append(path)
    return list(dict.fromkeys(found))


def stopping_line(path: str, files: Iterable[str]) -> tuple[str, int, str] | None:
    """The line of the user's files that runs the module at `path` (`<x>.encoder(...)`, `<x>.blocks[0](...)`)
    without gradients: the `with` of a no_grad/inference_mode block that holds the call, or the call whose
    output is `.detach()`ed; (file, line, its text), where exactly one does."""
    *_, attr = path.split(".")
    index = int(attr) if attr.isdigit() else None
    if index is not None:
        parts = path.split(".")
        attr = next((p for p in reversed(parts) if not p.isdigit()), "")
    hits: list[tuple[str, int]] = []
    for source in dict.fromkeys(files):
        try:
            tree = ast.parse("".join(linecache.getlines(source)))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any(_stops(item.context_expr) for item in node.items):
                if any(_calls(n, attr, index) for stmt in node.body for n in ast.walk(stmt)):
                    hits.append((source, node.lineno))
            elif isinstance(node, ast.Attribute) and node.attr == "detach" and _calls(node.value, attr, index):
                hits.append((source, node.lineno))
    found = list(dict.fromkeys(hits))
    if len(found) != 1:
        return None
    source, line = found[0]
    return source, line, linecache.getline(source, line).split("#")[0].strip()


def _stops(expr: ast.expr) -> bool:
    func = expr.func if isinstance(expr, ast.Call) else expr
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in _STOPS


def _calls(node: ast.AST, attr: str, index: int | None) -> bool:
    """`<x>.attr(...)`, or `<x>.attr[index](...)` for an item of a ModuleList or Sequential."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if index is not None:
        if not (isinstance(func, ast.Subscript) and isinstance(func.slice, ast.Constant) and func.slice.value == index):
            return False
        func = func.value
    return isinstance(func, ast.Attribute) and func.attr == attr
