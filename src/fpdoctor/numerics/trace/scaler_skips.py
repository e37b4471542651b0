"""GradScaler skips in a trace: calibration is the scaler's business, a scaler that never steps is ours.

Under fp16 loss scaling the first steps overflow by design: the scale starts at 65536, the
scaler finds Inf in the gradients, skips the step and halves the scale until the gradients fit.
Those skips, and the non-finite gradients behind them, are the scaler working: a note, never an
error. Skipping that persists is the error, because the optimizer does not run: every step
skipped (from `MIN_ALL_SKIPPED` steps: fewer can still be the calibration from 65536, which takes
a halving per skip), `MAX_CONSECUTIVE_SKIPS` in a row, or a scale below `MIN_SCALE` (torch's
GradScaler documentation: under 1 something is wrong), the thresholds the training sentinel uses;
and, in a trace, `MIN_ALL_SKIPPED` skips in a row to its end after steps that stepped (`stopped`).
The origin of the recurring non-finite value is the producing op (by op and source line) found
on the most skipped steps, the earliest of those in the trace where several are.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from functools import cached_property

from fpdoctor.numerics.observe.amp import MAX_CONSECUTIVE_SKIPS, MIN_SCALE

# Eight halvings take the default scale from 65536 to 256: gradients that still overflow there
# are 256 times fp16's max unscaled, not a scale still calibrating.
MIN_ALL_SKIPPED = 8


@dataclass(frozen=True)
class ScalerRun:
    """What an enabled GradScaler did over the traced steps: (step, skipped, scale used) each."""

    steps: tuple[tuple[int, bool, float], ...]

    @cached_property
    def skipped(self) -> frozenset[int]:
        return frozenset(step for step, skipped, _ in self.steps if skipped)

    @property
    def total(self) -> int:
        return len(self.steps)

    @cached_property
    def longest(self) -> tuple[int, int]:
        """(length, first step) of the longest run of consecutive skipped steps."""
        best, run, first = (0, 0), 0, 0
        for step, skipped, _ in self.steps:
            if skipped:
                first = step if run == 0 else first
                run += 1
                if run > best[0]:
                    best = (run, first)
            else:
                run = 0
        return best

    @cached_property
    def scales(self) -> list[float]:
        return [scale for _, _, scale in self.steps if math.isfinite(scale)]

    @property
    def every_step(self) -> bool:
        return bool(self.steps) and len(self.skipped) == self.total

    @property
    def stopped(self) -> bool:
        """Skipping that lasts to the trace's end, MIN_ALL_SKIPPED steps or more, after steps that
        stepped: a scale that has calibrated skips again a step at a time (after each growth), so
        gradients 256-fold past where they fitted are a run that diverged, not the scale."""
        trailing = 0
        for _, skipped, _ in reversed(self.steps):
            if not skipped:
                break
            trailing += 1
        return MIN_ALL_SKIPPED <= trailing < self.total

    @property
    def collapsed(self) -> bool:
        """The skipping persists: the optimizer stopped running, whatever the scale does next."""
        return (
            (self.every_step and self.total >= MIN_ALL_SKIPPED)
            or self.longest[0] >= MAX_CONSECUTIVE_SKIPS
            or any(scale < MIN_SCALE for scale in self.scales)
            or self.stopped
        )

    def scale_text(self) -> str:
        """'65536 -> 256', the scale the first and the last step ran with."""
        if not self.scales:
            return "unknown"
        first, last = self.scales[0], self.scales[-1]
        return f"{first:g}" if first == last else f"{first:g} -> {last:g}"


def recurring(found: Iterable[tuple[int, Hashable, int]]) -> tuple[int, int] | None:
    """(record index, steps it recurs on) of the origin among (step, key, record index) triples
    in trace order: the key seen on the most steps, the earliest first seen where several tie."""
    steps: dict[Hashable, set[int]] = {}
    first: dict[Hashable, int] = {}
    for step, key, index in found:
        steps.setdefault(key, set()).add(step)
        first.setdefault(key, index)
    if not steps:
        return None
    key = min(steps, key=lambda k: (-len(steps[k]), first[k]))
    return first[key], len(steps[key])
