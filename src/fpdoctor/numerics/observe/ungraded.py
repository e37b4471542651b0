"""Parameters an optimizer holds, that require gradients, and that no backward reaches: part of the
model's forward runs without gradients (a `torch.no_grad()` around a call meant for logging, a
`.detach()` of its output), and that part never trains.

The optimizer steps, the loss falls through the rest of the model, nothing is NaN: a judge of values
sees a healthy run. Sampled at two steps (the first and a later one, `SAMPLED`), one look per parameter
each; the module is named by the largest submodule whose parameters all had none, and the line that
stops the gradients where the user's source shows one (a `with torch.no_grad():` holding its call, a
`.detach()` of its output). A module frozen on purpose is told to say so with requires_grad_(False)."""

from __future__ import annotations

import ast
import linecache
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

SAMPLED = (0, 10)  # the optimizer's step counts (from 0) at which the gradients are read
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


def stopping_line(attr: str, files: Iterable[str]) -> tuple[str, int, str] | None:
    """The line of the user's files that runs `<x>.attr(...)` without gradients: the `with` of a
    no_grad/inference_mode block that holds the call, or the call whose output is `.detach()`ed;
    (path, line, its text), where exactly one does."""
    hits: list[tuple[str, int]] = []
    for path in dict.fromkeys(files):
        try:
            tree = ast.parse("".join(linecache.getlines(path)))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.With) and any(_stops(item.context_expr) for item in node.items):
                if any(_calls(n, attr) for stmt in node.body for n in ast.walk(stmt)):
                    hits.append((path, node.lineno))
            elif isinstance(node, ast.Attribute) and node.attr == "detach" and _calls(node.value, attr):
                hits.append((path, node.lineno))
    found = list(dict.fromkeys(hits))
    if len(found) != 1:
        return None
    path, line = found[0]
    return path, line, linecache.getline(path, line).split("#")[0].strip()


def _stops(expr: ast.expr) -> bool:
    func = expr.func if isinstance(expr, ast.Call) else expr
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in _STOPS


def _calls(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
