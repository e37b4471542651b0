"""Which op inside a module overflows: a module's output can fit the candidate's format while an
op inside it does not (attention's q·kᵀ scores in fp16, the softmax then turning Inf into NaN).

The candidate's copy of the module is re-run on the fp64 run's inputs under a dispatch mode that
stops looking at the first op whose output is non-finite although its inputs are finite; the
reference's copy (fp32) is re-run the same way to read how large that op's output really is (the
k-th op of both runs is the same op: one module, the same inputs). Only modules whose isolated
re-run was already non-finite pay for it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.engine.raising import below_range, past_range
from fpdoctor.precision.candidates import cast_inputs
from fpdoctor.precision.metrics import all_finite, floating
from fpdoctor.torchprivate import TorchDispatchMode
from fpdoctor.userframes import user_location


class _FirstOverflow(TorchDispatchMode):
    """Records the first op that makes a non-finite value from finite inputs, and its position."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.found: dict[str, Any] | None = None
        self.tiny: dict[tuple[str, int], list[float]] = {}  # per line: constants its ops' format holds as 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # an op that writes into its input (index_add_ into zeros): whether its inputs were finite is read
        # before it writes
        writes = self.found is None and func._schema.is_mutable
        finite_before = all_finite((args, kwargs)) if writes else True
        out = func(*args, **(kwargs or {}))
        index, self.count = self.count, self.count + 1
        if self.found is None and not func.is_view:
            narrow = next((a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)
            below = below_range(args, narrow) if narrow is not None else []
            if below and (user := user_location(sys._getframe(1))) is not None:  # eps + 1e-10 in fp16: 0
                self.tiny.setdefault((user[0], user[1]), []).extend(below)
            outputs = list(floating(out))
            if outputs and not all_finite(outputs) and finite_before and (writes or all_finite((args, kwargs))):
                inputs = list(floating((args, kwargs)))
                self.found = {
                    "op": str(func),
                    "index": index,
                    "dtype": str(outputs[0].dtype),
                    "input_absmax": max((float(t.abs().max()) for t in inputs if t.numel()), default=0.0),
                    "location": user_location(sys._getframe(1)),
                }
                # a Python constant the op applies that the output's format cannot hold (float32's
                # lowest as a mask value on an fp16 tensor): the Inf is the constant's, not the math's
                past = past_range(args, torch.finfo(outputs[0].dtype).max)
                if past:
                    self.found["constant"] = past[0]
                at = self.found["location"]
                if at is not None and self.tiny.get((at[0], at[1])):  # a constant on its line that rounded to 0
                    self.found["tiny"] = self.tiny[(at[0], at[1])]
        return out


class _Magnitude(TorchDispatchMode):
    """The largest magnitude of the `index`-th op's output, if that op is `op` (the same op)."""

    def __init__(self, index: int, op: str) -> None:
        super().__init__()
        self.index, self.op, self.count = index, op, 0
        self.absmax: float | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.count == self.index and str(func) == self.op:
            values = [float(t.abs().max()) for t in floating(out) if t.numel()]
            self.absmax = max(values) if values else None
        self.count += 1
        return out


def first_overflow(
    candidate: nn.Module,
    reference: nn.Module | None,
    args: Any,
    kwargs: Any,
    *,
    dtype: torch.dtype,
    reference_dtype: torch.dtype,
    device: torch.device | None,
    given: dict[int, torch.dtype] | None = None,
) -> dict[str, Any] | None:
    """The op inside `candidate` (a module's copy in `dtype`) that overflows on the fp64 inputs
    (`args`, `kwargs`), with how large its output is in the `reference` copy of the module (in
    `reference_dtype`, whose range holds it); None when no op turns finite inputs non-finite
    (the inputs already were, or a NaN came from elsewhere). `given`: the model's inputs fed as given
    (cast_inputs)."""
    finder = _FirstOverflow()
    # cast before the mode starts: op positions count from the module's first op, as in a forward
    cand_args = cast_inputs(args, dtype, device, given=given)
    cand_kwargs = cast_inputs(kwargs, dtype, device, given=given)
    try:
        with torch.no_grad(), finder:
            candidate(*cand_args, **cand_kwargs)
    except Exception:  # the module fails on these inputs in this dtype: nothing to localise
        return None
    found = finder.found
    if found is None:
        return None
    found["reference_absmax"] = None
    if reference is not None:
        magnitude = _Magnitude(found["index"], found["op"])
        ref_args, ref_kwargs = cast_inputs(args, reference_dtype), cast_inputs(kwargs, reference_dtype)
        try:
            with torch.no_grad(), magnitude:
                reference(*ref_args, **ref_kwargs)
            found["reference_absmax"] = magnitude.absmax
        except Exception:  # the reference copy fails here: the op is still named, its size is not
            pass
    location = found.pop("location")
    if location is not None:
        found["location"] = f"{location[0]}:{location[1]}"
    return found
