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
sample; where the sample is the whole output, the mean of its rows' own: series at their own levels,
a price per asset, a temperature per station, vary little within a row and much across rows), and
the candidate returns the output in that format, `coarse_finding` says so, with the fix checked: the
layer that makes the output kept in fp32, returning fp32; or, where the model's own ops make it (a
de-normalisation around its submodules), those ops in fp32 on the inputs as given.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.formats import COARSE
from fpdoctor.precision.metrics import round_to
from fpdoctor.report.model import Finding, Severity, Trial

# The candidate's mean error within this factor of rounding's is "at the floor": nothing else to blame.
AT_FLOOR = 2.0
# A mean error this share of what the output varies by, and this many times rounding's, is the output
# lost, whatever the per-module errors say (a sin of a large argument: each op exact on what it reads)
LOST = 0.1
LOST_FLOOR = 8.0


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
    # where the sample is the whole output, of rows of `row` values (its last dim): the mean of each row's
    # own standard deviation. Series at their own levels (prices of many assets, a forecast per sensor)
    # vary little within a row and much across rows: what a row says is its variation, not its level
    row_spread: float | None = None
    row: int | None = None

    def text(self, fmt: str) -> str:
        within = (
            f" (within a row of {self.row}: {self.row_spread:.3g})"
            if self.row_spread is not None and self.row_spread < self.spread / 4
            else ""
        )
        return (
            f"mean |error| {self.mean:.3g}, largest {self.largest:.3g} (rounding the exact output to {fmt}: "
            f"{self.floor_mean:.3g}, {self.floor_largest:.3g}); the output's mean |value| {self.magnitude:.3g}, "
            f"spread (std) {self.spread:.3g}{within}, over {self.values} sampled values"
        )

    @property
    def varies(self) -> float:
        """What the output varies by: its spread, or within its rows where they vary far less."""
        if self.row_spread is not None and 0 < self.row_spread < self.spread:
            return self.row_spread
        return self.spread

    @property
    def coarse(self) -> bool:
        """Rounding to the format alone costs COARSE of what the output varies by, or more, and the
        candidate's output is held in it (an error far below rounding's: it returns a wider one)."""
        held = self.mean * AT_FLOOR >= self.floor_mean
        return held and self.varies > 0 and self.floor_mean >= COARSE * self.varies

    @property
    def lost(self) -> bool:
        """The candidate's error is LOST of what the output varies by, far above rounding's: the output
        no longer says what it measures, whether or not a module's own error stands out."""
        return self.varies > 0 and self.mean >= LOST * self.varies and self.mean >= LOST_FLOOR * self.floor_mean

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def in_units(truth: torch.Tensor, candidate: torch.Tensor, fmt: str, row: int | None = None) -> InUnits | None:
    """`truth` (fp64) and `candidate`, the same sample of an output; None when the candidate's
    values are not all finite (the non-finite findings speak for them) or the sample is empty. `row`:
    the output's last dim, where the sample is the whole output in order (its rows' own spread)."""
    if truth.numel() == 0 or candidate.numel() != truth.numel():
        return None
    exact = truth.detach().double().reshape(-1)
    got = candidate.detach().to(exact.device, torch.float64).reshape(-1)
    err = got.sub(exact).abs_()
    floor = round_to(exact, fmt).sub_(exact).abs_()
    spread = exact.std() if exact.numel() > 1 else exact.new_zeros(())
    rows = row is not None and row > 1 and exact.numel() % row == 0 and exact.numel() > row
    within = exact.view(-1, row).std(-1).mean() if rows else spread  # type: ignore[arg-type]
    read = torch.stack([err.mean(), err.max(), floor.mean(), floor.max(), exact.abs().mean(), spread, within])
    figures = read.tolist()
    if not all(math.isfinite(v) for v in figures[:2]):
        return None
    mean, largest, floor_mean, floor_largest, magnitude, spread_, within_ = figures
    return InUnits(
        exact.numel(), mean, largest, floor_mean, floor_largest, magnitude, spread_,
        row_spread=within_ if rows else None, row=row if rows else None,
    )  # fmt: skip


def coarse_finding(
    units: InUnits, fmt: str, head: str, kept: InUnits | None, *, on: str, own: InUnits | None = None,
    children: list[str] | None = None,
) -> Finding:  # fmt: skip
    """`output-too-coarse`: the format's rounding alone costs a large share of the output's spread;
    the fix (`head`, the layer that makes the output, kept in fp32 returning fp32) with its check
    (`kept`: the candidate's error then), printed as the fix only where it took most of the error away."""
    share = units.floor_mean / units.varies
    layer = f"`{head}`" if head else "the layer that makes the output"
    varies = (
        f"vary by {units.varies:.3g} within a row of {units.row} (the mean of each row's std; {units.spread:.3g} "
        "across rows)"
        if units.varies < units.spread
        else f"vary by {units.spread:.3g} (std over {units.values} sampled values)"
    )
    message = (
        f"In {fmt} the output cannot hold what it measures: its values sit at {units.magnitude:.4g} on average and "
        f"{varies}, and rounding the exact output to "
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
        # as the check ran it: the layer's own fp32 weights (the model's cast rounds them: an offset of 288 in
        # its bias is off by 0.1 in bf16) and its input cast in (a Linear refuses mixed dtypes)
        path = f"model.get_submodule({head!r})" if head else "that layer"
        fix = (
            f"Keep {layer} in fp32, with its fp32 weights and an fp32 input, returning an fp32 output: before the "
            f"model's cast, saved = {{k: v.clone() for k, v in {path}.state_dict().items()}}; after it, "
            f"{path}.float().load_state_dict(saved); {path}.register_forward_pre_hook(lambda m, args: "
            "tuple(a.float() if a.is_floating_point() else a for a in args)) (under autocast: call it outside the "
            f"autocast region on its input .float()); or have it {offset}. Checked: mean |error| {units.mean:.3g} -> "
            f"{kept.mean:.3g}."
        )
        trial = Trial.checked(
            f"{layer} kept in fp32, returning fp32, the rest in {fmt}",
            metric="mean |error| of the output, in its units",
            before=f"{units.mean:.3g}",
            after=f"{kept.mean:.3g}",
            on=on,
        )
    elif own is not None and own.mean <= units.mean / 4:
        # the output is the model's own ops' (a de-normalisation around its submodules): they are the fix
        subs = ", ".join(f"`{c}`" for c in (children or [])[:4]) or "its submodules"
        fix = (
            f"Keep the model's own ops in fp32 (what its forward computes around {subs}: statistics, a normalisation "
            f"and what undoes it, with its own buffers and parameters), on its inputs as they come (fp32), returning "
            f"fp32; put only {subs} in {fmt}, "
            f"their inputs cast to {fmt} and their outputs .float(). Checked: mean |error| {units.mean:.3g} -> "
            f"{own.mean:.3g}; then `fpdoctor compare --inputs-as-given` checks the changed model."
        )
        trial = Trial.checked(
            f"the model's own ops in fp32 on its inputs as given, {subs} in {fmt}",
            metric="mean |error| of the output, in its units",
            before=f"{units.mean:.3g}",
            after=f"{own.mean:.3g}",
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


def lost_finding(units: InUnits, fmt: str, *, worst: str) -> Finding:
    """`precision-divergence` judged by the output's use: its error in its own units is a large share of
    what it varies by, and no module's own error explains it (`worst`: the largest isolated error, in
    words). Where the error is made is not located: the fix says what to look for."""
    share = units.mean / units.varies
    wider = "fp64" if fmt in ("fp32", "tf32") else "fp32"
    return catalog.make(
        "precision-divergence",
        title=f"The output's error in {fmt} is {share:.0%} of what it varies by, and no module's own error explains it",
        message=(
            f"In {fmt}, the output's error in its own units is {units.mean:.3g} on average (largest "
            f"{units.largest:.3g}): {share:.0%} of what the output varies by ({units.varies:.3g}), while rounding the "
            f"exact output to {fmt} costs {units.floor_mean:.3g}. No module or op diverges by itself ({worst}): each "
            "is close to exact on what it reads, and the error builds up across them, where an op amplifies the "
            "rounding of a large value it reads (sin or cos of a large argument, exp, a difference of two close "
            "large values)."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={"kind": "use", "units": units.to_dict(), "share_of_spread": share},
        fix=(
            f"Find the large value such an op reads and compute it and that op in {wider} (their operands "
            f"{'.double()' if wider == 'fp64' else '.float()'}, the result cast back), or make the value small first "
            "(a timestamp as an offset from a recent epoch, an angle reduced modulo 2*pi in a wider format); "
            "`fpdoctor compare --module NAME` on the part that computes it measures each of its ops"
        ),
        trial=Trial.untried(
            "compare measured the error but located no module or op whose change it could try: the fix is where the "
            "large value is made"
        ),
        severity=Severity.ERROR,
    )


def given_finding(
    fmt: str, *, before: float, after: float, input_floor: float, on: str,
    units: InUnits | None = None, fed: InUnits | None = None, buffers: list[str] | None = None,
) -> Finding:  # fmt: skip
    """`precision-divergence` whose cause is the cast of the inputs before the call: rounding them to
    `fmt` alone explains the end-to-end error (`before`; `input_floor`: the exact model fed them
    rounded), and the candidate fed them as given (its forward casts them where it computes) has
    `after`. `units`, `fed`: the same in the output's units, where it is not logits; `buffers`: the
    model's buffers the format rounds, kept in fp32 in that run too (a reference value it centres on)."""
    kept = ", ".join(f"`{b}`" for b in buffers or [])
    plural = len(buffers or []) > 1
    with_buffers = f", with its buffer{'s' if plural else ''} {kept} kept in fp32," if kept else ""
    said = (
        f" In the output's units: {units.mean:.3g} on average ({units.mean / units.varies:.0%} of what it varies by), "
        f"{fed.mean:.3g} fed as given."
        if units is not None and fed is not None and units.varies > 0
        else ""
    )
    evidence: dict[str, Any] = {"kind": "input-rounding", "propagated_rel": before, "fed_as_given_rel": after,
                                "input_floor_rel": input_floor}  # fmt: skip
    if units is not None and fed is not None:
        evidence |= {"units": units.to_dict(), "fed_as_given": fed.to_dict()}
    return catalog.make(
        "precision-divergence",
        title=f"The inputs rounded to {fmt} before the call make the error; the model fed them as given does not",
        message=(
            f"In {fmt}, the end-to-end error is {before:.3g}, and rounding the inputs to {fmt} alone explains it: the "
            f"exact model fed them rounded is already off by {input_floor:.3g}. The {fmt} model{with_buffers} fed "
            f"the inputs unrounded, as given (its forward reads them in the format it computes them in), is off by "
            f"{after:.3g}." + said
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence=evidence,
        fix=(
            f"Pass the inputs to the {fmt} model unrounded (as they come, in fp32): do not cast them to {fmt} before "
            "the call"
            + (
                f"; and keep {kept} out of the cast: {plain_fp32(buffers or [])}; or, where only your code casts the "
                f"model, set {'them' if plural else 'it'} back after the cast from {'their' if plural else 'its'} "
                f"fp32 values saved before it ({_set_back(buffers or [], fmt)})"
                if kept
                else ""
            )
            + "; `fpdoctor compare --inputs-as-given` judges the model fed them so"
        ),
        trial=Trial.checked(
            f"the {fmt} model{with_buffers.rstrip(',')} fed the inputs as given",
            on=on,
            metric="end-to-end error",
            before=before,
            after=after,
        ),
        severity=Severity.ERROR,
    )


def _set_back(buffers: list[str], fmt: str) -> str:
    """The lines that keep `buffers` (the model's names) in fp32 across the model's cast to `fmt`."""
    dtype = {"bf16": "torch.bfloat16", "fp16": "torch.float16"}.get(fmt, "DTYPE")

    def attribute(name: str) -> str:
        path, _, leaf = name.rpartition(".")
        if all(part.isidentifier() for part in name.split(".")):
            return f"model.{name}"
        return f"model.get_submodule({path!r}).{leaf}"

    saved = "; ".join(f"{attribute(n)} = saved[{n!r}]" for n in buffers)
    return f"`saved = {{n: model.get_buffer(n).clone() for n in {buffers!r}}}`; `model.to({dtype})`; `{saved}`"


def plain_fp32(names: list[str], parameters: list[str] | tuple[str, ...] = ()) -> str:
    """How to keep the model's tensors `names` in fp32 across its cast, in words. A buffer: as a plain
    tensor attribute, which Module.to(dtype) leaves as it is (compare's candidate is such a cast:
    set back after the user's own cast, a buffer is rounded again by compare's, and its re-check sees
    only this form). A parameter (`parameters`): an fp32 nn.Parameter assigned again after the cast,
    as it trains; the plain attribute, which a re-check sees, is for inference only."""
    many = len(names) > 1
    leaf = names[0].rpartition(".")[2] if names else "name"
    it = "them" if many else "it"
    if any(n in parameters for n in names):
        return (
            f"keep {it} {'fp32 parameters' if many else 'an fp32 parameter'}: assign {it} again after the model's "
            "cast, as nn.Parameter(value.float()) "
            f"from {'their values' if many else 'its value'} saved before it (a clone taken before the cast: "
            f".float() after it gives the rounded value back); for inference only, a plain fp32 tensor attribute "
            f"(`self.{leaf} = value.float()`), which the cast leaves as it is wherever it is cast, fpdoctor "
            "compare's re-check included, and which is neither trained nor saved"
        )
    what, where = (
        ("plain fp32 tensor attributes", "their modules'")
        if many
        else ("a plain fp32 tensor attribute", "its module's")
    )
    return (
        f"hold {it} as {what} (`self.{leaf} = value.float()` in {where} __init__, in place of register_buffer), "
        f"which the model's cast leaves as {'they are' if many else 'it is'} wherever it is cast, by your code or by "
        "fpdoctor compare, whose re-check sees only this form (a plain attribute is not in state_dict, so "
        f"load_state_dict(..., strict=False) reads a checkpoint that has {it}, and it stays on its device: move "
        f"{it} in forward with .to(x.device))"
    )
