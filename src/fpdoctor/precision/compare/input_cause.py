"""What in the inputs makes rounding them to the candidate's format costly, with its fix checked.

The input floor (the reference fed candidate-rounded inputs) can be most of a candidate's error:
then no module diverges, and keeping parts of the model in fp32 undoes nothing. One cause is common
and silent: whole numbers kept in a floating tensor (item ids, indices, positions or counts beside
the features of a tabular batch, as `torch.tensor(df.values)` makes) past the largest whole number
the format holds exactly (2 / eps: 256 in bf16, 2048 in fp16, 16 in fp8-e4m3). A model that reads
them back as integers (`.long()`, an embedding's index) reads another row for each one rounding
moved. The other is values far from zero that vary little (unix timestamps, coordinates, prices
around a baseline): the format's spacing at their magnitude is a large share of their spread, and
what reads their differences (a time since, a gap) reads the rounding. Both are found per column
(the last dimension's) from the values alone. The first's fix, kept out of the format, is checked
by the reference fed the inputs rounded everywhere but there; the second's, an offset subtracted in
the inputs' own precision before the cast, by the reference fed exactly what the fix feeds the
candidate: those columns less the offset, rounded to the format. A model that reads only their
differences gives the same output; one that reads their values (an hour of the day, a cosine of a
latitude, a constant subtracted inside) does not, and the fix is not printed. Columns whose ranges
overlap share an offset; where differences between groups matter too (a pickup and a drop-off half
an hour apart), one offset for every such column is tried as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.precision.candidates import map_tensors
from fpdoctor.precision.inputs import named_tensors


def exact_whole(dtype: torch.dtype) -> float:
    """The largest whole number below which `dtype` holds every whole number exactly."""
    return 2.0 / torch.finfo(dtype).eps


# A column whose rounding moves it by this many times what rounding a column of the same spread
# centred on zero would (about eps x spread) is offset-dominated: its offset is >= this many spreads.
OFFSET_RATIO = 64


@dataclass
class Whole:
    """Values in an input tensor the format rounds away: `columns` of its last dimension (None: the
    whole tensor), their largest magnitude, the share rounding changes; `offset`, where they are not
    whole numbers but far from zero for their spread, the value subtracted before the cast."""

    name: str
    tensor: torch.Tensor
    columns: list[int] | None
    largest: float
    changed: float
    offset: float | None = None
    spread: float = 0.0

    def where(self) -> str:
        if self.columns is None:
            return f"`{self.name}`"
        cols = ", ".join(str(c) for c in self.columns[:4]) + (" ..." if len(self.columns) > 4 else "")
        return f"column{'s' if len(self.columns) > 1 else ''} {cols} of `{self.name}` (last dimension)"

    def holds(self) -> str:
        return "hold" if self.columns is not None and len(self.columns) > 1 else "holds"

    def values(self) -> torch.Tensor:
        t = self.tensor.detach()
        return t.reshape(-1) if self.columns is None else t.reshape(-1, t.shape[-1])[:, self.columns]


def whole_numbers(inputs: Any, dtype: torch.dtype) -> list[Whole]:
    """The floating input tensors' whole-number columns (or whole tensors) that `dtype` cannot hold:
    every value finite and whole, the largest past exact_whole(dtype), some changed by rounding."""
    limit, found = exact_whole(dtype), []
    for name, t in named_tensors(inputs):
        if not t.is_floating_point() or t.numel() == 0 or torch.finfo(t.dtype).eps >= torch.finfo(dtype).eps:
            continue
        flat = t.detach().reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.detach().reshape(-1, 1)
        whole = (torch.isfinite(flat) & (flat == flat.round())).all(0) & (flat.abs().amax(0) > limit)
        columns = whole.nonzero().flatten().tolist()
        if not columns:
            continue
        per_column = t.dim() >= 2 and len(columns) < flat.shape[1]
        entry = Whole(name, t, columns if per_column else None, 0.0, 0.0)
        values = entry.values().double()
        entry.largest = float(values.abs().max())
        entry.changed = float((values.to(dtype).double() != values).double().mean())
        if entry.changed > 0:
            found.append(entry)
    return found


def offset_columns(inputs: Any, dtype: torch.dtype, skip: list[Whole]) -> list[Whole]:
    """The floating input tensors' columns (of at least two rows) that are far from zero for their
    spread: rounding to `dtype` moves them by OFFSET_RATIO times or more what it would move a column
    of the same spread centred on zero. Columns whose ranges overlap (a pickup's and a drop-off's
    latitude, two timestamps) share one offset, which keeps their differences exact."""
    eps, found = torch.finfo(dtype).eps, []
    taken = {(id(w.tensor), c) for w in skip for c in (w.columns or [])} | {id(w.tensor) for w in skip if not w.columns}
    for name, t in named_tensors(inputs):
        if not t.is_floating_point() or t.dim() < 2 or id(t) in taken or torch.finfo(t.dtype).eps >= eps:
            continue
        flat = t.detach().reshape(-1, t.shape[-1]).double()
        if flat.shape[0] < 2:
            continue
        moved = (flat.to(dtype).double() - flat).abs().amax(0)
        spread = flat.std(0)
        # a column that holds a NaN or an Inf has a NaN spread or move: never far (the others are judged)
        far = torch.isfinite(flat).all(0) & (spread > 0) & (moved > OFFSET_RATIO * eps * spread)
        columns = [c for c in far.nonzero().flatten().tolist() if (id(t), c) not in taken]
        low, high = flat.amin(0), flat.amax(0)
        groups: list[list[int]] = []
        for c in sorted(columns, key=lambda c: float(low[c])):  # overlapping ranges: one group
            if groups and float(low[c]) <= max(float(high[g]) for g in groups[-1]):
                groups[-1].append(c)
            else:
                groups.append([c])
        for group in groups:
            group.sort()
            values = flat[:, group]
            narrowest = float(spread[group].min())
            changed = float((values.to(dtype).double() != values).double().mean())
            found.append(
                Whole(name, t, group, float(values.abs().max()), changed, _offset(values, narrowest), narrowest)
            )
    return found


def rounded_but(inputs: Any, dtype: torch.dtype, found: list[Whole]) -> Any:
    """`inputs` rounded to `dtype` and back, except the values in `found`: whole numbers keep their
    own, offset columns become their difference from the offset rounded to `dtype` (what the fix
    feeds the model: x - offset, then the cast)."""
    keep: dict[int, list[Whole]] = {}
    for w in found:
        keep.setdefault(id(w.tensor), []).append(w)

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        out = t.detach().to(dtype).to(t.dtype)
        for w in keep.get(id(t), []):
            if w.columns is None:
                return t.detach().clone()
            own = t.detach()[..., w.columns]
            if w.offset is not None:
                own = (own - w.offset).to(dtype).to(t.dtype)
            out[..., w.columns] = own
        return out

    return map_tensors(inputs, cast)


def _offset(values: torch.Tensor, narrowest: float) -> float:
    """The offset subtracted from `values`: their median, to the first digit of the narrowest spread."""
    step = 10.0 ** math.floor(math.log10(narrowest))
    return float(f"{round(float(values.median()) / step) * step:.12g}")


def one_offset(groups: list[Whole]) -> list[Whole]:
    """The groups of each tensor merged under one offset (their values' median, to the narrowest
    spread's first digit), which keeps differences between the groups exact too."""
    merged: dict[int, list[Whole]] = {}
    for w in groups:
        merged.setdefault(id(w.tensor), []).append(w)
    out = []
    for ws in merged.values():
        if len(ws) == 1:
            out.append(ws[0])
            continue
        first = ws[0]
        columns = sorted(c for w in ws for c in (w.columns or []))
        values = first.tensor.detach().reshape(-1, first.tensor.shape[-1]).double()[:, columns]
        narrowest = min(w.spread for w in ws)
        offset = _offset(values, narrowest)
        changed = sum(w.changed * len(w.columns or []) for w in ws) / len(columns)
        out.append(Whole(first.name, first.tensor, columns, max(w.largest for w in ws), changed, offset, narrowest))
    return out


Floor = Callable[[Any], tuple[float | None, Any]]  # inputs -> the reference's end-to-end error fed them, its output


def cause(inputs: Any, dtype: torch.dtype, label: str, floor_with: Floor, own: str = "fp32") -> dict[str, Any] | None:
    """The whole numbers and the offset-dominated columns the candidate's format rounds, and the input
    floor with the fix in place (`floor_with(inputs as the fix feeds them)`: the reference's end-to-end
    error and its output), or None. The offsets are tried per group of overlapping columns and as one
    offset per tensor; the layout with the lower floor is the fix, and offsets that lower nothing
    are dropped (the model reads their values, not their differences). `own`: the inputs' own
    precision (fp32, or fp64 against an fp32 candidate)."""
    whole = whole_numbers(inputs, dtype)
    groups = offset_columns(inputs, dtype, whole)
    if not whole and not groups:
        return None
    layouts = [whole + groups] if groups else []
    if groups and len(one_offset(groups)) < len(groups):
        layouts.append(whole + one_offset(groups))
    if whole:
        layouts.append(list(whole))
    floor, output, found = math.inf, None, layouts[0]
    for layout in layouts:
        error, out = floor_with(rounded_but(inputs, dtype, layout))
        if error is not None and error < floor:
            floor, output, found = error, out, layout
    whole = [w for w in found if w.offset is None]
    offsets = [w for w in found if w.offset is not None]
    said, fixes = [], []
    if whole:
        where = "; ".join(
            f"{w.where()} {w.holds()} whole numbers up to {w.largest:g}, {w.changed:.0%} of which rounding to {label} "
            "moves"
            for w in whole
        )
        said.append(
            f"{where[0].upper()}{where[1:]}: {label} holds whole numbers exactly only up to {exact_whole(dtype):g}, "
            "so ids, indices or counts read back from them (`.long()`, an index) are other ones, and differences "
            "of them (a time since) are multiples of its spacing."
        )
        fixes.append(
            f"keep those values out of the {label} tensor: pass them as an integer tensor (torch.long) beside the "
            f"features (differences of them taken in integers, then cast), or keep the input in {own} and cast only "
            f"the features to {label} after the integers are read"
        )
    for w in offsets:
        spacing = float(torch.finfo(dtype).eps) * 2.0 ** math.floor(math.log2(max(abs(w.offset or 0.0), 1e-300)))
        said.append(
            f"{w.where()[0].upper()}{w.where()[1:]} {w.holds()} values near {w.offset:.6g} that vary by as little as "
            f"{w.spread:.3g} (their spread), where {label}'s spacing is {spacing:.3g}: rounding moves {w.changed:.0%} "
            "of them."
        )
        fixes.append(
            f"subtract one offset from {w.where()} before the cast to {label}, in {own}: pass "
            f"`x[..., {w.columns if w.columns is None or len(w.columns) > 1 else w.columns[0]}] - {w.offset:.10g}` "
            "(the model then reads the same differences; checked on the reference fed exactly that)"
        )
    if offsets:
        said.append("What reads their differences (a time since, a gap, a distance) reads the rounding.")
    kinds = (
        ("whole numbers " if whole else "")
        + ("and " if whole and offsets else "")
        + ("values far from zero for their spread " if offsets else "")
    )
    return {
        "message": " " + " ".join(said),
        "fix": "; and ".join(fixes),
        "title": f"The inputs hold {kinds}that {label} cannot",
        "columns": [
            {
                "input": w.name,
                "columns": w.columns,
                "largest": w.largest,
                "changed": w.changed,
                **({"offset": w.offset, "spread": w.spread} if w.offset is not None else {}),
            }
            for w in found
        ],
        "floor_without": floor if math.isfinite(floor) else None,
        "output": output,
        "changed": f"every input value rounded to {label} except "
        + ", ".join(
            w.where() + (f" (fed less {w.offset:.10g}, then rounded)" if w.offset is not None else "") for w in found
        ),
    }
