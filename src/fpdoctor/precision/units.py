"""An output that is not logits, judged in its own units: the error a user reads against the
tolerance of what the output measures (a temperature in kelvin, a price, a pixel value).

A relative error of 1e-3 says little to a user whose output is a temperature near 300 K and whose
tolerance is 0.05 K; the mean and largest absolute error say it in the output's units. Each beside
its floor, the same figure for the exact output rounded to the candidate's format (what any run
that returns this format loses), and the output's typical magnitude, for scale. Measured on the
same spread sample of the output that the relative error is (compare's `flat_sample`): the
largest error is the sample's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor.precision.metrics import round_to


@dataclass(frozen=True)
class InUnits:
    """Mean and largest |candidate - exact| over the sample, beside rounding's, in the output's units."""

    values: int  # sampled values
    mean: float
    largest: float
    floor_mean: float
    floor_largest: float
    magnitude: float  # mean |exact value|

    def text(self, fmt: str) -> str:
        return (
            f"mean |error| {self.mean:.3g}, largest {self.largest:.3g} (rounding the exact output to {fmt}: "
            f"{self.floor_mean:.3g}, {self.floor_largest:.3g}); the output's mean |value| {self.magnitude:.3g}, "
            f"over {self.values} sampled values"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def in_units(truth: torch.Tensor, candidate: torch.Tensor, fmt: str) -> InUnits | None:
    """`truth` (fp64) and `candidate`, the same sample of an output; None when the candidate's
    values are not all finite (the non-finite findings speak for them) or the sample is empty."""
    if truth.numel() == 0 or candidate.numel() != truth.numel():
        return None
    exact = truth.detach().double().reshape(-1)
    got = candidate.detach().to(exact.device, torch.float64).reshape(-1)
    err = got.sub(exact).abs_()
    floor = round_to(exact, fmt).sub_(exact).abs_()
    read = torch.stack([err.mean(), err.max(), floor.mean(), floor.max(), exact.abs().mean()]).tolist()
    if not all(math.isfinite(v) for v in read[:2]):
        return None
    return InUnits(exact.numel(), *read)
