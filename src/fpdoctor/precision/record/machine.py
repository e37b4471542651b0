"""The facts of a machine that change what a compare run computes, for a compare record.

Cheap on purpose (no `fpdoctor env` machinery, no child process): torch's own version and build,
the device the candidate ran on (GPU name, capability, SM count, driver through NVML, the cuBLAS
actually loaded; for a CPU its model, the ISA torch dispatches to and the thread count, which
decide the CPU kernels' blocking), Python and the platform, and the precision flags in effect.
CUDA is asked only when the run used it. Identity (host name, UUID, PCI bus) is left out: it
always differs between two machines and changes no result.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any

import torch

from fpdoctor._version import __version__

Fact = str | int | float | bool | None

# key -> how the report names it, in the order the report lists what differs
LABELS = {
    "device": "device",
    "gpu": "GPU",
    "capability": "compute capability",
    "sm_count": "SMs",
    "driver": "driver",
    "cuda": "CUDA (torch build)",
    "cublas": "cuBLAS loaded",
    "cudnn": "cuDNN",
    "cpu": "CPU",
    "cpu_isa": "CPU ISA (torch dispatch)",
    "threads": "torch threads",
    "torch": "torch",
    "torch_git": "torch commit",
    "hip": "ROCm (torch build)",
    "python": "Python",
    "platform": "platform",
    "fpdoctor": "fpdoctor",
    "tf32_matmul": "TF32 matmul (torch.backends.cuda.matmul.allow_tf32)",
    "tf32_cudnn": "TF32 cuDNN (torch.backends.cudnn.allow_tf32)",
    "float32_matmul_precision": "float32 matmul precision",
    "fp16_reduction": "fp16 reduced-precision reductions (your flag)",
    "bf16_reduction": "bf16 reduced-precision reductions",
    "compare_fp16_reduction": "fp16 GEMM reductions in the candidate run",
    "deterministic": "deterministic algorithms",
    "fp8_gemm": "fp8 GEMM",
}
# what a fix can change with a line of Python, and the line
FLAG_FIXES = {
    "tf32_matmul": "torch.backends.cuda.matmul.allow_tf32 = False",
    "tf32_cudnn": "torch.backends.cudnn.allow_tf32 = False",
    "float32_matmul_precision": "torch.set_float32_matmul_precision('highest')",
    "fp16_reduction": "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False",
    "bf16_reduction": "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False",
}


def facts(device: torch.device, run: dict[str, Any] | None = None) -> dict[str, Fact]:
    """This machine's facts for a run whose candidate ran on `device`. `run`: what compare's own
    report says it ran with (data["flags"], data["fp8_kernel"])."""
    from fpdoctor.health.device_id import cpu_model

    out: dict[str, Fact] = {
        "device": str(device),
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "fpdoctor": __version__,
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp16_reduction": bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "bf16_reduction": bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }
    if device.type == "cuda":
        out.update(_cuda(device))
    elif device.type == "cpu":  # what decides the CPU kernels' blocking, so their summation order
        out |= {"cpu_isa": _cpu_isa(), "threads": torch.get_num_threads()}
    flags = (run or {}).get("flags")
    if isinstance(flags, dict) and "allow_fp16_reduced_precision_reduction" in flags:
        out["compare_fp16_reduction"] = bool(flags["allow_fp16_reduced_precision_reduction"])
    fp8 = (run or {}).get("fp8_kernel")
    if isinstance(fp8, dict) and isinstance(fp8.get("text"), str):
        out["fp8_gemm"] = fp8["text"]
    return out


def _cpu_isa() -> str | None:
    with contextlib.suppress(AttributeError, RuntimeError):
        return str(torch.backends.cpu.get_cpu_capability())
    return None


def _cuda(device: torch.device) -> dict[str, Fact]:
    """The GPU the candidate ran on; the run has started CUDA already."""
    from fpdoctor.health.device_id import cublas_version, describe

    found: dict[str, Fact] = {}
    with contextlib.suppress(Exception):  # a fact that cannot be read is left out, not a failure
        gpu = describe(device)
        found |= {"gpu": gpu.get("mig") or gpu.get("name"), "capability": gpu.get("capability")}
        found |= {"sm_count": gpu.get("sm_count"), "driver": gpu.get("driver")}
    with contextlib.suppress(Exception):
        found["cublas"] = cublas_version()
    with contextlib.suppress(Exception):
        found["cudnn"] = torch.backends.cudnn.version()
    return found


def name(facts: dict[str, Any]) -> str:
    """The machine in a few words: its GPU and capability, else its CPU."""
    if facts.get("gpu"):
        capability = f" (sm {facts['capability']})" if facts.get("capability") else ""
        return f"{facts['gpu']}{capability}"
    return str(facts.get("cpu") or facts.get("device") or "unknown")


def differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Keys whose values differ between two machines' facts, in LABELS order, then the rest."""
    keys = [k for k in LABELS if k in a or k in b] + sorted((a.keys() | b.keys()) - LABELS.keys())
    return [k for k in keys if a.get(k) != b.get(k)]


def show(value: Any) -> str:
    return "-" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
