"""What arithmetic can produce: an upper bound on an op's output, from its finite inputs.

For a matrix product every |y_ij| <= (|A| @ |B|)_ij (+ |bias|), and every partial sum of any
summation order obeys the same bound, so no accumulation order, split-K or rounding of a correct
computation can exceed it by more than a rounding step. Computed once, in float64, for an op whose
non-finite output came from finite inputs (the trace's producer; never on the hot path). A bound
finite and below the output dtype's largest value means arithmetic cannot explain the Inf/NaN:
the device or the library computed something other than the product (silent data corruption).
Saturating elementwise ops are bounded by their range alone (tanh, sigmoid, softmax: |y| <= 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

_RANGE_ONE = frozenset({
    "aten.sigmoid.default", "aten.tanh.default", "aten.sin.default", "aten.cos.default", "aten.erf.default",
    "aten._softmax.default", "aten.softmax.int",
})  # fmt: skip


def _abs64(t: Any) -> torch.Tensor:
    return t.detach().to(torch.float64).abs()


def _scalar(value: Any) -> float:
    return abs(float(value)) if value is not None else 1.0


def _mm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return _abs64(args[0]) @ _abs64(args[1])


def _addmm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    beta, alpha = _scalar(kwargs.get("beta", 1)), _scalar(kwargs.get("alpha", 1))
    return beta * _abs64(args[0]) + alpha * (_abs64(args[1]) @ _abs64(args[2]))


def _convolution(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    x, w, bias, *rest = args
    out = torch.ops.aten.convolution.default(_abs64(x), _abs64(w), None, *rest)
    if bias is not None:
        out = out + _abs64(bias).reshape(1, -1, *([1] * (out.dim() - 2)))
    return out


_BOUNDS: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], torch.Tensor]] = {
    "aten.mm.default": _mm,
    "aten.bmm.default": _mm,
    "aten.addmm.default": _addmm,
    "aten.baddbmm.default": _addmm,
    "aten.convolution.default": _convolution,
}


def output_bound(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """The largest |y| a correct computation of `op` on these inputs can give (float64), or None
    for an op without a known bound. Called with the op's live, finite inputs; never raises."""
    if op in _RANGE_ONE:
        # bounded by the function's range only if the input is really finite: a NaN written by
        # a kernel the trace cannot see (an extension, .numpy(), DLPack) must not read as corruption
        x = args[0] if args else None
        return 1.0 if isinstance(x, torch.Tensor) and bool(torch.isfinite(x).all()) else None
    bound = _BOUNDS.get(op)
    if bound is None:
        return None
    try:
        with torch.no_grad():
            value = float(bound(args, kwargs).max())
            return value if math.isfinite(value) else None  # an input the trace took as finite was not
    except Exception:  # an unusual overload or layout: no bound, never a failure
        return None


def impossible(bound: float | None, dtype: str) -> bool:
    """A non-finite output whose bound is finite and below the output dtype's max (with room for
    one rounding step) is beyond what arithmetic can produce."""
    if bound is None or not math.isfinite(bound):
        return False
    try:
        largest = torch.finfo(getattr(torch, dtype.removeprefix("torch."))).max
    except (AttributeError, TypeError):
        return False
    return bound * (1 + 2**-7) < largest
