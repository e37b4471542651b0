"""`fpdoctor.harmonize(model, device)`: one dtype per device, cast consistently, exceptions kept.

The dtype follows the device: CUDA with bf16 support -> bf16 (fp16's range without loss
scaling); older CUDA -> fp16; CPU and MPS -> fp32, unless a dtype is asked for. Modules in
`keep_fp32` (fp32 norms by choice) and a plan's exceptions (`plan=`) stay fp32 and get boundary
casts, so their inputs arrive in fp32 and their outputs leave in the model's dtype - except the
plan's modules whose outputs do not fit half precision's range: those stay fp32.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fpdoctor.precision.audit.boundary import boundaries, cast_inputs_to, input_cast, keep_in_fp32, release
from fpdoctor.precision.candidates import uncompiled

if TYPE_CHECKING:
    from fpdoctor.precision.plan.plan import Plan


@dataclass
class HarmonizeResult:
    dtype: torch.dtype
    device: torch.device
    reason: str
    changed: list[dict[str, str]] = field(default_factory=list)  # one row per parameter/buffer that moved
    kept_fp32: list[str] = field(default_factory=list)


def choose_dtype(device: torch.device) -> tuple[torch.dtype, str]:
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bf16 support: bf16 keeps fp32's range without loss scaling"
        return torch.float16, "CUDA device without bf16: fp16, with fp32 exceptions where the plan says so"
    return torch.float32, f"{device.type} device: fp32 (half precision there is slow or unsupported; ask for it)"


def harmonize(
    model: nn.Module,
    device: str | torch.device = "cpu",
    *,
    dtype: torch.dtype | None = None,
    keep_fp32: Iterable[str] = (),
    plan: Plan | None = None,
) -> HarmonizeResult:
    """Cast `model` in place to one dtype on `device`; `keep_fp32` module paths and the plan's
    exceptions stay fp32."""
    model = uncompiled(model)
    target_device = torch.device(device)
    if dtype is None:
        dtype, reason = choose_dtype(target_device)
    else:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        reason = f"{dtype} as asked"
    keep = list(dict.fromkeys([*keep_fp32, *(plan.keep_fp32 if plan is not None else [])]))
    fp32_outputs = set(plan.fp32_outputs) if plan is not None else set()
    modules = dict(model.named_modules())
    unknown = [k for k in keep if k not in modules]
    if unknown:
        raise ValueError(f"keep_fp32 names modules that do not exist: {', '.join(unknown)}")
    before = {name: (t.dtype, t.device) for name, t in _tensors(model)}
    for path in boundaries(model):  # earlier exceptions that are not asked for again
        if path not in keep:
            release(modules[path])
    model.to(device=target_device)
    model.to(dtype=dtype)  # floating tensors only; integer buffers keep their dtype
    for path in keep:
        modules[path].to(dtype=torch.float32)
        keep_in_fp32(modules[path], back_to=None if path in fp32_outputs else dtype)
    if input_cast(model) is not None:  # an applied plan's input cast follows the new dtype
        cast_inputs_to(model, dtype)
    result = HarmonizeResult(dtype=dtype, device=target_device, reason=reason, kept_fp32=keep)
    for name, t in _tensors(model):
        old_dtype, old_device = before[name]
        if (old_dtype, old_device) != (t.dtype, t.device):
            result.changed.append(
                {"tensor": name, "from": f"{old_dtype} on {old_device}", "to": f"{t.dtype} on {t.device}"}
            )
    return result


def _tensors(model: nn.Module) -> list[tuple[str, Any]]:
    return [*model.named_parameters(), *model.named_buffers()]
