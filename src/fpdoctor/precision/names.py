"""Names of the precisions compare knows, with the spellings people use for them; torch-free, so
the CLI can validate them without importing torch.

One table serves every command: `float16`, `half`, `torch.float16` and `fp16` are the same
candidate for compare and plan, as they are for `trace --dtype` (`autocast_dtype`). A near miss
gets a "did you mean".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from fpdoctor.formats import NAMES, normalise


@dataclass(frozen=True)
class Precision:
    """Everything the precision lab knows about one precision, in one declared entry: adding a
    candidate is adding a row here (and, for a new kind of arithmetic, its layer in candidates.py)."""

    name: str
    dtype: str  # torch dtype (attribute of `torch`) the run's inputs and parameters are in
    storage: str | None = None  # format (fpdoctor.formats) parameters are stored in; None: fp32/fp64, or scaled fp8
    fp8: str | None = None  # fp8 format of every Linear's input and weight ("e4m3", "e5m2")
    rowwise: bool = False  # fp8 scaling per row instead of per tensor
    accumulate: bool = False  # GEMM partial sums rounded to fp16 (cuBLAS's reduced-precision reduction)
    candidate: bool = True  # compare can judge it (fp64 is the truth, never a candidate)
    plan: bool = True  # plan can keep modules in fp32 below it (so not fp32 or fp64)
    applies: bool = False  # a plan for it is a dtype the user switches to (not an fp8 recipe)
    compiled: bool = False  # the model in `dtype` under torch.compile (Inductor), judged against eager


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp16", "float16", storage="fp16", applies=True),
        Precision("bf16", "bfloat16", storage="bf16", applies=True),
        # fp32 as a candidate is for device A vs device B (compare --device), or fp32 against fp64
        Precision("fp32", "float32", plan=False),
        Precision("fp8-e4m3", "float32", fp8="e4m3"),
        Precision("fp8-e4m3-rowwise", "float32", fp8="e4m3", rowwise=True),
        Precision("fp8-e5m2", "float32", fp8="e5m2"),
        Precision("fp8-e5m2-rowwise", "float32", fp8="e5m2", rowwise=True),
        Precision("fp16-accumulate", "float16", storage="fp16", accumulate=True, applies=True),
        Precision("compiled", "float32", plan=False, compiled=True),
        Precision("compiled-bf16", "bfloat16", storage="bf16", plan=False, compiled=True),
        Precision("compiled-fp16", "float16", storage="fp16", plan=False, compiled=True),
        Precision("fp64", "float64", candidate=False, plan=False),
    )
}
CANDIDATES = tuple(name for name, p in PRECISIONS.items() if p.candidate)
# plan keeps modules in fp32, so it needs a candidate below fp32.
PLAN_CANDIDATES = tuple(name for name, p in PRECISIONS.items() if p.plan)
REFERENCES = ("fp32", "fp64")


def default_reference(candidate: str, device: str | None) -> str:
    """The floor model when none is named: fp32, or fp64 for an fp32 candidate on the model's own
    device, whose fp32 floor would be the candidate itself (every error its own floor, always OK)."""
    return "fp64" if candidate == "fp32" and device is None else "fp32"


# how fp8 candidates multiply: the real fp8 GEMM (torch._scaled_mm), fake-quant, or the first where it is fast
FP8_KERNELS = ("auto", "scaled_mm", "fake")

# Other spellings -> the canonical name: the formats' own names (one table, in fpdoctor.formats),
# each fp8 one with rowwise scaling too, fp16 with fp16 accumulation, and the fp8 kernels.
ALIASES: dict[str, str] = {}
for _name, _spellings in NAMES.items():
    for _spelling in (_name, *_spellings):
        ALIASES[_spelling] = _name
        if _name.startswith("fp8"):  # each fp8 spelling with rowwise scaling too
            for _suffix in ("-rowwise", "-row-wise", "-row"):
                ALIASES[_spelling + _suffix] = _name + "-rowwise"
for _spelling in ("fp16", "float16", "half"):
    for _suffix in ("-accumulate", "-accumulation", "-acc"):
        ALIASES[_spelling + _suffix] = "fp16-accumulate"
# a compiled candidate in any spelling of its dtype: compiled-bfloat16, compiled-half, compiled-fp32
for _spelling, _name in list(ALIASES.items()):
    if _name in ("fp16", "bf16", "fp32"):
        ALIASES[f"compiled-{_spelling}"] = "compiled" if _name == "fp32" else f"compiled-{_name}"
ALIASES["compiled"] = "compiled"
ALIASES.update({"scaled-mm": "scaled_mm", "scaledmm": "scaled_mm", "auto": "auto", "fake": "fake"})

# what plan cannot take, and why, for the message
_WHY_NOT = {("candidate", "fp32"): "plan keeps modules in fp32, so its candidate must be below fp32"}


def canonical(name: str) -> str | None:
    """The canonical name of any accepted spelling (`half` -> `fp16`), None when there is none."""
    return ALIASES.get(normalise(name))


def check_name(name: str, allowed: tuple[str, ...], what: str) -> str:
    """`name` in canonical form if it is one of `allowed` (any spelling), else ValueError naming
    the choices, and the closest one when `name` looks like a typo."""
    found = canonical(name) if isinstance(name, str) else None
    if found in allowed:
        return found
    choices = ", ".join(allowed)
    if found is not None:
        why = _WHY_NOT.get((what, found), f"it is not a {what} here")
        spelled = repr(name) if normalise(name) == found else f"{name!r} ({found})"
        raise ValueError(f"{what} {spelled} cannot be used: {why}; choose one of {choices}")
    hint = ""
    if isinstance(name, str):
        spellings = [k for k, v in ALIASES.items() if v in allowed]
        close = difflib.get_close_matches(normalise(name), spellings, n=1, cutoff=0.6)
        if close:
            hint = f"; did you mean {ALIASES[close[0]]}?"
    also = "; torch's names (float16, bfloat16, half) work too" if "fp16" in allowed or "fp32" in allowed else ""
    raise ValueError(f"unknown {what} {name!r}{hint} (choose one of {choices}{also})")


def autocast_dtype(name: str) -> str:
    """The torch dtype name (`float16`, `bfloat16`) of an autocast precision in any spelling."""
    found = check_name(name, ("fp16", "bf16"), "autocast dtype")
    return {"fp16": "float16", "bf16": "bfloat16"}[found]
