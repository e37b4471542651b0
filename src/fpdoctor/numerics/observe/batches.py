"""What a front end hands the step judge about one step's batch: references to run it again, or the
verdict of a step_fn that could judge the forward's outputs only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fpdoctor.preserve import RngState


@dataclass
class MicroBatch:
    """What one `guard.step` call needs to be run again: references, not copies, of its arguments."""

    rng: RngState
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class OutputsOnly:
    """What a step_fn returns when no loss can be seen and it judged the forward's outputs alone
    (`fpdoctor watch` replaying a step whose loss was already NaN/Inf)."""

    finite: bool
    # the outputs were finite but the gradient that reached them from the loss was not: the
    # non-finite value is made after the model (the loss code), and is there again on every run
    after_outputs: bool = False
    # there, rows of an output far out of line with the others (loader.standing_out): (their places, of
    # how many, their largest |x|, the others' largest): one item of the batch the loss cannot take
    standing_out: tuple[list[int], int, float, float] | None = None
    # the non-finite value it stands for, where one was seen (the step's loss; else the first output not
    # finite): what the replay's evidence describes (its kind: NaN or Inf)
    value: Any = None
