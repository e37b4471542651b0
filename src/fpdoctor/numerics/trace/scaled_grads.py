"""Gradients of a scaled loss read as if unscaled: a gradient penalty under GradScaler.

`torch.autograd.grad(scaler.scale(out), inputs, create_graph=True)` returns the gradients times the
loss scale. torch's AMP recipe ("Gradient penalty") divides them by `scaler.get_scale()` before they
make a penalty; without it the penalty holds the scale (its square, for a squared norm), overflows at
65536, and the scaler's backoff then settles where the scaled penalty fits: a scale of a few dozen,
which the run reports as calibration, and a penalty that never measures the true gradient norm.

`ScaledGrads` swaps `GradScaler.scale` and `torch.autograd.grad` for the traced block (class and
module attributes, put back after; the user's objects are never touched): the tensors `scale`
returns are known by identity, and where `autograd.grad` with create_graph=True differentiates one
of them, each gradient it returns is watched until the first op that reads it (`read`, from the
tracer's dispatch, only while one is watched). A multiply by 1/scale or a division by the scale is
the recipe's unscaling; any other op reads the gradients scaled: a finding, at the line of the
autograd.grad call, with the line that read them.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.observe.amp import grad_scaler_class
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import DisableTorchDispatch, scaler_scale
from fpdoctor.userframes import user_location

CALLS_KEPT = 4096  # autograd.grad calls on scaled outputs kept, at most (one or two a step)
# The op that unscales: a multiply by 1/scale or a division by the scale, within this of it.
_SAME = 1e-3
_UNSCALING = frozenset({"mul", "div", "mul_", "div_", "_foreach_mul", "_foreach_div", "_foreach_mul_", "_foreach_div_"})


@dataclass
class _Grads:
    """One autograd.grad call on a scaled output: where, at which step, with what scale, and what
    read its gradients first."""

    location: str  # file:line of the autograd.grad call
    step: int  # optimizer steps taken before it
    scale: torch.Tensor  # the scale the output was multiplied by (a copy, read when judged)
    read_by: str | None = None  # the op that read them scaled, and its line
    unscaled: bool = False


class ScaledGrads:
    """Context manager over a traced block (see the module docstring). `step` gives the optimizer
    steps taken so far."""

    def __init__(self, step: Callable[[], int], *, reads: bool = True) -> None:
        """`reads`: a tracer reads the gradients op by op (`read`); without one (the watch, which only
        asks whether a penalty on scaled gradients ran), no gradient is held and the calls kept are
        bounded, for runs of a million steps."""
        self._step = step
        self._reads = reads
        # id of each tensor GradScaler.scale returned -> (it, the scaler), weakly
        self._scaled: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Any]]] = {}
        self.pending: dict[int, tuple[weakref.ref[torch.Tensor], _Grads]] = {}  # the tracer reads it per op
        self.calls: list[_Grads] = []
        self._saved: list[tuple[Any, str, Any]] = []
        self._watched_at = -1  # the optimizer step the watched gradients were made in
        self.create_graph = 0  # autograd.grad calls with create_graph=True, scaled or not (a penalty on gradients)
        self.grads = 0  # autograd.grad calls of any kind (a loop that takes its gradients without .backward())

    def __enter__(self) -> ScaledGrads:
        scaler = grad_scaler_class()
        scale, grad = vars(scaler).get("scale"), torch.autograd.grad
        if scale is None:
            return self
        watch = self

        def scaled(scaler_self: Any, outputs: Any) -> Any:
            out = scale(scaler_self, outputs)
            try:
                if len(watch._scaled) > 64:  # one or two a step: the dead ones dropped now and then
                    watch._scaled = {k: v for k, v in watch._scaled.items() if v[0]() is not None}
                for t in tensors_in(out):
                    watch._scaled[id(t)] = (weakref.ref(t), weakref.ref(scaler_self))
            except Exception:  # the observer never raises into the user's step
                pass
            return out

        def differentiated(*args: Any, **kwargs: Any) -> Any:
            result = grad(*args, **kwargs)
            with contextlib.suppress(Exception):  # the observer never raises into the user's step
                watch._differentiated(args, kwargs, result)
            return result

        self._saved = [(scaler, "scale", scale), (torch.autograd, "grad", grad)]
        scaler.scale = scaled
        torch.autograd.grad = differentiated
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self._saved:
            setattr(owner, name, original)
        self._saved = []
        self.pending.clear()

    def _differentiated(self, args: Any, kwargs: dict[str, Any], result: Any) -> None:
        create_graph = kwargs.get("create_graph", args[4] if len(args) > 4 else False)
        outputs = kwargs.get("outputs", args[0] if args else None)
        self.create_graph += bool(create_graph)
        self.grads += 1
        if not create_graph or not self._scaled:
            return
        held = [h for t in tensors_in(outputs) if (h := self._scaled.get(id(t))) is not None and h[0]() is t]
        scaler = held[0][1]() if held else None
        if scaler is None or not scaler.is_enabled():
            return
        scale = scaler_scale(scaler)
        if not isinstance(scale, torch.Tensor):
            return
        user = user_location(sys._getframe(2))
        with DisableTorchDispatch():
            kept = scale.detach().reshape(-1)[0].clone()
        call = _Grads(f"{user[0]}:{user[1]}" if user else "", self._step(), kept)
        if len(self.calls) < CALLS_KEPT:
            self.calls.append(call)
        if not self._reads:
            return
        self._watched_at = call.step
        for t in tensors_in(result):
            self.pending[id(t)] = (weakref.ref(t), call)

    def read(self, func: Any, args: Any, out: Any, view: bool) -> None:
        """An op of the tracer's dispatch, while gradients are watched: a view passes the watch on,
        the recipe's unscaling ends it, any other op that reads them is the finding's. Gradients no op
        read before the next optimizer step are let go: the tracer's ops go their usual way again."""
        if self._step() != self._watched_at:
            self.pending.clear()
            return
        first = tensors_in(args[0]) if args else []  # what a multiply or a division scales (a foreach's list)
        for t in tensors_in(args):
            held = self.pending.get(id(t))
            if held is None or held[0]() is not t:
                continue
            call = held[1]
            if view:
                for o in tensors_in(out):
                    self.pending[id(o)] = (weakref.ref(o), call)
                return
            del self.pending[id(t)]
            if call.read_by is not None or call.unscaled:
                continue
            name = func.overloadpacket.__name__
            if name in _UNSCALING and any(x is t for x in first) and _by_scale(name, args, call.scale):
                call.unscaled = True
            else:
                user = user_location(sys._getframe(2))
                call.read_by = f"{name} at {user[0]}:{user[1]}" if user else name

    def findings(self) -> list[Finding]:
        """One finding per line whose gradients were read scaled, at its first step."""
        seen: set[str] = set()
        out = []
        for call in self.calls:
            if call.read_by is None or call.location in seen:
                continue
            seen.add(call.location)
            out.append(_finding(call, sum(1 for c in self.calls if c.location == call.location and c.read_by)))
        return out


def _by_scale(name: str, args: Any, scale: torch.Tensor) -> bool:
    """args[1] is 1/scale (a multiply) or the scale (a division)."""
    other = args[1] if len(args) > 1 else None
    if isinstance(other, torch.Tensor):
        if other.numel() != 1:
            return False
        with DisableTorchDispatch():
            other = float(other.reshape(()))
    if not isinstance(other, (int, float)) or not math.isfinite(other) or other == 0:
        return False
    with DisableTorchDispatch():
        s = float(scale)
    ratio = other * s if name.startswith("mul") else other / s
    return abs(ratio - 1.0) <= _SAME


def _finding(call: _Grads, times: int) -> Finding:
    scale = float(call.scale)
    line = call.location.rpartition(":")[2]
    message = (
        f"torch.autograd.grad at {call.location} differentiates an output scaled by GradScaler.scale (scale "
        f"{scale:g} at optimizer step {call.step + 1}) with create_graph=True: the gradients it returns are the "
        f"true ones times the scale, and {call.read_by} reads them as they are (on {times} of its calls). A penalty "
        "made from them grows with the scale (its square, for a squared norm): it overflows at the first scales, "
        "the scaler backs off until the scaled penalty fits (the run reports it as calibration), and the penalty "
        "never measures the true gradients."
    )
    scaler, unscale, last = _unscale_statement(call.location)
    line = str(last) if last is not None else line  # after the statement's last line: a call may span several
    fix = (
        f"Unscale them right after line {line}, as torch's AMP recipe for a gradient penalty does: inv_scale = "
        f"1.0 / {scaler}.get_scale(); {unscale}, then the penalty from them, added to the loss that "
        f"{scaler}.scale(loss).backward() scales."
    )
    return catalog.make(
        "gradients-still-scaled",
        message=message,
        fix=fix,
        where={"module": None, "phase": "backward"},
        evidence={"location": call.location, "read_by": call.read_by, "scale": scale, "step": call.step + 1,
                  "calls": times},
        trial=Trial.untried(
            "a change to the training code, which fpdoctor does not write; what was measured: no op multiplied the "
            "gradients by 1/scale or divided them by the scale before the first that read them"
        ),
    )  # fmt: skip


def _unscale_statement(location: str) -> tuple[str, str, int | None]:
    """The scaler as the code names it, the unscaling statement in the user's own names and the
    statement's last line: the autograd.grad call's statement read from its file (`grads =
    torch.autograd.grad(...)[0]` holds one tensor, `gx, gy = ...` two, `grads = ...` a tuple), the
    scaler the expression whose `.scale(` it calls (`scaler_d`, `self.scaler`)."""
    scaler, unscale, last = "scaler", "grads = [g * inv_scale for g in grads]", None
    path, _, line_text = location.rpartition(":")
    try:
        line = int(line_text)
        tree = ast.parse("".join(linecache.getlines(path)))
    except (ValueError, SyntaxError):
        return scaler, unscale, last
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        if not (node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        value, target = node.value, node.targets[0]
        call = value.value if isinstance(value, ast.Subscript) else value
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "grad"):
            continue
        last = node.end_lineno
        for sub in ast.walk(call):
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "scale":
                scaler = ast.unparse(sub.func.value)
                break
        if isinstance(target, ast.Name) and isinstance(value, ast.Subscript):
            unscale = f"{target.id} = {target.id} * inv_scale"  # one gradient, taken out of the tuple
        elif isinstance(target, ast.Name):
            unscale = f"{target.id} = [g * inv_scale for g in {target.id}]"
        elif isinstance(target, ast.Tuple) and all(isinstance(e, ast.Name) for e in target.elts):
            names = [e.id for e in target.elts if isinstance(e, ast.Name)]
            unscale = f"{', '.join(names)} = {', '.join(f'{n} * inv_scale' for n in names)}"
        break
    return scaler, unscale, last
