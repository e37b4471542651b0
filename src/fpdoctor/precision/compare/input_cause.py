"""What in the inputs makes rounding them to the candidate's format costly, with its fix checked.

The input floor (the reference fed candidate-rounded inputs) can be most of a candidate's error:
then no module diverges, and keeping parts of the model in fp32 undoes nothing. One cause is common
and silent: whole numbers kept in a floating tensor (item ids, indices, positions or counts beside
the features of a tabular batch, as `torch.tensor(df.values)` makes) past the largest whole number
the format holds exactly (2 / eps: 256 in bf16, 2048 in fp16, 16 in fp8-e4m3). A model that reads
them back as integers (`.long()`, an embedding's index) reads another row for each one rounding
moved. Such columns (the last dimension's) are found from the values alone; the fix is checked by
the reference fed the inputs rounded everywhere but there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.precision.candidates import map_tensors
from fpdoctor.precision.inputs import named_tensors


def exact_whole(dtype: torch.dtype) -> float:
    """The largest whole number below which `dtype` holds every whole number exactly."""
    return 2.0 / torch.finfo(dtype).eps


@dataclass
class Whole:
    """Whole numbers in an input tensor past the format's exact range: `columns` of its last
    dimension (None: the whole tensor), their largest magnitude, the share rounding changes."""

    name: str
    tensor: torch.Tensor
    columns: list[int] | None
    largest: float
    changed: float

    def where(self) -> str:
        if self.columns is None:
            return f"`{self.name}`"
        cols = ", ".join(str(c) for c in self.columns[:4]) + (" ..." if len(self.columns) > 4 else "")
        return f"column{'s' if len(self.columns) > 1 else ''} {cols} of `{self.name}` (last dimension)"

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


def rounded_but(inputs: Any, dtype: torch.dtype, found: list[Whole]) -> Any:
    """`inputs` rounded to `dtype` and back, except the values in `found`, which keep their own."""
    keep = {id(w.tensor): w for w in found}

    def cast(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        out = t.detach().to(dtype).to(t.dtype)
        w = keep.get(id(t))
        if w is not None:
            if w.columns is None:
                return t.detach().clone()
            out[..., w.columns] = t.detach()[..., w.columns]
        return out

    return map_tensors(inputs, cast)


def cause(
    inputs: Any, dtype: torch.dtype, label: str, floor_with: Callable[[Any], float | None]
) -> dict[str, Any] | None:
    """The whole numbers the candidate's format rounds, and the input floor without rounding them
    (`floor_with(inputs rounded but there)`, the reference's end-to-end error), or None."""
    found = whole_numbers(inputs, dtype)
    if not found:
        return None
    where = "; ".join(
        f"{w.where()} holds whole numbers up to {w.largest:g}, {w.changed:.0%} of which rounding to {label} moves"
        for w in found
    )
    return {
        "message": (
            f" {where[0].upper()}{where[1:]}: {label} holds whole numbers exactly only up to "
            f"{exact_whole(dtype):g}, so ids, indices or counts read back from them (`.long()`, an index) "
            "are other ones."
        ),
        "fix": (
            f"keep those values out of the {label} tensor: pass them as an integer tensor (torch.long) beside "
            f"the features, or keep the input in fp32 and cast only the features to {label} after the ids are "
            "read"
        ),
        "columns": [{"input": w.name, "columns": w.columns, "largest": w.largest, "changed": w.changed} for w in found],
        "floor_without": floor_with(rounded_but(inputs, dtype, found)),
        "changed": f"every input value rounded to {label} except {', '.join(w.where() for w in found)}",
    }
