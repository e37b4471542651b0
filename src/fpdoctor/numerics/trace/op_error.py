"""An op that raised inside a trace, explained: dtype and device mismatches, with operand origins.

`fpdoctor trace -- script.py` runs code nobody will edit for us; when it dies with "mat1 and mat2
must have the same dtype" the trace already knows where each operand came from - a parameter
(by name), a value an op made (which op, in which module, from what), or a tensor from outside
the traced ops. This module gathers the failing op's operands and hands them to the explanation
`audit` gives too (`numerics.mismatch`), so both commands say the same thing and give the same
smallest fix.

The operands are read from the failing dispatch frame in the exception's traceback: the mode's
`__torch_dispatch__` is on the stack when the op raises, so the hot path records nothing for it.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections import Counter
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.trace.mismatch import explain_mismatch, mismatch_error
from fpdoctor.numerics.trace.tracer import Tracer
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding
from fpdoctor.userframes import user_location

_OUTSIDE = "a tensor from outside the traced ops"
_MAX_DEPTH = 64  # how far back an operand's dtype is followed through the ops that made it


def _frames(tb: types.TracebackType | None) -> list[types.FrameType]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _dispatch_call(tracer: Tracer, frames: list[types.FrameType]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(func, args, kwargs) of the op that raised, from the tracer's own dispatch frame."""
    frame = _dispatch_frame(tracer, frames)
    if frame is None:
        return None, (), {}
    local = frame.f_locals
    return local.get("func"), tuple(local.get("args") or ()), dict(local.get("kwargs") or {})


def _dispatch_frame(tracer: Tracer, frames: list[types.FrameType]) -> types.FrameType | None:
    # by name and owner: the frame of this tracer's own __torch_dispatch__, not a nested trace's
    for frame in reversed(frames):
        if frame.f_code.co_name == "__torch_dispatch__" and frame.f_locals.get("self") is tracer:
            return frame
    return None


class _Origins:
    """Origins in `audit`'s vocabulary, from the trace's records and the tracker's names."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.names = tracer.tracker.param_names

    def of_tensor(self, t: torch.Tensor) -> dict[str, Any]:
        base = t if t._base is None else t._base
        name = self.names.get(t) or self.names.get(base)
        if name is not None:
            kind = "parameter" if isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter) else "buffer"
            return {"kind": kind, "name": name, "dtype": str(t.dtype)}
        index = self.tracer.producer_of(t)
        if index is not None:
            return self.of_record(index, 0)
        return {"kind": "tensor", "name": _OUTSIDE, "dtype": str(t.dtype)}

    def of_record(self, index: int, depth: int) -> dict[str, Any]:
        r = self.tracer.records[index]
        dtype = r.outputs[0].dtype if r.outputs else None
        sources: list[dict[str, Any]] = []
        for kind, i in r.inputs[:3] if depth < _MAX_DEPTH else ():
            if kind == "op":
                sources.append(self.of_record(i, depth + 1))
            else:
                leaf = self.tracer.leaves[i]
                if leaf.name != "input":
                    sources.append({"kind": "parameter", "name": leaf.name, "dtype": leaf.dtype})
                else:
                    sources.append({"kind": "tensor", "name": _OUTSIDE, "dtype": leaf.dtype})
        origin: dict[str, Any] = {"kind": "state", "op": r.op, "module": r.module, "dtype": dtype, "from": sources}
        if r.location is not None:
            origin["location"] = r.location
        return origin


def _module_of(tracer: Tracer, frames: list[types.FrameType]) -> tuple[str | None, nn.Module | None]:
    """The innermost module whose forward was running, and the root module, from the stack."""
    innermost: str | None = None
    root: nn.Module | None = None
    for frame in reversed(frames):
        owner = frame.f_locals.get("self") if frame.f_code.co_name in ("forward", "_call_impl") else None
        if isinstance(owner, nn.Module):
            name = tracer.tracker.name_of(owner)
            innermost = name if innermost is None else innermost
            if name == "":
                root = owner
    return innermost, root


def _main_dtype(tracer: Tracer, root: nn.Module | None) -> str | None:
    """The dtype most parameter and buffer elements have: the one the odd operand should match."""
    sizes: Counter[str] = Counter()
    if root is not None:
        for t in [*root.parameters(), *root.buffers()]:
            if t.is_floating_point():
                sizes[str(t.dtype)] += t.numel()
    else:  # the parameters the trace saw being used
        for leaf in tracer.leaves:
            if leaf.name != "input":
                sizes[leaf.dtype] += math.prod(leaf.shape)
    return sizes.most_common(1)[0][0] if sizes else None


def explain_op_error(tracer: Tracer, error: BaseException) -> Finding | None:
    """A dtype-mismatch / device-mismatch finding for `error` raised by an op under `tracer`, else None."""
    text = str(error)
    what = mismatch_error(text)
    if what is None:
        return None
    frames = _frames(error.__traceback__)
    func, args, kwargs = _dispatch_call(tracer, frames)
    if func is None:
        return None
    origins = _Origins(tracer)
    operands = [
        {**origins.of_tensor(t), "dtype": str(t.dtype), "device": str(t.device), "shape": list(t.shape)}
        for t in tensors_in((args, kwargs))
    ]
    module, root = _module_of(tracer, frames)
    dispatch = _dispatch_frame(tracer, frames)
    failure = {
        "error": text.splitlines()[0] if text else type(error).__name__,
        "op": str(func),
        "module": module,
        "call": None,
        "operands": operands,
        "device": what == "device",
        "location": user_location(dispatch) if dispatch is not None else None,
    }
    finding = explain_mismatch(failure, _main_dtype(tracer, root), root)
    # unknown keys are omitted (module may be null: outside any module)
    where = {k: v for k, v in finding.where.items() if v is not None or k == "module"}
    where["phase"] = where.get("phase") or "forward"
    evidence = {k: v for k, v in finding.evidence.items() if v is not None}
    evidence["operands"] = [_plain(o) for o in evidence.get("operands", [])]
    return dataclasses.replace(finding, where=where, evidence=evidence)


def _plain(operand: dict[str, Any]) -> dict[str, Any]:
    """An operand for the report: JSON-ready, unknowns omitted, the location as 'file:line'."""
    out = {k: v for k, v in operand.items() if v is not None and k != "from"}
    location = out.get("location")
    if isinstance(location, tuple):
        out["location"] = f"{location[0]}:{location[1]}"
    return out
