"""Floating-point formats: their names, the spellings people use for them, their limits, and how
close a value range may come to those limits.

The numbers are properties of the formats (IEEE 754 binary16/32, bfloat16, and the OCP 8-bit
formats E4M3 (no infinities, max 448) and E5M2), so they are written here rather than read from
torch, which keeps `fpdoctor explain`, the CLI's argument checks and offline reports free of a
torch import. One table of names serves every command: `half`, `torch.float16` and `fp16` are the
same format for `trace --dtype`, compare and plan.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    max: float  # largest finite value
    smallest_normal: float
    smallest_subnormal: float  # values below half of this round to zero
    mantissa_bits: int

    @property
    def flush_threshold(self) -> float:
        """Magnitudes below this round to zero (round-to-nearest at half the smallest subnormal)."""
        return self.smallest_subnormal / 2


# Rounding a value to a format costs at least this share of what the value varies by (its spread):
# the format is too coarse for it (bf16 at 100x its spread costs about a seventh). compare's output in
# its units (precision/units.py) and watch's training outputs (numerics/training/coarse_output.py).
COARSE = 0.05


FORMATS: dict[str, Format] = {
    "fp32": Format("fp32", 3.4028234663852886e38, 1.1754943508222875e-38, 1.401298464324817e-45, 23),
    "fp16": Format("fp16", 65504.0, 6.103515625e-05, 5.960464477539063e-08, 10),
    "bf16": Format("bf16", 3.3895313892515355e38, 1.1754943508222875e-38, 9.183549615799121e-41, 7),
    "fp8_e4m3": Format("fp8_e4m3", 448.0, 0.015625, 0.001953125, 3),
    "fp8_e5m2": Format("fp8_e5m2", 57344.0, 6.103515625e-05, 1.52587890625e-05, 2),
}

# torch dtype names -> our format names (kept as strings: no torch import here).
DTYPE_FORMAT = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e5m2": "fp8_e5m2",
}

# The one table of format names: each canonical name and the other spellings people use for it
# (torch's dtype names, C's, the OCP fp8 names). Keys are normalised (see `normalise`). A format
# with limits is in FORMATS under the name's identifier form (`fp8_e4m3` for `fp8-e4m3`), as
# records, statistics and findings' evidence name it; fp64 has no limits here: it is the truth.
NAMES: dict[str, tuple[str, ...]] = {
    "fp16": ("float16", "half", "f16"),
    "bf16": ("bfloat16", "brain-float16"),
    "fp32": ("float32", "float", "single", "f32"),
    "fp64": ("float64", "double", "f64"),
    "fp8-e4m3": ("fp8", "e4m3", "float8-e4m3", "float8-e4m3fn", "fp8-e4m3fn"),
    "fp8-e5m2": ("e5m2", "float8-e5m2"),
}
ALIASES: dict[str, str] = {spelling: name for name, spellings in NAMES.items() for spelling in (name, *spellings)}


def normalise(name: str) -> str:
    """A spelling as the tables hold it: lower case, no `torch.` prefix, `_` and ` ` read as `-`."""
    return name.strip().lower().replace("_", "-").replace(" ", "-").removeprefix("torch.")


def canonical(name: str) -> str | None:
    """The canonical name of any spelling of a format (`half` -> `fp16`), None when there is none."""
    return ALIASES.get(normalise(name))


def format_named(name: str) -> Format:
    """Look up a format by any common spelling; ValueError names the accepted ones."""
    found = canonical(name)
    fmt = FORMATS.get(found.replace("-", "_")) if found is not None else None
    if fmt is None:
        raise ValueError(f"unknown dtype {name!r}; use one of fp32, fp16, bf16, fp8-e4m3, fp8-e5m2")
    return fmt


# `overflow-risk` starts at half a format's max: from there, one doubling overflows - twice the
# sequence length under a sum (attention scores, a pooled feature), an input scaled by 2, a
# logit scale or learning-rate step that doubles a weight. Ranges move by such factors between
# the batch that was traced and the ones that come later, so 90% (the old threshold) stayed
# silent at 62% on attention scores that overflowed a few steps on. One binade of headroom is
# what the `margin` of Transformer Engine's fp8 DelayedScaling recipe buys per unit (the scale
# divided by 2**margin).
OVERFLOW_SHARE = 0.50
# Underflow is judged on the share of non-zero values that would flush to zero.
UNDERFLOW_SHARE = 0.01
