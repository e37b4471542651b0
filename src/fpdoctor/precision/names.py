"""Names of the precisions compare knows; torch-free, so the CLI can validate them without torch."""

from __future__ import annotations

# fp32 as a candidate is for device A vs device B (compare --device), or to measure fp32 against fp64.
CANDIDATES = (
    "fp16",
    "bf16",
    "fp32",
    "fp8-e4m3",
    "fp8-e4m3-rowwise",
    "fp8-e5m2",
    "fp8-e5m2-rowwise",
    "fp16-accumulate",
)
# plan keeps modules in fp32, so it needs a candidate below fp32.
PLAN_CANDIDATES = tuple(c for c in CANDIDATES if c != "fp32")
REFERENCES = ("fp32", "fp64")
# how fp8 candidates multiply: the real fp8 GEMM (torch._scaled_mm), fake-quant, or the first where it is fast
FP8_KERNELS = ("auto", "scaled_mm", "fake")


def check_name(name: str, allowed: tuple[str, ...], what: str) -> str:
    key = name.strip().lower()
    if key not in allowed:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(allowed)}")
    return key
