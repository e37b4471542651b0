"""Names of the precisions compare knows; torch-free, so the CLI can validate them without torch."""

from __future__ import annotations

CANDIDATES = ("fp16", "bf16", "fp8-e4m3", "fp8-e4m3-rowwise", "fp8-e5m2", "fp16-accumulate")
REFERENCES = ("fp32", "fp64")


def check_name(name: str, allowed: tuple[str, ...], what: str) -> str:
    key = name.strip().lower()
    if key not in allowed:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(allowed)}")
    return key
