"""How the trace checks a tensor's values: which tensors, with which reduction, read how.

Immediate mode (CPU) reduces with a sum, non-finite whenever the tensor is, and re-checks a
non-finite sum exactly with aminmax while the tensor is alive (a finite fp32 tensor's sum can
overflow); low-precision dtypes always get aminmax, whose exact range overflow headroom needs.
Deferred mode (accelerators) reads results later, when the tensor may be gone, so it takes
aminmax for every dtype: exact on any finite data, one kernel like the sum.
"""

from __future__ import annotations

from typing import Any

import torch

from fpdoctor.numerics.observe.records import Leaf, Output, kind_of

LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)

CHECKABLE = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.complex64, torch.complex128,
})  # fmt: skip
REAL = CHECKABLE - {torch.complex64, torch.complex128}
AMINMAX = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})  # taken as they are
STRIDED = torch.strided


def checkable(t: torch.Tensor) -> bool:
    # a meta tensor (shapes only, as transformers makes some while building masks) holds no values to check
    return t.dtype in CHECKABLE and t.layout is STRIDED and t.numel() > 0 and not t.is_meta


def plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.float()
    return t


def minmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.aminmax(plain(t))


def deferred_range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Deferred mode's check of one op output, on the per-op path: `minmax` without its detach
    where aminmax takes the dtype as it is. Inside __torch_dispatch__ we run below autograd, so
    no graph is recorded; on an accelerator each dispatch is host time spent per op."""
    if t.dtype in AMINMAX:
        return torch.aminmax(t)
    return minmax(t)


def reduce(t: torch.Tensor) -> tuple[Any, ...]:
    """Immediate mode: low-precision dtypes get aminmax, whose exact range overflow headroom
    needs; others a sum (about 1.7x cheaper on a CPU for 1M fp32 values), non-finite whenever
    the tensor is; a finite tensor whose sum overflows is re-checked exactly while alive."""
    if t.dtype in LOW_PRECISION:
        return minmax(t)
    if t.is_complex():
        return (torch.view_as_real(t).sum(),)
    # Inside __torch_dispatch__ we run below autograd: no graph is recorded, no detach needed.
    return (t.sum(),)


def counts(t: torch.Tensor) -> dict[str, int]:
    t = plain(t)
    return {
        "nan": int(torch.isnan(t).sum()),
        "+inf": int(torch.isposinf(t).sum()),
        "-inf": int(torch.isneginf(t).sum()),
    }


def resolve(output: Output | Leaf, values: list[float], alive: torch.Tensor | None) -> None:
    """Set kind (and the exact range when known) from the reduction's values."""
    if len(values) == 2:
        output.lo, output.hi = values
        output.kind = kind_of(values[0], values[1])
    elif values[0] != values[0] or values[0] in (float("inf"), float("-inf")):
        if alive is None:  # a sum is only taken where the tensor is alive (immediate mode)
            output.kind = "nan"
            return
        lo, hi = minmax(alive)
        output.lo, output.hi = float(lo), float(hi)
        output.kind = kind_of(output.lo, output.hi)
    if output.kind and alive is not None:
        output.counts = counts(alive)


def stats(t: torch.Tensor) -> dict[str, Any]:
    lo, hi = minmax(t)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "min": float(lo), "max": float(hi)}


def version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return -1


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_NARROWS: dict[tuple[torch.dtype, torch.dtype], bool] = {}


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a finite `source` value can overflow when converted to `target` (fp32 -> fp16)."""
    key = (source, target)
    narrows = _NARROWS.get(key)
    if narrows is None:
        if source == target:
            narrows = False
        else:
            try:
                narrows = torch.finfo(target).max < torch.finfo(source).max
            except TypeError:  # complex or integer: judge by size
                narrows = target.itemsize < source.itemsize
        _NARROWS[key] = narrows
    return narrows


def read_scalars(values: list[torch.Tensor]) -> list[float]:
    """0-dim results as floats, in one host transfer per device and dtype group. Grouped by
    dtype first (a tensor's `.device` builds an object per call: the trace reads hundreds at
    each flush), by device too only where a group spans several."""
    if not values:
        return []
    by_dtype: dict[torch.dtype, list[int]] = {}
    for n, v in enumerate(values):
        by_dtype.setdefault(v.dtype, []).append(n)
    out = [0.0] * len(values)
    for positions in by_dtype.values():
        try:
            groups = [(positions, torch.stack([values[n] for n in positions]))]
        except RuntimeError:  # on several devices
            by_device: dict[Any, list[int]] = {}
            for n in positions:
                by_device.setdefault(values[n].device, []).append(n)
            groups = [(ns, torch.stack([values[n] for n in ns])) for ns in by_device.values()]
        for ns, stacked in groups:
            for n, value in zip(ns, stacked.double().tolist(), strict=True):
                out[n] = value
    return out
