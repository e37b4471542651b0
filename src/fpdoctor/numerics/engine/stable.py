"""Composites that torch computes in a stable form: the fix that holds for every input, not only the
ones a step happened to see.

`log(1 - sigmoid(z))` overflows in fp16 once sigmoid rounds to 1 (z > ~8); in fp32 the same lines
go on until z > ~17, then fail the same way. More precision only moves the edge: a confident
classifier crosses it a few hundred steps later. `F.logsigmoid(-z)` never rounds through 1. So
where the chain from an origin down to the op that made NaN/Inf is one of these composites, the fix
is the stable form, checked in the run's own dtype on the inputs the step read and on those inputs
scaled to the dtype's largest values (where the composite in fp32 is checked to fail too).

Some composites fail by rounding, not by overflowing: `log(1 + exp(s))` (a softplus by hand) is
log(1) = 0 in bf16 once exp(s) is below half bf16's spacing at 1 (s < -6), and the NaN or Inf comes
later, from what reads the 0 (a log of the variance it made). Such a form may be the chain's start:
its stable value (`torch.log1p`) is handed to the chain's later ops, re-run as they ran, and the fix
holds where the op that made NaN/Inf is then finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Form:
    ops: tuple[str, ...]  # op packets from the origin down to the failing op
    written: str  # the composite as code writes it
    stable: str  # what to write instead
    composite: Callable[[torch.Tensor, Any], torch.Tensor]
    call: Callable[[torch.Tensor, Any], torch.Tensor]
    # the start of a longer chain: the ops after it re-run on its stable value (see the docstring)
    prefix: bool = False
    # the tensor the composite is of, from the origin's arguments; None where they make another one
    operand: Callable[[tuple[Any, ...]], torch.Tensor | None] = lambda args: args[0]
    why: str = "without rounding through the value that overflows or underflows (a probability rounded to 0 or 1)"


def one_plus(args: tuple[Any, ...]) -> torch.Tensor | None:
    """x of `1 + x` (or `x + 1`) from aten.add's arguments: the other operand is exactly 1."""
    if len(args) < 2 or (len(args) > 2 and args[2] != 1):
        return None
    a, b = args[0], args[1]
    for x, one in ((a, b), (b, a)):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            if isinstance(one, (int, float)) and one == 1:
                return x
            if isinstance(one, torch.Tensor) and one.numel() == 1 and float(one) == 1.0:
                return x
    return None


def _dim(args: tuple[Any, ...]) -> Any:
    return args[1] if len(args) > 1 else -1


def _one_dim(d: Any) -> int:
    """A reduction's dim as softmax takes it: one int (sum's is a list)."""
    return int(d[0]) if isinstance(d, (list, tuple)) else int(d)


FORMS = (
    Form(("sigmoid", "log"), "log(sigmoid(z))", "F.logsigmoid(z)",
         lambda z, _: torch.log(torch.sigmoid(z)), lambda z, _: F.logsigmoid(z)),
    Form(("sigmoid", "rsub", "log"), "log(1 - sigmoid(z))", "F.logsigmoid(-z)",
         lambda z, _: torch.log(1 - torch.sigmoid(z)), lambda z, _: F.logsigmoid(-z)),
    Form(("_softmax", "log"), "log(softmax(x, dim))", "F.log_softmax(x, dim)",
         lambda x, d: torch.log(torch.softmax(x, d)), F.log_softmax),
    Form(("exp", "sum", "log"), "log(exp(x).sum(dim))", "torch.logsumexp(x, dim)",
         lambda x, d: torch.log(torch.exp(x).sum(d)), torch.logsumexp),
    # a softmax by hand: its probabilities overflow to Inf / Inf = NaN where exp passes the format's range
    Form(("exp", "sum", "div"), "exp(x) / exp(x).sum(dim)", "torch.softmax(x, dim)",
         lambda x, d: torch.exp(x) / torch.exp(x).sum(d, keepdim=True),
         lambda x, d: torch.softmax(x, _one_dim(d))),
    # a softmax by hand, then its log (a KL or cross-entropy between two of them)
    Form(("exp", "sum", "div", "log"), "log(exp(x) / exp(x).sum(dim))", "F.log_softmax(x, dim)",
         lambda x, d: torch.log(torch.exp(x) / torch.exp(x).sum(d, keepdim=True)),
         lambda x, d: F.log_softmax(x, _one_dim(d))),
    # the same with a guard against log(0) between them, an eps that fp16 rounds to 0 or one that clips
    Form(("exp", "sum", "div", "add", "log"), "log(exp(x) / exp(x).sum(dim) + eps)", "F.log_softmax(x, dim)",
         lambda x, d: torch.log(torch.exp(x) / torch.exp(x).sum(d, keepdim=True) + 1e-8),
         lambda x, d: F.log_softmax(x, _one_dim(d))),
    Form(("exp", "add", "log"), "log(1 + exp(x))", "F.softplus(x) (or torch.logaddexp(torch.zeros_like(x), x))",
         lambda x, _: torch.log(1 + torch.exp(x)), lambda x, _: F.softplus(x),
         why="without exp, which overflows past x ~ 88 in fp32 (~11 in fp16)"),
    Form(("cosh", "log"), "log(cosh(x))", "x.abs() + F.softplus(-2 * x.abs()) - math.log(2)",
         lambda x, _: torch.log(torch.cosh(x)), lambda x, _: x.abs() + F.softplus(-2 * x.abs()) - math.log(2),
         why="without cosh, which overflows past |x| ~ 89 in fp32 (~11 in fp16)"),
    Form(("add", "log"), "log(1 + x)", "torch.log1p(x) (for a softplus, log(1 + exp(s)): F.softplus(s))",
         lambda x, _: torch.log(1 + x), lambda x, _: torch.log1p(x), prefix=True, operand=one_plus,
         why="without rounding 1 + x to 1 where x is small"),
)  # fmt: skip


@dataclass(frozen=True)
class Met:
    """A form a trace met at a source line once an exp had overflowed: where the same code writes
    the same composite again, the fix belongs there too, overflowed in this run or not."""

    ops: tuple[str, ...]
    written: str
    stable: str
    dtype: str  # its exp's dtype
    overflowed: bool  # its exp made Inf in this run
    checked: bool  # its stable form was checked on the values it read
    absmax: float | None = None  # where it did not overflow: its largest |x|

    @property
    def edge(self) -> float:
        """The x past which exp(x) overflows this dtype."""
        return math.log(torch.finfo(getattr(torch, self.dtype)).max)


@dataclass
class Checked:
    """A stable form tried: finite on the step's inputs (largest |value| then) and on them scaled to
    the dtype's largest values; whether the composite in fp32 fails there."""

    form: Form
    dtype: str
    absmax: float
    scaled: bool
    fp32_fails: bool  # the lines in fp32 are non-finite on the scaled inputs ...
    fp32_fails_here: bool = False  # ... and on the step's own inputs
    picked: tuple[str, ...] = ()  # the ops that picked values of the composite (a diagonal), as the code takes them


def form_of(packets: list[str]) -> Form | None:
    """The form the chain is (its op packets from the origin down), or starts with (a prefix form)."""
    whole = next((f for f in FORMS if tuple(packets) == f.ops), None)
    if whole is not None:
        return whole
    return next((f for f in FORMS if f.prefix and tuple(packets[: len(f.ops)]) == f.ops), None)


def check(
    form: Form, origin_args: tuple[Any, ...], tail_args: tuple[Any, ...],
    downstream: Callable[[torch.Tensor], float | None] | None = None, *, picked: tuple[str, ...] = (),
) -> Checked | None:  # fmt: skip
    """The stable form on the origin's input as it ran, and scaled to its dtype's range; None where it
    is not finite there (no fix to print). `tail_args`: the reduction's arguments (its dim).
    `downstream`: where the form is the chain's start, the chain's later ops re-run on its value as
    they ran: the failing op's largest |value| then, None where it is not cured. `picked`: the ops
    that took some of the composite's values (finite wherever the whole is), said with the fix."""
    x = form.operand(origin_args)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        return None
    extra = _dim(origin_args) if form.ops[0] == "_softmax" else _dim(tail_args)
    with torch.no_grad():
        out = form.call(x, extra)
        if not bool(torch.isfinite(out).all()):
            return None
        reached = downstream(out) if downstream is not None else float(out.abs().max())
        if reached is None:
            return None
        biggest = float(x.abs().max())
        limit = float(torch.finfo(x.dtype).max) / 4
        scaled = (x.double() * (limit / biggest)).to(x.dtype) if biggest > 0 else x
        holds = bool(torch.isfinite(form.call(scaled, extra)).all())
        fp32_fails = not bool(torch.isfinite(form.composite(scaled.float(), extra)).all())
        here = not bool(torch.isfinite(form.composite(x.float(), extra)).all())
    return Checked(form, str(x.dtype).removeprefix("torch."), reached, holds, fp32_fails, here, picked)
