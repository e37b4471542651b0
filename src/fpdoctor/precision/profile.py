"""The per-module error profile of a compare run: rows, the divergence verdict, the report."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.limits import DTYPE_FORMAT, FORMATS
from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.fit import describe as describe_misfit
from fpdoctor.precision.fit import within
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import sqnr_db
from fpdoctor.report.model import Finding, Report

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
    input_floor: float | None = None  # the reference fed candidate-rounded inputs; measured when the root diverges
    overflows: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> the op inside it that overflows
    input_sets: int = 1  # how many input sets were judged; report and rows are the worst one's
    worst_set: int = 0


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
    input_floor: float | None = None,
    causes: dict[str, dict[str, Any]] | None = None,
) -> CompareResult:
    """`input_floor`: the reference's end-to-end error fed candidate-rounded inputs, measured when
    the whole model diverges and no submodule does; `causes`: per module, what compare found
    behind its divergence (an op inside it that overflows, parameters that do not fit the format)."""
    label = candidate if device is None else f"{candidate} on {device}"
    findings = []
    first = next((r for r in rows if r.diverged), None)
    diverged = [r for r in rows if r.diverged]
    first_text = f"`{first.module}`" if first is not None else "none"
    if first is not None and first.module == "":
        finding, first_text = _root_finding(first, label, candidate, reference, input_floor)
        findings.append(finding)
    elif first is not None:
        cause = (causes or {}).get(first.module)
        findings.append(
            _divergence(
                first, diverged, label=label, candidate=candidate, device=device, reference=reference, cause=cause
            )
        )
    final = rows[-1] if rows else None
    summary = [
        ("candidate / reference", f"{label} / {reference}, judged against fp64"),
        ("modules compared", str(len(rows))),
        ("first divergent module", first_text),
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
    if input_floor is not None:
        report.data["input_floor"] = input_floor
    first_module = first.module if first is not None and first.module else None
    return CompareResult(report, rows, first_module, peak, input_floor=input_floor)


# The whole model's error is put down to rounding its inputs when the reference, fed the rounded
# inputs, is already within 2x (6 dB) of it.
INPUT_EXPLAINS = 2.0


def _root_finding(
    root: ModuleRow, label: str, candidate: str, reference: str, input_floor: float | None
) -> tuple[Finding, str]:
    """The whole model diverges and no submodule does: it is not a keep-in-fp32 candidate. Either
    rounding the inputs explains it, or the model's own ops (its forward, outside any submodule) do."""
    rounding = (
        f"rounding the inputs to {candidate} alone costs {_fmt(input_floor)} at the output (the {reference} model "
        f"fed {candidate}-rounded inputs)"
        if input_floor is not None
        else ""
    )
    explained = (
        input_floor is not None
        and root.isolated is not None
        and math.isfinite(root.isolated)
        and root.isolated <= INPUT_EXPLAINS * input_floor
    )
    evidence = {
        "candidate": candidate,
        "reference": reference,
        "isolated_rel": root.isolated,
        "floor_rel": root.floor,
        "ratio": root.ratio,
        "propagated_rel": root.propagated,
        "input_floor_rel": input_floor,
        "count": 1,
        "numel": root.numel,
        "dtype": str(compute_dtype(candidate)),
    }
    if explained:
        finding = catalog.make(
            "precision-divergence",
            title=f"Rounding the inputs to {candidate} already costs more than the noise floor",
            message=(
                f"In {label}, no module diverges by itself: the end-to-end error {_fmt(root.propagated)} "
                f"({_fmt_ratio(root.ratio)} the noise floor of {root.floor:.2g}) comes from the inputs, as "
                f"{rounding}. The model is ill-conditioned at {candidate}: keeping parts of it in fp32 does not "
                "undo rounded inputs."
            ),
            where={"module": None, "op": None, "phase": "forward"},
            evidence={"kind": "input-rounding", **evidence},
            fix=(
                "give the ops that read the inputs fp32 inputs (compute them in fp32), or make the model less "
                "sensitive to its inputs (a smaller scale on attention scores, a normalisation before them); "
                "`fpdoctor plan` measures this floor and judges a plan against it"
            ),
        )
        return finding, f"none: rounding the inputs explains the error ({_fmt(input_floor)})"
    finding = catalog.make(
        "precision-divergence",
        title=f"The whole model's own ops lose precision in {candidate}",
        message=(
            f"In {label}, the whole model's own ops (its forward, outside any submodule) add an error of "
            f"{_fmt(root.isolated)} ({_fmt_ratio(root.ratio)} the noise floor of {root.floor:.2g}); no submodule "
            "diverges by itself." + (f" For comparison, {rounding}." if rounding else "")
        ),
        where={"module": "", "op": None, "phase": "forward", "iteration": root.call},
        evidence={"kind": "divergence", **evidence, "diverged": ["<root>"]},
        fix=(
            "the whole model is not a keep-in-fp32 candidate: move the ops of its forward that lose precision into a "
            "submodule (then `fpdoctor plan` can keep that in fp32), or compute them in fp32 explicitly (their "
            "operands .float(), the result cast back)"
        ),
    )
    return finding, "none: the whole model's own ops (outside any submodule)"


def _divergence(
    first: ModuleRow,
    diverged: list[ModuleRow],
    *,
    label: str,
    candidate: str,
    device: torch.device | None,
    reference: str,
    cause: dict[str, Any] | None,
) -> Finding:
    why = (
        f"its fp64 output does not even fit {candidate}'s range"
        if first.out_of_range
        else f"{_fmt_ratio(first.ratio)} the noise floor of {first.floor:.2g}"
    )
    evidence: dict[str, Any] = {
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
        "diverged": [r.module or "<root>" for r in diverged[:10]],
    }
    message = (
        f"In {label}, module `{first.module}` adds an error of {_fmt(first.isolated)} by itself ({why}); "
        f"{len(diverged)} module(s) diverge in all. The end-to-end error there is {_fmt(first.propagated)} "
        f"({sqnr_db(first.propagated):.1f} dB SQNR)."
    )
    where: dict[str, Any] = {"module": first.module, "op": None, "phase": "forward", "iteration": first.call}
    fix = _fix(first.module, candidate)
    if cause:
        evidence.update(cause.get("evidence", {}))
        message += cause.get("message", "")
        where["op"] = cause.get("op")
        fix = cause.get("fix") or fix
    return catalog.make("precision-divergence", message=message, where=where, evidence=evidence, fix=fix)


def causes(
    rows: list[ModuleRow],
    overflows: dict[tuple[str, int], dict[str, Any]],
    misfit: list[dict[str, Any]],
    candidate: str,
) -> dict[str, dict[str, Any]]:
    """Per divergent module, what compare found behind it, for its finding: an op inside it that
    overflows although the module's output fits the format, and its parameters or buffers that
    do not fit the format themselves (message, evidence, the op for `where`, a fix)."""
    found: dict[str, dict[str, Any]] = {}
    for row in rows:
        if not row.diverged or not row.module or row.module in found:
            continue
        message, fixes = "", []
        evidence: dict[str, Any] = {}
        op = None
        overflow = overflows.get((row.module, row.call))
        if overflow is not None:
            op = overflow["op"]
            fmt = FORMATS.get(DTYPE_FORMAT.get(overflow["dtype"], ""))
            limit = fmt.max if fmt is not None else None
            size = overflow.get("reference_absmax")
            at = f" ({overflow['location']})" if overflow.get("location") else ""
            reach = f": its values reach {size:.3g}, beyond {candidate}'s max {limit:.6g}" if size and limit else ""
            message += f" Its output fits {candidate}, but inside it {op} overflows{reach}{at}."
            evidence |= {"overflow_inside": True, "overflow_op": op, "overflow_absmax": size, "overflow_limit": limit}
            evidence |= {"overflow_location": overflow.get("location")}
            fixes.append(
                f"compute {op} inside `{row.module}` in fp32{at}: its operands .float(), the result cast back after "
                "the ops that consume it (e.g. the softmax); or scale its operands down before it"
            )
        tensors = within(misfit, row.module)
        if tensors:
            listed = "; ".join(describe_misfit(e) for e in tensors[:3])
            message += f" Its {listed}: that alone breaks it in {candidate}."
            evidence["misfits"] = tensors[:10]
            fixes.append(f"keep `{row.module}` in fp32, where its tensors fit (`fpdoctor plan` keeps it)")
        if message:
            if candidate in ("fp16", "fp16-accumulate"):
                fixes.append("or use bf16, which has fp32's range")
            found[row.module] = {"message": message, "evidence": evidence, "op": op, "fix": "; ".join(fixes)}
    return found


def merge_sets(
    results: list[CompareResult], described: list[dict[str, Any]], given: tuple[list[Finding], str | None]
) -> CompareResult:
    """Several input sets: the worst set's result (the worst verdict, then the largest end-to-end
    error), with each other set's findings for modules the worst set does not name, and a line
    per set. One set: its result, with its inputs named. `given`: the model as given (audit)."""

    def badness(k: int) -> tuple[int, float]:
        r = results[k]
        rank = max((f.severity.rank for f in r.report.findings), default=0)
        return rank, r.rows[-1].propagated if r.rows else 0.0

    worst = max(range(len(results)), key=badness)
    main = results[worst]
    findings = list(given[0]) + list(main.report.findings)
    seen = {(f.name, f.where.get("module")) for f in main.report.findings}
    for k, r in enumerate(results):
        for f in r.report.findings if k != worst else []:
            if (f.name, f.where.get("module")) not in seen:
                seen.add((f.name, f.where.get("module")))
                findings.append(dataclasses.replace(f, evidence={**f.evidence, "input_set": k}))
    if len(results) > 1:
        for f in main.report.findings:
            findings[findings.index(f)] = dataclasses.replace(f, evidence={**f.evidence, "input_set": worst})
    main.report.findings = findings
    data = main.report.data
    data["inputs"] = [
        {
            **d,
            "end_to_end_rel": r.rows[-1].propagated if r.rows else None,
            "first_divergent": r.first_divergent,
            "verdict": r.report.verdict,
        }
        for d, r in zip(described, results, strict=True)
    ]
    data["worst_input_set"] = worst
    lines: list[tuple[str, str]] = []
    if given[1]:
        lines.append(("model as given", given[1]))
    if len(results) == 1:
        lines.append(("inputs", inputs_text(described[0])))
    else:
        lines.append(("input sets judged", f"{len(results)}; worst: #{worst}, {inputs_text(described[worst])}"))
        for k, r in enumerate(results):
            end = _fmt_error(r.rows[-1].propagated, r.rows[-1].cosine) if r.rows else "-"
            lines.append((f"  set #{k}", f"end-to-end error {end}; first divergent: {r.first_divergent or 'none'}"))
    data["summary"][1:1] = lines
    main.input_sets, main.worst_set = len(results), worst
    return main


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
