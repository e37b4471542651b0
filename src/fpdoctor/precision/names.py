"""Names of the precisions compare knows, with the spellings people use for them; torch-free, so
the CLI can validate them without importing torch.

One table serves every command: `float16`, `half`, `torch.float16` and `fp16` are the same
candidate for compare and plan, as they are for `trace --dtype` (`autocast_dtype`). A near miss
gets a "did you mean".
"""

from __future__ import annotations

import difflib

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

# Other spellings -> the canonical name. Keys are normalised (see _key): lower case, no "torch."
# prefix, "_" and " " read as "-".
_FORMATS = {
    "fp16": ("float16", "half", "f16"),
    "bf16": ("bfloat16", "brain-float16"),
    "fp32": ("float32", "float", "single", "f32"),
    "fp64": ("float64", "double", "f64"),
    "fp8-e4m3": ("fp8", "e4m3", "float8-e4m3", "float8-e4m3fn", "fp8-e4m3fn"),
    "fp8-e5m2": ("e5m2", "float8-e5m2"),
}
ALIASES: dict[str, str] = {}
for _name, _spellings in _FORMATS.items():
    for _spelling in (_name, *_spellings):
        ALIASES[_spelling] = _name
        if _name.startswith("fp8"):  # each fp8 spelling with rowwise scaling too
            for _suffix in ("-rowwise", "-row-wise", "-row"):
                ALIASES[_spelling + _suffix] = _name + "-rowwise"
for _spelling in ("fp16", "float16", "half"):
    for _suffix in ("-accumulate", "-accumulation", "-acc"):
        ALIASES[_spelling + _suffix] = "fp16-accumulate"
ALIASES.update({"scaled-mm": "scaled_mm", "scaledmm": "scaled_mm", "auto": "auto", "fake": "fake"})

# what plan cannot take, and why, for the message
_WHY_NOT = {("candidate", "fp32"): "plan keeps modules in fp32, so its candidate must be below fp32"}


def _key(name: str) -> str:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    return key.removeprefix("torch.")


def canonical(name: str) -> str | None:
    """The canonical name of any accepted spelling (`half` -> `fp16`), None when there is none."""
    return ALIASES.get(_key(name))


def check_name(name: str, allowed: tuple[str, ...], what: str) -> str:
    """`name` in canonical form if it is one of `allowed` (any spelling), else ValueError naming
    the choices, and the closest one when `name` looks like a typo."""
    found = canonical(name) if isinstance(name, str) else None
    if found in allowed:
        return found
    choices = ", ".join(allowed)
    if found is not None:
        why = _WHY_NOT.get((what, found), f"it is not a {what} here")
        spelled = repr(name) if _key(name) == found else f"{name!r} ({found})"
        raise ValueError(f"{what} {spelled} cannot be used: {why}; choose one of {choices}")
    hint = ""
    if isinstance(name, str):
        spellings = [k for k, v in ALIASES.items() if v in allowed]
        close = difflib.get_close_matches(_key(name), spellings, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {ALIASES[close[0]]}?"
    also = "; torch's names (float16, bfloat16, half) work too" if "fp16" in allowed or "fp32" in allowed else ""
    raise ValueError(f"unknown {what} {name!r}{hint} (choose one of {choices}{also})")


def autocast_dtype(name: str) -> str:
    """The torch dtype name (`float16`, `bfloat16`) of an autocast precision in any spelling."""
    found = check_name(name, ("fp16", "bf16"), "autocast dtype")
    return {"fp16": "float16", "bf16": "bfloat16"}[found]
