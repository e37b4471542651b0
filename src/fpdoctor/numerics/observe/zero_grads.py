"""Gradients that reach the optimizer as exact zeros on every step: nothing trains, nothing is NaN.

Under DDP the optimizer receives the all-reduced gradients, which the reference step cannot recompute
(a local step gives this rank's, not the reduction's), so a reduction that returns zeros went unseen: a
communication hook that casts each bucket to float16 first (torch's fp16_compress_hook) turns every
local gradient under half of float16's smallest subnormal (2.98e-08) into 0, and a run whose loss is
1e-8 (targets in metres for a model that outputs kilometres) trains on zeros.

Read at SAMPLED steps only: whether any gradient value the optimizer holds is nonzero (a reduction per
tensor and one host read each)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SAMPLED = frozenset((1, 10, 100, 1000))  # the optimizer steps looked at
LEAST = 2  # looks it takes to say every one was zero


@dataclass
class ZeroGrads:
    """One optimizer's looks at what its steps received."""

    looked: list[int] = field(default_factory=list)
    zero: list[int] = field(default_factory=list)
    # per look, the names of the tensors whose gradient was all zeros while others' were not (a layer whose
    # gradients alone sit under the hook's format: a strain head in SI units beside a temperature head)
    partial: list[frozenset[str]] = field(default_factory=list)
    # the first zero step's local gradients (replayed on this rank without the reduction), where a hook casts
    # them: (step, their largest magnitude, the share of their nonzero values the hook's dtype makes 0, bf16's)
    local: tuple[int, float, float, float] | None = None
    # a step looked at ran 16-bit compute (autocast) or held 16-bit parameters: on one process, where zeros can be
    # the format's (a loss divided by a count that overflowed), not a loss switched off on purpose
    low_precision: bool = False

    def sample(self, step: int, grads: list[torch.Tensor], names: list[str] | None = None) -> None:
        """Step `step`'s gradients (those the optimizer holds), read once each; `names`: theirs, in order."""
        if not grads:
            return
        self.looked.append(step)
        with torch.no_grad():
            nonzero = [bool(g.any()) for g in grads]
        if not any(nonzero):
            self.zero.append(step)
        elif names is not None and len(names) == len(grads):
            self.partial.append(frozenset(n for n, live in zip(names, nonzero, strict=True) if not live))

    @property
    def some_always_zero(self) -> list[str]:
        """The tensors whose gradients were all zeros at every look (LEAST looks or more), while the
        others' were not: sorted; [] where none, or where every gradient was zero (every_step_zero)."""
        if len(self.partial) < LEAST or len(self.partial) != len(self.looked):
            return []
        return sorted(frozenset.intersection(*self.partial))

    @property
    def every_step_zero(self) -> bool:
        return len(self.looked) >= LEAST and self.zero == self.looked


def underflow(dtype: torch.dtype) -> float:
    """The largest magnitude `dtype` rounds to 0: half its smallest subnormal."""
    return float(torch.finfo(dtype).smallest_normal) * float(torch.finfo(dtype).eps) / 2


def flushed(grads: list[torch.Tensor], dtype: torch.dtype, world: int) -> float:
    """The share of the nonzero values of `grads` that a compression hook casting to `dtype` makes 0: cast,
    then divided by the world size in `dtype`, as torch's fp16/bf16_compress_hook does."""
    nonzero = made_zero = 0
    with torch.no_grad():
        for g in grads:
            live = g != 0
            nonzero += int(live.sum())
            made_zero += int(((g.to(dtype) / world) == 0).logical_and(live).sum())
    return made_zero / nonzero if nonzero else 0.0
