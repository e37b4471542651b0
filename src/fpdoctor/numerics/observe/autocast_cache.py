"""A `with torch.autocast(...)` block left open across optimizer steps: every forward runs stale weights.

Autocast casts each fp32 leaf parameter to the low-precision dtype once per block and reuses that copy
(its cast cache), until the outermost block exits. A block that holds the optimizer's step and the next
forward (one `with` around the epoch, the loop or the whole training function) runs every forward after
its first on the weights as they were cast at its first forward: the fp32 weights move, the forward never
sees them, and the loss stays where it was while nothing is NaN.

Read at the optimizer's step: whether autocast (with its cache) is still on there, one call per device
type of the step's forwards. Where it is, the next such step looks once: the step's own forward is run
again with the weights cast afresh (`cache_enabled=False`: what a block that ends before the step gives,
on the same inputs, RNG and buffers) and its outputs are compared with the ones the script got. A block
that ends every step gives the same outputs, bit for bit, and nothing more is looked at; a block that
spans steps gives outputs of other weights. At most LOOKS looks, at the armed step and then 10 and 100
steps later (a small learning rate moves the weights little in one step)."""

from __future__ import annotations

import ast
import linecache
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.userframes import function_at

STALE = 1e-2  # outputs this far from the fresh weights' (relative norm) are not the weights as they are
SAME = 1e-6  # closer than this: the forward ran the weights as they are (a block that ends every step)
LATER = (0, 10, 100)  # the looks, in steps after the first step found under autocast
_AUTOCAST = ("autocast",)  # torch.autocast, torch.amp.autocast, torch.cuda.amp.autocast, `from ... import autocast`


@dataclass(frozen=True)
class Stale:
    """A forward run under a block that spans steps: its outputs against the weights cast afresh."""

    step: int  # the optimizer step whose forward was looked at
    since: int  # the first optimizer step taken inside the block
    difference: float  # relative norm of (the script's outputs - the fresh forward's)
    device_type: str
    dtype: str
    block: tuple[str, int, str, str] | None  # what opened the block: (file, line, its text, how: block_of)


@dataclass
class StaleCasts:
    """One optimizer's look for a block that spans its steps."""

    armed: int | None = None  # the first step taken with autocast (and its cache) on
    looks: int = 0
    found: Stale | None = None
    done: bool = False

    def at_step(
        self,
        step: int,
        autocast: list[tuple[str, torch.dtype]],
        fresh: Callable[[str, torch.dtype], list[torch.Tensor] | None],
        got: list[torch.Tensor],
        frames: Callable[[], list[tuple[str, int, str]]],
    ) -> None:
        """The optimizer's step `step` is taken; its forward ran under `autocast` (device type, dtype) and
        gave `got`; `fresh(device_type, dtype)` runs it again with the weights cast afresh (None: it cannot)."""
        if self.done or not autocast or not torch.is_autocast_cache_enabled():
            return
        on = [(d, t) for d, t in autocast if torch.is_autocast_enabled(d)]
        if not on:
            return
        if self.armed is None:
            self.armed = step
            return
        if step - self.armed < LATER[self.looks]:
            return
        self.looks += 1
        device_type, dtype = on[0]
        outputs = fresh(device_type, dtype)
        difference = _difference(got, outputs) if outputs is not None else None
        if difference is None or difference <= SAME:
            self.done = True  # the weights as they are (or nothing to compare): a block per step
            return
        if difference >= STALE:
            name = str(dtype).removeprefix("torch.")
            self.found = Stale(step, self.armed, difference, device_type, name, block_of(frames()))
            self.done = True
        elif self.looks >= len(LATER):
            self.done = True


def _difference(got: list[torch.Tensor], fresh: list[torch.Tensor]) -> float | None:
    """|got - fresh| / |fresh| over the floating outputs, in fp64; None where they cannot be paired."""
    pairs = [(a, b) for a, b in zip(got, fresh, strict=False) if a.shape == b.shape and a.is_floating_point()]
    if not pairs or len(got) != len(fresh):
        return None
    with torch.no_grad():
        diff = math.sqrt(sum(float((a.double() - b.double()).square().sum()) for a, b in pairs))
        norm = math.sqrt(sum(float(b.double().square().sum()) for _, b in pairs))
    if not (math.isfinite(diff) and math.isfinite(norm)) or norm == 0:
        return None
    return diff / norm


def block_of(frames: list[tuple[str, int, str]]) -> tuple[str, int, str, str] | None:
    """What opened the autocast that holds the step, in the innermost of the user's frames (the step's call,
    then the calls that led to it) that shows one: (file, line, its text, how) where `how` is "with" (the
    innermost `with ...autocast(...)` around the line), "decorator" (`@torch.autocast(...)` on the function
    that runs the line) or "enter_context" (`stack.enter_context(torch.autocast(...))` before the line in it)."""
    for path, line, _ in frames:
        try:
            tree = ast.parse("".join(linecache.getlines(path)))
        except (SyntaxError, ValueError):
            continue
        holding = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.With)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and any(_is_autocast(item.context_expr) for item in node.items)
        ]
        if holding:
            return _at(path, max(holding, key=lambda n: n.lineno).lineno, "with")
        function = function_at(tree, line)
        decorator = next((d for d in function.decorator_list if _is_autocast(d)), None) if function else None
        if decorator is not None:
            return _at(path, decorator.lineno, "decorator")
        entered = [
            node
            for node in ast.walk(function or tree)  # at module level: the script's own lines before it
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "enter_context" and node.args and _is_autocast(node.args[0]) and node.lineno < line
        ]  # fmt: skip
        if entered:
            return _at(path, max(entered, key=lambda n: n.lineno).lineno, "enter_context")
    return None


def _at(path: str, line: int, how: str) -> tuple[str, int, str, str]:
    return path, line, linecache.getline(path, line).split("#")[0].strip(), how


def _is_autocast(expr: ast.expr) -> bool:
    func = expr.func if isinstance(expr, ast.Call) else expr
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in _AUTOCAST


def floats(outputs: list[Any]) -> list[torch.Tensor]:
    return [t for t in outputs if isinstance(t, torch.Tensor) and t.is_floating_point()]
