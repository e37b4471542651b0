"""The precisions `compare` can put a model in, as transformed copies of it.

fp16 / bf16: the copy is cast. fp8 (e4m3 / e5m2, tensorwise or rowwise scaling): every Linear
quantizes its input and weight to fp8 with dynamic amax scaling and dequantizes them before an
fp32 matmul - the numerics of fp8 training recipes (torchao float8) without fp8 hardware.
fp16-accumulate: an fp16 copy whose Linear layers sum their K dimension in chunks whose partial
sums are rounded to fp16, as GEMMs that accumulate in fp16 (reduced-precision reductions) do.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fpdoctor.precision.names import CANDIDATES, REFERENCES, check_name

__all__ = [
    "CANDIDATES",
    "REFERENCES",
    "cast_inputs",
    "check_device",
    "check_name",
    "compute_dtype",
    "fp8_quantize",
    "make_run",
    "split_inputs",
]
ACCUMULATE_CHUNK = 64  # K elements per fp16-rounded partial sum


def compute_dtype(name: str) -> torch.dtype:
    """The dtype a run's inputs and parameters are in."""
    return {
        "fp64": torch.float64,
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp16-accumulate": torch.float16,
    }.get(name, torch.float32)


def fp8_quantize(x: torch.Tensor, fp8: torch.dtype, rowwise: bool, amax: torch.Tensor | None = None) -> torch.Tensor:
    """Scale so the amax (per tensor or per row) maps to the format's max, cast, dequantize.

    `amax` overrides the tensorwise amax: rows of a tensor quantized with the whole tensor's scale."""
    fmax = torch.finfo(fp8).max
    x32 = x.float()
    if amax is None:
        amax = x32.abs().amax(dim=-1, keepdim=True) if rowwise else x32.abs().amax()
    amax = amax.float()
    scale = fmax / amax.clamp_min(1e-12)
    return (x32 * scale).clamp(-fmax, fmax).to(fp8).float() / scale


class Fp8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, fp8: torch.dtype, rowwise: bool) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.fp8, self.rowwise = fp8, rowwise

    def forward(self, x: torch.Tensor, input_amax: torch.Tensor | None = None) -> torch.Tensor:
        """`input_amax`: the tensorwise scale's amax when `x` is some rows of a larger input."""
        xq = fp8_quantize(x, self.fp8, self.rowwise, None if self.rowwise else input_amax)
        wq = fp8_quantize(self.weight, self.fp8, self.rowwise)  # rowwise: per output channel
        return F.linear(xq, wq, None if self.bias is None else self.bias.float()).to(x.dtype)


class Fp16AccumulateLinear(nn.Module):
    def __init__(self, linear: nn.Linear, chunk: int = ACCUMULATE_CHUNK) -> None:
        super().__init__()
        self.weight, self.bias, self.chunk = linear.weight, linear.bias, chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        acc = None
        for start in range(0, k, self.chunk):
            part = x[..., start : start + self.chunk].float() @ self.weight[:, start : start + self.chunk].float().T
            acc = part.half() if acc is None else (acc.float() + part).half()  # the running sum lives in fp16
        assert acc is not None
        if self.bias is not None:
            acc = (acc.float() + self.bias.float()).half()
        return acc


def _replace_linears(model: nn.Module, make: Any) -> None:
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, make(child))
        else:
            _replace_linears(child, make)


def _copy_as(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """deepcopy with floating parameters and buffers converted on the way, so a full-size copy in
    the original dtype never exists next to the converted one (memory is O(one copy))."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if p.is_floating_point():
            memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype)
    return copy.deepcopy(model, memo)


def make_run(model: nn.Module, name: str) -> nn.Module:
    """A copy of `model` in precision `name` (a reference or a candidate)."""
    if name in ("fp64", "fp32", "fp16", "bf16"):
        return _copy_as(model, compute_dtype(name))
    run = copy.deepcopy(model)
    if name.startswith("fp8"):
        fp8 = torch.float8_e5m2 if "e5m2" in name else torch.float8_e4m3fn
        rowwise = name.endswith("rowwise")
        run = run.float()
        _replace_linears(run, lambda lin: Fp8Linear(lin, fp8, rowwise))
        return run
    if name == "fp16-accumulate":
        run = run.half()
        _replace_linears(run, Fp16AccumulateLinear)
        return run
    raise ValueError(f"unknown precision {name!r}")


def cast_inputs(inputs: Any, dtype: torch.dtype | None, device: torch.device | None = None) -> Any:
    """Floating tensors in `inputs` (nested tuples, lists, dicts) to dtype and device; None keeps it."""
    if isinstance(inputs, torch.Tensor):
        if inputs.is_floating_point():
            return inputs.to(device=device, dtype=dtype)
        return inputs if device is None else inputs.to(device)
    if isinstance(inputs, tuple):
        return tuple(cast_inputs(v, dtype, device) for v in inputs)
    if isinstance(inputs, list):
        return [cast_inputs(v, dtype, device) for v in inputs]
    if isinstance(inputs, dict):
        return {k: cast_inputs(v, dtype, device) for k, v in inputs.items()}
    return inputs


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs as (args, kwargs): a dict is keyword arguments, a tuple positional ones."""
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def check_device(name: str) -> torch.device:
    """A device the candidate can run on here, or ValueError saying why not."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"unknown device {name!r}; use e.g. cpu, cuda, cuda:1, mps, xpu") from None
    backend = {"cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None), "xpu": getattr(torch, "xpu", None)}
    if device.type != "cpu":
        module = backend.get(device.type)
        if module is None or not module.is_available():
            what = {"cuda": "CUDA", "mps": "Apple MPS"}.get(device.type, device.type.upper())
            raise ValueError(
                f"device {name!r} is not available: torch here sees no {what} device; run where one is, or use cpu"
            )
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r} does not exist: torch sees {torch.cuda.device_count()} CUDA device(s)")
    return device
