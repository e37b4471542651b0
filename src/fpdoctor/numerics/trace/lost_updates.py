"""In-place running updates that a low-precision tensor rounds away, outside the model's training.

An EMA of the weights kept in bf16 (`ema.mul_(0.998).add_(w, alpha=0.002)`), a running mean or
statistic accumulated in fp16, an accumulator with a small step: each update is below half the
spacing of the values it is added to, so the tensor keeps its values (or moves by whole spacings
in the wrong direction) and nothing goes NaN. The optimizer's own updates of low-precision weights
are TRN010's (updates/); this watches the other in-place updates: on a narrow-dtype tensor that
wants no gradient, outside optimizer.step, the first CHECKED calls of each op at each source line
are redone exactly (fp64) and in fp32 from the same values, and the update the tensor kept is
compared with the exact one. Where it keeps less than half of it on every call checked, the line
is TRN010 with the tensor's dtype and shape, the update's lost share, and the fix checked: the same
op on an fp32 copy from the same values, against the exact (fp64) update.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.report.model import Finding, Trial
from fpdoctor.userframes import user_location

ACCUMULATES = frozenset({"add_", "sub_", "mul_", "lerp_", "addcmul_", "addcdiv_"})
CHECKED = 3  # calls of each (op, line) redone in fp32
LOST = 0.5  # an update is lost where what the tensor kept is off by half of it or more
_NARROW = (torch.bfloat16, torch.float16)
_SMALLEST = 64  # values: a scalar or a handful is not a running state
# and at most this many: the check's fp64 and fp32 copies of a larger one (a big embedding) would cost
# the job memory; the line's smaller tensors (an EMA updates every parameter at the same line) are checked
_LARGEST = 1 << 22


@dataclass
class _Line:
    op: str
    dtype: str
    shape: list[int]
    lost: list[float] = field(default_factory=list)  # per call checked: ||kept - exact|| / ||exact update||
    kept_fp32: list[float] = field(default_factory=list)  # the same for the update kept in an fp32 tensor


class LostUpdates:
    """Per (op, source line), what the first calls kept of their update (see the module docstring)."""

    def __init__(self) -> None:
        self.lines: dict[tuple[str, int, str], _Line] = {}
        self._counts: dict[tuple[str, int, str], int] = {}

    def before(self, name: str, args: Any, phase: Callable[[], str]) -> Any:
        """What to keep before the op runs (its target's values), or None: not such an update."""
        if name not in ACCUMULATES or not args:
            return None
        t = args[0]
        if not isinstance(t, torch.Tensor) or t.dtype not in _NARROW or t.requires_grad:
            return None
        if not _SMALLEST <= t.numel() <= _LARGEST:
            return None
        if phase() in ("optimizer", "backward"):  # the optimizer's updates are TRN010's, .grad sums TRN011's
            return None
        where = user_location(sys._getframe())
        if where is None:
            return None
        key = (where[0], where[1], name)
        count = self._counts.get(key, 0)
        if count >= CHECKED:
            return None
        self._counts[key] = count + 1
        return key, t.detach().clone()

    def after(self, kept: Any, func: Any, args: Any, kwargs: Any) -> None:
        """The update the tensor kept, and the one an fp32 tensor keeps, against the update made exactly
        (in fp64) from the same values."""
        key, old = kept
        t = args[0]
        made = {}
        for dtype in (torch.float64, torch.float32):
            wide = old.to(dtype)
            rest = [a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args[1:]]
            func(wide, *rest, **(kwargs or {}))  # in place on the copy
            made[dtype] = wide.double()
        exact = made[torch.float64] - old.double()
        size = float(exact.norm())
        if size == 0.0:
            return
        line = self.lines.setdefault(key, _Line(key[2], str(t.dtype).removeprefix("torch."), list(t.shape)))
        line.lost.append(float((t.detach().double() - made[torch.float64]).norm()) / size)
        line.kept_fp32.append(float((made[torch.float32] - made[torch.float64]).norm()) / size)

    def findings(self) -> list[Finding]:
        """One finding per source line whose updates were lost on every call checked (its ops together:
        `ema.mul_(decay).add_(w, alpha=1 - decay)` is one running update)."""
        by_line: dict[tuple[str, int], list[_Line]] = {}
        for (file, number, _), line in self.lines.items():
            by_line.setdefault((file, number), []).append(line)
        out = []
        for (file, number), found in by_line.items():
            lost = [x for line in found for x in line.lost]
            kept_fp32 = [x for line in found for x in line.kept_fp32]
            if max(len(line.lost) for line in found) < 2 or min(lost) < LOST or max(kept_fp32) >= LOST:
                continue  # one call proves little (a running update is made on every step); fp32 must keep it
            line = found[0]
            ops = " and ".join(f"aten.{x.op}" for x in found)
            where = f"{file}:{number}"
            share = (
                f"{min(lost):.0%}" if f"{min(lost):.0%}" == f"{max(lost):.0%}" else f"{min(lost):.0%}-{max(lost):.0%}"
            )
            out.append(
                catalog.make(
                    "update-rounded-away",
                    title=f"A running update in {line.dtype} is rounded away: the tensor it updates stops following",
                    message=(
                        f"{ops} at {where} update{'s' if len(found) == 1 else ''} a {line.dtype} tensor of shape "
                        f"{line.shape} in place (no "
                        f"gradient, outside the optimizer step: an EMA of weights, a running mean or statistic), and "
                        f"on each of the {len(lost)} calls checked the tensor kept an update off by "
                        f"{share} of the one the op makes exactly from the same values: "
                        f"each step's change is below half the spacing of {line.dtype} at those values, so the "
                        "tensor stays where it was (or moves by whole spacings). Nothing goes NaN; what reads it "
                        "(an EMA model's evaluation) does not improve."
                    ),
                    where={"module": None, "op": f"aten.{line.op}", "phase": "other"},
                    evidence={
                        "kind": "running-update",
                        "location": where,
                        "dtype": line.dtype,
                        "shape": line.shape,
                        "lost": lost,
                        "count": len(lost),
                        "numel": None,
                    },
                    fix=(
                        f"keep that tensor in fp32 (an EMA copy of the weights: deepcopy the model and leave it in "
                        f"fp32, cast it to {line.dtype} only to evaluate); its update at {where} in fp32 keeps all of "
                        "it"
                    ),
                    trial=Trial.checked(
                        f"the tensor in fp32, {ops} at {where} run on it from the same values",
                        metric="share of the exact update lost",
                        before=share,
                        after=f"{max(kept_fp32):.2%} at most",
                        on=f"the first {len(lost)} calls of the line",
                    ),
                )
            )
        return out
