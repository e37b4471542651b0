"""The precisions `compare` can put a model in, as transformed copies of it.

fp16 / bf16: the copy is cast. fp8 (e4m3 / e5m2, tensorwise or rowwise scaling): every Linear
quantizes its input and weight to fp8 with dynamic amax scaling, as fp8 training recipes
(torchao float8) do, and multiplies them with the real fp8 GEMM (torch._scaled_mm) where it
runs, else dequantizes them before an fp32 matmul (fake-quant: the same rounding, without fp8
hardware).
fp16-accumulate: on CUDA, an fp16 copy run with the real flag that lets cuBLAS reduce partial
sums in fp16 (run_flags); elsewhere, an fp16 copy whose Linear layers sum their K dimension in
chunks whose partial sums are rounded to fp16, as GEMMs that accumulate in fp16 do.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, PRECISIONS, REFERENCES, check_name
from fpdoctor.torchprivate import compiled_inner, has_scaled_mm, pytree, scaled_mm

__all__ = [
    "CANDIDATES",
    "FP8_KERNELS",
    "REFERENCES",
    "Call",
    "Given",
    "cast_inputs",
    "check_device",
    "check_name",
    "compute_dtype",
    "fp8_format",
    "fp8_quantize",
    "make_run",
    "map_tensors",
    "model_device",
    "resolve_fp8_kernel",
    "run_flags",
    "split_inputs",
    "uncompiled",
]
ACCUMULATE_CHUNK = 64  # K elements per fp16-rounded partial sum


def fp8_format(name: str) -> torch.dtype | None:
    """The fp8 dtype of an fp8 candidate (fp8-e4m3..., fp8-e5m2...), None for the others."""
    fp8 = PRECISIONS[name].fp8
    return None if fp8 is None else {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fp8]


def compute_dtype(name: str) -> torch.dtype:
    """The dtype a run's inputs and parameters are in."""
    dtype = getattr(torch, PRECISIONS[name].dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _to_fp8(
    x: torch.Tensor, fp8: torch.dtype, rowwise: bool, amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in fp8, scale): the amax (per tensor, or per row) maps to the format's max.

    `amax` overrides the tensorwise amax: rows of a tensor quantized with the whole tensor's scale."""
    fmax = torch.finfo(fp8).max
    x32 = x.float()
    if amax is None:
        amax = x32.abs().amax(dim=-1, keepdim=True) if rowwise else x32.abs().amax()
    scale = fmax / amax.float().clamp_min(1e-12)
    return (x32 * scale).clamp(-fmax, fmax).to(fp8), scale


def fp8_quantize(x: torch.Tensor, fp8: torch.dtype, rowwise: bool, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x quantized to fp8 with dynamic amax scaling and dequantized to float32."""
    q, scale = _to_fp8(x, fp8, rowwise, amax)
    return q.float() / scale


class Fp8Linear(nn.Module):
    """nn.Linear with its input and weight in fp8 (amax scaling, tensorwise or rowwise).

    kernel="scaled_mm" runs the real fp8 GEMM (torch._scaled_mm: its products, its accumulation);
    where that kernel does not run here (no fp8 support on the device, shapes it rejects), the
    layer falls back for good to kernel="fake": the same quantization, dequantized before an fp32
    matmul, and `fallback` says why."""

    def __init__(self, linear: nn.Linear, fp8: torch.dtype, rowwise: bool, kernel: str = "fake") -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.fp8, self.rowwise, self.kernel = fp8, rowwise, kernel
        self.fallback: str | None = None
        self._cached: tuple[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def _weight_fp8(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weight in fp8, scale, dequantized float32 weight), kept while the weight is unchanged and
        no gradient is wanted: compare runs each layer twice (isolated, then in the candidate run),
        and a static-weight fp8 recipe keeps its cast weights too."""
        if torch.is_grad_enabled() and self.weight.requires_grad:
            q, scale = _to_fp8(self.weight, self.fp8, self.rowwise)
            return q, scale, q.float() / scale
        key = (self.weight.data_ptr(), self.weight._version, self.weight.device)
        if self._cached is None or self._cached[0] != key:
            q, scale = _to_fp8(self.weight.detach(), self.fp8, self.rowwise)
            self._cached = (key, (q, scale, q.float() / scale))
        return self._cached[1]

    def forward(self, x: torch.Tensor, input_amax: torch.Tensor | None = None) -> torch.Tensor:
        """`input_amax`: the tensorwise scale's amax when `x` is some rows of a larger input."""
        input_amax = None if self.rowwise else input_amax
        if self.kernel == "scaled_mm" and self.fallback is None:
            try:
                return self._scaled_mm(x, input_amax)
            except (RuntimeError, NotImplementedError, AttributeError) as exc:
                self.fallback = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        xq = fp8_quantize(x, self.fp8, self.rowwise, input_amax)
        wq = self._weight_fp8()[2]  # rowwise: scaled per output channel
        return F.linear(xq, wq, None if self.bias is None else self.bias.float()).to(x.dtype)

    def _scaled_mm(self, x: torch.Tensor, input_amax: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        xq, x_scale = _to_fp8(rows, self.fp8, self.rowwise, input_amax)  # (M, 1) or a scalar
        wq, w_scale, _ = self._weight_fp8()  # (N, 1) or a scalar
        # the kernel multiplies by these: the inverse scales, rowwise as (M, 1) and (1, N); the
        # weight is passed transposed, i.e. column-major, as the fp8 GEMMs require
        scale_a, scale_b = x_scale.reciprocal().contiguous(), w_scale.reciprocal().t().contiguous()
        try:
            out = scaled_mm(xq.contiguous(), wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        except RuntimeError:
            if not self.rowwise:
                raise
            # rowwise fp8 GEMMs on CUDA write only bf16, as the rowwise training recipe does
            out = scaled_mm(xq.contiguous(), wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
        if self.bias is not None:
            out = out.float() + self.bias.float()
        return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


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
    the original dtype never exists next to the converted one (memory is O(one copy)).

    A parameter already in `dtype` is shared, not copied (our runs only read weights); buffers
    are always copied, as some modules update theirs in place during the forward."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if p.is_floating_point():
            memo[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        if b.is_floating_point():
            memo[id(b)] = b.detach().to(dtype, copy=True)
    return copy_module(model, memo)


def copy_module(model: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """copy.deepcopy of a module that also copies the tensors it holds as plain attributes while they
    are still in an autograd graph (a load-balancing loss a forward stored, `self.aux_loss = ...`),
    which deepcopy refuses: they are copied detached, as values."""
    memo = {} if memo is None else memo
    for module in model.modules():
        for value in vars(module).values():
            for t in pytree.tree_leaves(value) if isinstance(value, (list, tuple, dict)) else [value]:
                if isinstance(t, torch.Tensor) and not t.is_leaf and id(t) not in memo:
                    memo[id(t)] = t.detach().clone()
    return copy.deepcopy(model, memo)


def resolve_fp8_kernel(kernel: str, device: torch.device) -> str:
    """Which fp8 GEMM the fp8 candidates run: "scaled_mm" (the real one, falling back per layer
    where it does not run), "fake" (quantize, dequantize, fp32 GEMM), or for "auto" the first
    where the device has fp8 tensor cores (CUDA compute capability 8.9 or newer) and the second
    elsewhere: on CPU _scaled_mm is a reference loop with fake-quant's numerics (exact products,
    fp32 sums), hundreds of times slower."""
    kernel = check_name(kernel, FP8_KERNELS, "fp8 kernel")
    if kernel != "auto":
        return kernel
    if device.type == "cuda" and has_scaled_mm() and torch.cuda.get_device_capability(device) >= (8, 9):
        return "scaled_mm"
    return "fake"


def uncompiled(model: nn.Module) -> nn.Module:
    """The module inside a torch.compile wrapper (OptimizedModule), so names are the model's own;
    compiled code inside it runs eagerly under run_flags."""
    inner = compiled_inner(model)
    return inner if isinstance(inner, nn.Module) else model


def model_device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def make_run(model: nn.Module, name: str, fp8_kernel: str = "auto", device: torch.device | None = None) -> nn.Module:
    """A copy of `model` in precision `name` (a reference or a candidate), to run on `device`
    (default: where the model is); fp8_kernel: see resolve_fp8_kernel."""
    device = model_device(model) if device is None else device
    precision = PRECISIONS[name]
    run = _copy_as(model, compute_dtype(name))
    fp8 = fp8_format(name)
    if fp8 is not None:
        kernel = resolve_fp8_kernel(fp8_kernel, device)
        _replace_linears(run, lambda lin: Fp8Linear(lin, fp8, precision.rowwise, kernel))
    elif precision.accumulate and device.type != "cuda":  # on CUDA the real flag does it (run_flags)
        _replace_linears(run, Fp16AccumulateLinear)
    return run


@contextlib.contextmanager
def run_flags(name: str, device: torch.device) -> Iterator[dict[str, Any]]:
    """The backend flags a precision runs under, set for the duration and restored after.

    Everywhere, so that every run goes module by module as the hooks and the simulated layers
    need: torch.compile'd code runs eagerly, and the fused fast path of nn.TransformerEncoderLayer
    and nn.MultiheadAttention is off (it reads the Linear weights itself, past the simulated fp8 /
    fp16-accumulate layers and the modules a plan keeps in fp32).
    On CUDA, fp16 means fp32 accumulation throughout (allow_fp16_reduced_precision_reduction
    off) and fp16-accumulate is the real flag on: cuBLAS may then reduce split-K partial sums
    in fp16. Yields the CUDA flag it set and what it was before (the user's setting), if any."""
    mha = getattr(torch.backends, "mha", None)  # torch >= 2.2
    get_fastpath, set_fastpath = getattr(mha, "get_fastpath_enabled", None), getattr(mha, "set_fastpath_enabled", None)
    fastpath = get_fastpath() if get_fastpath is not None and set_fastpath is not None else None
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_fp16_reduced_precision_reduction
    flags: dict[str, Any] = {}
    exits = contextlib.ExitStack()
    precision = PRECISIONS[name]
    if device.type == "cuda" and precision.storage == "fp16":
        flags = {"allow_fp16_reduced_precision_reduction": precision.accumulate, "yours": before}
    # Compiled code runs eagerly, module by module, where hooks see it. Only if something was
    # compiled: torch._dynamo is then imported already, and importing it costs ~70 MB otherwise.
    stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None  # torch >= 2.6
    try:
        if stance is not None:
            exits.enter_context(stance("force_eager"))
        if set_fastpath is not None and fastpath is not None:
            set_fastpath(False)
        if flags:
            matmul.allow_fp16_reduced_precision_reduction = flags["allow_fp16_reduced_precision_reduction"]
        yield flags
    finally:
        matmul.allow_fp16_reduced_precision_reduction = before
        if set_fastpath is not None and fastpath is not None:
            set_fastpath(fastpath)
        exits.close()


@dataclass(frozen=True)
class Call:
    """Positional and keyword arguments of one call, for inputs that need both."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass(frozen=True)
class Given(Call):
    """Inputs a candidate run is fed as the user gave them, never cast to its dtype (cast_inputs
    moves them to its device only): the model casts them itself, as a model does that standardises
    its raw fp32 readings before its first layer (compare's `inputs_as_given`)."""


def map_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`value` with every tensor in it (nested tuples, lists, dicts, a Call) replaced by fn(tensor)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Call):  # a Given stays one
        return type(value)(map_tensors(value.args, fn), map_tensors(value.kwargs, fn))
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple keeps its type
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, tuple):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, Mapping):
        # a copy of the same type (OrderedDict, a tokenizer's BatchEncoding, a model-output class)
        try:
            mapped = value.copy()  # type: ignore[attr-defined]
        except Exception:  # a mapping whose copy() needs more than itself, or has none
            mapped = {}
        for k, v in value.items():
            mapped[k] = map_tensors(v, fn)
        return mapped
    return value


def cast_inputs(
    inputs: Any, dtype: torch.dtype | None, device: torch.device | None = None, *, copy: bool = False,
    given: dict[int, torch.dtype] | None = None,
) -> Any:  # fmt: skip
    """Floating tensors in `inputs` to dtype and device, other tensors to device; None keeps it.

    `copy=True` gives new tensors even where nothing changes: for the user's inputs handed to a
    forward of ours, as a forward may write into its input (`x.div_(255)`), and neither the
    user's tensor nor the next pass may see that. Inputs that are a `Given` keep their dtype, and
    so does a tensor among `given` (by id: the model's inputs fed as given, compare's re-runs)."""
    if isinstance(inputs, Given):
        dtype = None

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return t.to(device=device, dtype=given.get(id(t), dtype) if given else dtype, copy=copy)
        if device is None:
            return t.clone() if copy else t
        return t.to(device, copy=copy)

    return map_tensors(inputs, cast)


def split_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Example inputs as (args, kwargs): a dict is keyword arguments, a tuple positional ones."""
    if isinstance(inputs, Call):
        return inputs.args, inputs.kwargs
    if isinstance(inputs, Mapping):  # a dict, or a tokenizer's BatchEncoding
        return (), dict(inputs)
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
