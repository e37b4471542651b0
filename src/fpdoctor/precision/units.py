"""An output that is not logits, judged in its own units: the error a user reads against the
tolerance of what the output measures (a temperature in kelvin, a price, a pixel value).

A relative error of 1e-3 says little to a user whose output is a temperature near 300 K and whose
tolerance is 0.05 K; the mean and largest absolute error say it in the output's units. Each beside
its floor, the same figure for the exact output rounded to the candidate's format (what any run
that returns this format loses), and the output's typical magnitude, for scale. Measured on the
same spread sample of the output that the relative error is (compare's `flat_sample`): the
largest error is the sample's.

A regression output often sits far from zero and varies little about where it sits (a temperature
at 288 K that varies by 3 K): the format's spacing there (2 K in bf16) is then a large part of what
the output says, and rounding the exact output alone loses it. The candidate's error equals its
floor, so nothing inside the model is to blame and every figure looks fine; the output's format is
the cause. Where rounding alone costs COARSE of the output's spread (its standard deviation over the
sample), `coarse_finding` says so, with the fix checked: the layer that makes the output kept in
fp32, returning fp32.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.formats import COARSE
from fpdoctor.precision.metrics import round_to
from fpdoctor.report.model import Finding, Trial

# The candidate's mean error within this factor of rounding's is "at the floor": nothing else to blame.
AT_FLOOR = 2.0


@dataclass(frozen=True)
class InUnits:
    """Mean and largest |candidate - exact| over the sample, beside rounding's, in the output's units."""

    values: int  # sampled values
    mean: float
    largest: float
    floor_mean: float
    floor_largest: float
    magnitude: float  # mean |exact value|
    spread: float  # the exact values' standard deviation: what the output varies by

    def text(self, fmt: str) -> str:
        return (
            f"mean |error| {self.mean:.3g}, largest {self.largest:.3g} (rounding the exact output to {fmt}: "
            f"{self.floor_mean:.3g}, {self.floor_largest:.3g}); the output's mean |value| {self.magnitude:.3g}, "
            f"spread (std) {self.spread:.3g}, over {self.values} sampled values"
        )

    @property
    def coarse(self) -> bool:
        """Rounding to the format alone costs COARSE of the output's spread or more."""
        return self.spread > 0 and self.floor_mean >= COARSE * self.spread

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
    spread = exact.std() if exact.numel() > 1 else exact.new_zeros(())
    read = torch.stack([err.mean(), err.max(), floor.mean(), floor.max(), exact.abs().mean(), spread]).tolist()
    if not all(math.isfinite(v) for v in read[:2]):
        return None
    return InUnits(exact.numel(), *read)


def coarse_finding(units: InUnits, fmt: str, head: str, kept: InUnits | None, *, on: str) -> Finding:
    """`output-too-coarse`: the format's rounding alone costs a large share of the output's spread;
    the fix (`head`, the layer that makes the output, kept in fp32 returning fp32) with its check
    (`kept`: the candidate's error then), printed as the fix only where it took most of the error away."""
    share = units.floor_mean / units.spread
    layer = f"`{head}`" if head else "the layer that makes the output"
    message = (
        f"In {fmt} the output cannot hold what it measures: its values sit at {units.magnitude:.4g} on average and "
        f"vary by {units.spread:.3g} (std over {units.values} sampled values), and rounding the exact output to "
        f"{fmt} alone moves it by {units.floor_mean:.3g} on average ({share:.0%} of that spread; the candidate: "
        f"{units.mean:.3g})."
    )
    if units.mean <= AT_FLOOR * units.floor_mean:
        message += (
            " The candidate's error is at this floor, so no part of the model is to blame and every relative figure "
            "looks fine: the output's format is the cause."
        )
    else:  # something inside the model adds to it (the findings before this one name what)
        message += (
            f" The candidate's error is {units.mean / units.floor_mean:.2g}x this floor: besides what the model loses, "
            "the output's format alone is too coarse for it."
        )
    offset = (
        "predict the offset from a constant (y - c, the constant added back in fp32), which the format holds finely"
    )
    if kept is not None and kept.mean <= units.mean / 4:
        fix = (
            f"Keep {layer} in fp32, returning an fp32 output (under autocast: call it outside the autocast region on "
            f"its input .float()); or have it {offset}. Checked: mean |error| {units.mean:.3g} -> {kept.mean:.3g}."
        )
        trial = Trial.checked(
            f"{layer} kept in fp32, returning fp32, the rest in {fmt}",
            metric="mean |error| of the output, in its units",
            before=f"{units.mean:.3g}",
            after=f"{kept.mean:.3g}",
            on=on,
        )
    else:
        # returning fp32 from that layer was tried and is not the fix: what it adds to is rounded before it
        fix = f"Have {layer} {offset}, and keep that constant out of the {fmt} cast."
        why = (
            f"{layer} kept in fp32 left the mean |error| at {kept.mean:.3g} (from {units.mean:.3g})"
            if kept is not None
            else f"{layer} could not be re-run in fp32 in its place"
        )
        trial = Trial.untried(f"the next step, not a fix that was tried: {why}")
    return catalog.make(
        "output-too-coarse",
        message=message,
        fix=fix,
        where={"module": head or None, "op": None},
        evidence={"output_error": units.to_dict(), "share_of_spread": share,
                  "kept_in_fp32": kept.to_dict() if kept is not None else None},
        trial=trial,
    )  # fmt: skip
