"""Boundary casts for a module kept in fp32 inside a lower-precision model, and for the model itself.

A pre-hook casts floating inputs to fp32 and a post-hook casts floating outputs back, so the
module computes in fp32 while its neighbours keep their dtype. The model gets a pre-hook that
casts its floating inputs to its own dtype, so it takes the inputs the user already has (fp32
ones). Idempotent: a module gets its hooks once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import cast_inputs

_MARK = "_fpdoctor_fp32_boundary"  # the dtype outputs are cast back to
_HANDLES = "_fpdoctor_fp32_handles"
_INPUTS = "_fpdoctor_input_cast"  # (dtype, handle) of the model's input cast


def keep_in_fp32(module: nn.Module, back_to: torch.dtype | None) -> nn.Module:
    """Run `module` in fp32: its parameters become fp32, inputs in and outputs back to `back_to`.

    `back_to=None` leaves the outputs in fp32: for a module whose output range does not fit the
    model's dtype, so the next module must take fp32 too (a plan keeps it as well)."""
    module.to(torch.float32)
    if getattr(module, _HANDLES, None) is not None:
        setattr(module, _MARK, back_to)
        return module
    setattr(module, _MARK, back_to)

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return cast_inputs(args, torch.float32), cast_inputs(kwargs, torch.float32)

    def post(mod: nn.Module, args: Any, output: Any) -> Any:
        back = getattr(mod, _MARK)
        return output if back is None else cast_inputs(output, back)

    handles = (module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post))
    setattr(module, _HANDLES, handles)
    return module


def release(module: nn.Module) -> bool:
    """Remove the boundary casts `keep_in_fp32` added; True if there were any."""
    handles = getattr(module, _HANDLES, None)
    if handles is None:
        return False
    for handle in handles:
        handle.remove()
    delattr(module, _HANDLES)
    delattr(module, _MARK)
    return True


def boundaries(model: nn.Module) -> list[str]:
    """Paths of the modules that run in fp32 behind boundary casts."""
    return [name for name, m in model.named_modules() if getattr(m, _HANDLES, None) is not None]


def cast_inputs_to(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` casts its floating inputs to `dtype` on the way in (a second call changes the dtype)."""
    held = getattr(model, _INPUTS, None)
    if held is not None:
        held[1].remove()

    def pre(mod: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        return cast_inputs(args, dtype), cast_inputs(kwargs, dtype)

    setattr(model, _INPUTS, (dtype, model.register_forward_pre_hook(pre, with_kwargs=True)))
    return model


def input_cast(model: nn.Module) -> torch.dtype | None:
    """The dtype `model` casts its floating inputs to (`cast_inputs_to`), None when it does not."""
    held = getattr(model, _INPUTS, None)
    return held[0] if held is not None else None
