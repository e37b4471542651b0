"""The per-module error profile of a compare run: rows, the divergence verdict, the report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.metrics import sqnr_db
from fpdoctor.report.model import Report

# 16x the floor is 12 dB: input and output rounding plus fp32 accumulation stay below it on every
# healthy layer we measured (MiniLM in fp16 and bf16), accumulation loss and overflow do not.
DIVERGENCE_RATIO = 16.0


@dataclass
class ModuleRow:
    module: str
    call: int
    leaf: bool
    numel: int
    propagated: float
    isolated: float | None
    floor: float
    reference: float | None
    nonfinite: int
    out_of_range: bool = False
    cosine: float | None = None  # of the propagated output, against fp64
    isolated_cosine: float | None = None
    isolated_rows: int | None = None  # rows of the output the isolated error was measured on; None: all

    @property
    def ratio(self) -> float | None:
        if self.isolated is None:
            return None
        return math.inf if math.isinf(self.isolated) else self.isolated / max(self.floor, 1e-300)

    inherited: bool = False  # a container above the floor only because a module inside it diverges

    @property
    def exceeds(self) -> bool:
        return self.ratio is not None and (math.isinf(self.ratio) or self.ratio > DIVERGENCE_RATIO)

    @property
    def diverged(self) -> bool:
        return self.exceeds and not self.inherited

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module or "<root>",
            "call": self.call,
            "leaf": self.leaf,
            "numel": self.numel,
            "propagated_rel": self.propagated,
            "propagated_sqnr_db": sqnr_db(self.propagated),
            "propagated_cosine": self.cosine,
            "isolated_rel": self.isolated,
            "isolated_sqnr_db": None if self.isolated is None else sqnr_db(self.isolated),
            "isolated_cosine": self.isolated_cosine,
            "isolated_rows": self.isolated_rows,
            "floor_rel": self.floor,
            "reference_rel": self.reference,
            "ratio": self.ratio,
            "diverged": self.diverged,
            "inherited": self.inherited,
            "nonfinite": self.nonfinite,
            "out_of_range": self.out_of_range,
        }


@dataclass
class CompareResult:
    report: Report
    rows: list[ModuleRow] = field(default_factory=list)
    first_divergent: str | None = None
    peak_extra_bytes: int = 0  # the fp64 samples kept (one forward's working set and the weight copies aside)
    noise: list[torch.Tensor] | None = None  # random draws the forward made itself, in fp64 (see noise.py)


def children(rows: list[ModuleRow], name: str, call: int) -> list[ModuleRow]:
    """Rows of `name`'s descendants from this call: in post-order they come right before it."""
    position = next((k for k, r in enumerate(rows) if r.module == name and r.call == call), len(rows))
    prefix = f"{name}." if name else ""
    found = []
    for row in reversed(rows[:position]):
        if not row.module.startswith(prefix) or row.module == name:
            break
        found.append(row)
    return found


def build_report(
    rows: list[ModuleRow],
    *,
    candidate: str,
    device: torch.device | None,
    reference: str,
    notes: dict[str, str],
    peak: int,
) -> CompareResult:
    label = candidate if device is None else f"{candidate} on {device}"
    findings = []
    first = next((r for r in rows if r.diverged), None)
    if first is not None:
        diverged = [r for r in rows if r.diverged]
        why = (
            f"its fp64 output does not even fit {candidate}'s range"
            if first.out_of_range
            else f"{_fmt_ratio(first.ratio)} the noise floor of {first.floor:.2g}"
        )
        findings.append(
            catalog.make(
                "precision-divergence",
                message=(
                    f"In {label}, module `{first.module or '<root>'}` adds an error of "
                    f"{_fmt(first.isolated)} by itself ({why}); {len(diverged)} module(s) diverge in all. "
                    f"The end-to-end error there is {_fmt(first.propagated)} "
                    f"({sqnr_db(first.propagated):.1f} dB SQNR)."
                ),
                where={"module": first.module, "op": None, "phase": "forward", "iteration": first.call},
                evidence={
                    "kind": "divergence",
                    "candidate": candidate,
                    "device": None if device is None else str(device),
                    "reference": reference,
                    "out_of_range": first.out_of_range,
                    "isolated_rel": first.isolated,
                    "floor_rel": first.floor,
                    "ratio": first.ratio,
                    "propagated_rel": first.propagated,
                    "count": len(diverged),
                    "numel": first.numel,
                    "dtype": str(compute_dtype(candidate)),
                    "diverged": [r.module for r in diverged[:10]],
                },
                fix=_fix(first.module, candidate),
            )
        )
    final = rows[-1] if rows else None
    summary = [
        ("candidate / reference", f"{label} / {reference}, judged against fp64"),
        ("modules compared", str(len(rows))),
        ("first divergent module", f"`{first.module or '<root>'}`" if first else "none"),
        ("end-to-end error", _fmt_error(final.propagated, final.cosine) if final else "-"),
    ]
    ranked = sorted(
        (r for r in rows if r.ratio is not None and not r.inherited), key=lambda r: r.ratio or 0.0, reverse=True
    )
    if ranked:
        worst = ", ".join(
            f"`{r.module or '<root>'}` " + ("non-finite" if math.isinf(r.ratio or 0.0) else f"{r.ratio:.2g}x")
            for r in ranked[:3]
        )
        summary.append(("largest isolated error / floor", worst))
    report = Report(
        command="compare",
        findings=findings,
        data={
            "summary": summary,
            "modules": [r.as_dict() for r in rows],
            "not_checked": notes,
            "table": _table(rows),
            "divergence_ratio": DIVERGENCE_RATIO,
            "peak_compare_bytes": peak,
        },
    )
    return CompareResult(report, rows, first.module if first else None, peak)


TABLE_ROWS = 24  # text, markdown and html show at most this many modules; JSON has them all


def _table(rows: list[ModuleRow]) -> dict[str, Any]:
    """The per-module error profile, in model order; for large models the rows that matter most."""
    shown = rows
    title = "Per module, in model order: SQNR against fp64 in dB (higher is better)"
    if len(rows) > TABLE_ROWS:
        worst = sorted(range(len(rows)), key=lambda k: -(rows[k].ratio or 0.0))[: TABLE_ROWS - 1]
        shown = [rows[k] for k in sorted({*worst, len(rows) - 1})]  # and the output, last in post-order
        title += f"; the {len(shown)} of {len(rows)} with the largest isolated error / floor (JSON has all)"

    def db(value: float | None) -> str:
        return "-" if value is None else "non-finite" if math.isinf(value) else f"{sqnr_db(value):.1f}"

    def ratio(r: ModuleRow) -> str:
        if r.ratio is None:
            return "-"
        verdict = " diverges" if r.diverged else " (from inside)" if r.inherited else ""
        return ("non-finite" if math.isinf(r.ratio) else f"{r.ratio:.2g}x") + verdict

    return {
        "title": title,
        "columns": ["module", "propagated", "isolated", "floor", "isolated/floor", "NaN/Inf"],
        "rows": [
            [
                (r.module or "<root>") + (f" #{r.call}" if r.call else ""),
                db(r.propagated),
                db(r.isolated),
                db(r.floor),
                ratio(r),
                str(r.nonfinite) if r.nonfinite else "",
            ]
            for r in shown
        ],
    }


def _fix(module: str, candidate: str) -> str:
    if candidate == "fp32":
        return (
            f"the device's fp32 kernels differ at `{module}`: turn off TF32 "
            "(torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False, "
            "torch.set_float32_matmul_precision('highest')); `fpdoctor env` shows the flags in effect"
        )
    if candidate == "fp16-accumulate":
        return (
            f"accumulate `{module}` in fp32: on CUDA, torch.backends.cuda.matmul."
            "allow_fp16_reduced_precision_reduction = False (compare --candidate fp16 shows the result); "
            "for a custom fp16-accumulating kernel, keep this module in fp32 (fpdoctor plan)"
        )
    return (
        f"keep `{module}` in fp32 (fpdoctor plan finds the smallest such set), or use bf16 "
        "if the cause is range, fp32 accumulation if it is a long reduction"
    )


def _fmt_error(rel: float, cosine: float | None) -> str:
    if math.isinf(rel):
        return "non-finite"
    # Near 1 the digits that matter are in the distance from 1.
    cos = "" if cosine is None else f", cosine {cosine:.4f}" if cosine < 0.999 else f", cosine 1 - {1 - cosine:.1e}"
    return f"{_fmt(rel)} ({sqnr_db(rel):.1f} dB SQNR{cos})"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else ("non-finite" if math.isinf(value) else f"{value:.3g}")


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else ("infinitely above" if math.isinf(ratio) else f"{ratio:.0f}x")
