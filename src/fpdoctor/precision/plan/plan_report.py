"""A plan's report: what it achieved, what it could not, why each module is (or is not) kept, and
the next step.

A verified plan turns compare's divergence findings into warnings that say how the plan handles
each module (the problem is solved once the plan is applied: exit code 0); an unverified one
keeps them as errors and adds one finding with the closest set it reached and where to look
next: bf16 where the cause is range, the module with the largest error, or the model's own ops.
A tolerance below what rounding the inputs alone costs is said to be out of reach, with what
that means for the user.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fpdoctor import catalog
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.names import PRECISIONS
from fpdoctor.precision.plan.op_fixes import OpFix
from fpdoctor.precision.profile import METRIC, CompareResult, ModuleRow
from fpdoctor.report.model import Finding, Report, Severity, Trial

if TYPE_CHECKING:
    from fpdoctor.precision.plan.plan import Plan

_NO_PLAN = (
    "no keep-in-fp32 set reached the target (the closest set and its error are in the message): the next step "
    "named is not tried"
)
_APPLY = "apply the plan: fpdoctor.apply_plan(model, result.plan), or paste its code (result.plan.to_code())"
_RANGE_LIMITED = tuple(name for name, p in PRECISIONS.items() if p.storage == "fp16")  # fp16's max is 65504


@dataclass
class Search:
    """What the search measured, per input set: (inputs described, compare result, floor, input
    rounding, target, tolerance); errors per set without exceptions and with the plan (or the
    closest set); the worst set; the error without each kept module; the model as given."""

    sets: list[tuple[dict[str, Any], CompareResult, float, float, float, float]]
    baseline: list[float]
    final: list[float]
    worst: int
    needed: dict[str, float] = field(default_factory=dict)
    given: tuple[list[Finding], str | None] = ([], None)
    reference: str = "fp32"
    tolerance_asked: float | None = None
    by_op: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per kept module, (its effect on the end-to-end error averaged over the input sets, the
    # run-to-run spread of that error over them); `dropped`: those whose effect was within it
    effects: dict[str, tuple[float, float]] = field(default_factory=dict)
    dropped: dict[str, tuple[float, float]] = field(default_factory=dict)


def _fmt(value: float) -> str:
    return "non-finite" if math.isinf(value) else f"{value:.3g}"


def _factor(log_ratio: float) -> str:
    """A mean log ratio as the factor it is."""
    return "a non-finite factor" if math.isinf(log_ratio) else f"{math.exp(log_ratio):.3g}"


def _names(modules: list[str]) -> str:
    return ", ".join(f"`{m}`" for m in modules) or "nothing"


def _kept_by(module: str, keep: list[str]) -> str | None:
    return next((k for k in keep if module == k or module.startswith(k + ".")), None)


def build(the_plan: Plan, search: Search) -> Report:
    described, compared, floor, rounding, _, _ = search.sets[search.worst]
    findings: list[Finding] = list(search.given[0])
    findings += _compare_findings(the_plan, search)
    if any(fl > tol for _, _, fl, _, _, tol in search.sets):
        findings.append(_floor_finding(the_plan, search))
    if not the_plan.verified:
        findings.append(_unverified_finding(the_plan, search))
    summary: list[tuple[str, str]] = [
        (
            "candidate / floor model",
            f"{the_plan.candidate} / {search.reference}: every error is measured against fp64 (the referee)",
        )
    ]
    if len(search.sets) == 1:
        summary.append(("inputs", inputs_text(described)))
    else:
        summary.append(
            (
                "input sets judged",
                f"{len(search.sets)}; worst without exceptions: #{search.worst}, {inputs_text(described)}",
            )
        )
        with_plan = "with the plan" if the_plan.verified else "closest"
        for k, (_, _, _, _, target, _) in enumerate(search.sets):
            summary.append(
                (
                    f"  set #{k}",
                    f"without exceptions {_fmt(search.baseline[k])}; {with_plan} {_fmt(search.final[k])} "
                    f"(target {target:.3g})",
                )
            )
    if search.given[1]:
        summary.append(("model as given", search.given[1]))
    summary.append(("without exceptions", f"end-to-end error {_fmt(max(search.baseline))}"))
    summary.append(("error metric", METRIC))
    if rounding > 0:
        amplified = f", {floor / rounding:.2g}x the inputs' own rounding of {rounding:.2g}" if rounding else ""
        summary.append(
            (
                "input rounding floor" + (f" (set #{search.worst})" if len(search.sets) > 1 else ""),
                f"{_fmt(floor)}: the {search.reference} model fed {the_plan.candidate}-rounded inputs{amplified}; "
                "no plan goes below it",
            )
        )
    summary.append(("target", _target_text(the_plan, search)))
    if the_plan.verified:
        summary.append(("keep in fp32", _names(the_plan.keep_fp32)))
        for fix in the_plan.fp32_ops:
            summary.append((f"compute in fp32 in `{fix.module}`", _op_text(fix)))
        summary.append(
            ("verified", f"yes: end-to-end error {_fmt(the_plan.final_error)} (target {the_plan.target:.3g})")
        )
    else:
        summary.append(("keep in fp32", "no verified plan"))
        summary.append(
            (
                "verified",
                f"NO: the closest set ({len(the_plan.closest)} module(s) in fp32: {_names(the_plan.closest[:6])}"
                f"{' ...' if len(the_plan.closest) > 6 else ''}) reaches {_fmt(the_plan.final_error)} "
                f"(target {the_plan.target:.3g})",
            )
        )
    summary += _why(the_plan, search)
    step = _next_step(the_plan, search)
    if step:
        summary.append(("next step", step))
    return Report(
        command="plan",
        findings=findings,
        data={
            "summary": summary,
            "plan": the_plan.as_dict(),
            "inputs": [
                {**d, "baseline_error": b, "final_error": f, "floor": fl, "target": t}
                for (d, _, fl, _, t, _), b, f in zip(search.sets, search.baseline, search.final, strict=True)
            ],
            "worst_input_set": search.worst,
            "needed": search.needed,
            "table": compared.report.data.get("table"),  # compare's profile: why these modules
            "modules": compared.report.data.get("modules", []),
        },
    )


def _target_text(the_plan: Plan, search: Search) -> str:
    what = "the tolerance asked for" if search.tolerance_asked is not None else "16x the output's noise floor"
    target = the_plan.target if the_plan.target is not None else the_plan.tolerance
    if target > the_plan.tolerance:
        return (
            f"{target:.3g}: the tolerance {the_plan.tolerance:.3g} ({what}) is below the input rounding floor, out "
            f"of reach; the plan is judged against {target / max(the_plan.input_floor, 1e-300):.0f}x the floor instead"
        )
    return f"{target:.3g}: {what}"


def _op_text(fix: OpFix) -> str:
    at = f" ({fix.location})" if fix.location else ""
    end = f" up to {fix.end}" if fix.end else ", up to the softmax"
    return f"{fix.op}{at} and the ops that consume its result{end}"


def _divergent(search: Search) -> list[ModuleRow]:
    """Modules compare calls divergent on any input set, worst ratio first, once each."""
    rows: dict[str, ModuleRow] = {}
    for _, compared, *_ in search.sets:
        for r in compared.rows:
            if r.diverged and r.module and (r.module not in rows or (r.ratio or 0) > (rows[r.module].ratio or 0)):
                rows[r.module] = r
    return sorted(rows.values(), key=lambda r: -(r.ratio or 0.0))


def _why(the_plan: Plan, search: Search) -> list[tuple[str, str]]:
    """Why each kept module is needed, and why a module compare names is not kept."""
    lines = []
    target = the_plan.target if the_plan.target is not None else the_plan.tolerance
    divergent = {r.module for r in _divergent(search)}
    for name in the_plan.keep_fp32:
        if name in search.needed:
            text = f"without it the end-to-end error is {_fmt(search.needed[name])}"
            if name in search.effects:
                effect, spread = search.effects[name]
                text += (
                    f"; keeping it divides the error by {_factor(effect)} on average over {len(search.sets)} input "
                    f"sets, beyond their run-to-run spread (a factor of {_factor(spread)})"
                )
            elif len(search.sets) == 1:
                text += (
                    "; the evidence is one input set: the run-to-run spread is not measured, so noise cannot be "
                    "told from an effect (give several input sets)"
                )
            state = _accumulated_in(search, name)
            if state is not None:  # the error is made inside it, by a running state: say so, not amplification
                text += (
                    f"; the error is made inside it, by accumulation in the running state at {state} (compare's "
                    "finding), which keeping only that state in fp32 fixes"
                )
            elif name not in divergent:  # compare does not name it: its error is amplified further on
                text += "; compare does not call it divergent by itself, but what follows amplifies its error"
            lines.append((f"why `{name}`", text))
    for name, (effect, spread) in search.dropped.items():
        lines.append(
            (
                f"why not `{name}`",
                f"keeping it divides the end-to-end error by {_factor(effect)} on average over {len(search.sets)} "
                f"input sets, within their run-to-run spread (a factor of {_factor(spread)}): noise, not an "
                "effect, so the plan does not keep it",
            )
        )
    if not the_plan.verified:
        return lines
    for fix in the_plan.fp32_ops:
        whole, op = search.by_op.get(fix.module, (math.nan, math.nan))
        lines.append(
            (
                f"why the op, not all of `{fix.module}`",
                f"its overflowing {fix.op} and what consumes it in fp32 reach {_fmt(op)}, within the target; keeping "
                f"the whole module in fp32 reaches {_fmt(whole)} but computes all of it in fp32",
            )
        )
    fixed = {fix.module for fix in the_plan.fp32_ops}
    for row in _divergent(search)[:6]:
        holder = _kept_by(row.module, the_plan.keep_fp32)
        if holder == row.module or row.module in fixed:
            continue
        ratio = "non-finite" if math.isinf(row.ratio or 0.0) else f"{row.ratio:.0f}x its noise floor"
        if holder is not None:
            text = f"compare names it ({ratio}); it runs in fp32 as part of `{holder}`"
        else:
            text = (
                f"compare names it ({ratio} by itself), but the end-to-end error stays within the target "
                f"{target:.3g} without keeping it"
            )
        lines.append((f"why not `{row.module}`", text))
    return lines


def _accumulated_in(search: Search, module: str) -> str | None:
    """The source line of a running state compare found inside `module`, on any input set; None
    when there is none."""
    for _, compared, *_ in search.sets:
        for f in compared.report.findings:
            at = f.evidence.get("state_location") if f.evidence.get("kind") == "accumulation" else None
            owner = f.evidence.get("state_module")
            if at and owner is not None and (owner == module or owner.startswith(f"{module}.")):
                return str(at)
    return None


def _compare_findings(the_plan: Plan, search: Search) -> list[Finding]:
    """compare's findings, the worst set's first, each set's divergences once per module; under a
    verified plan its divergences are warnings saying what the plan does about them."""
    order = [search.worst] + [k for k in range(len(search.sets)) if k != search.worst]
    seen: set[tuple[str, Any]] = set()
    out: list[Finding] = []
    target = the_plan.target if the_plan.target is not None else the_plan.tolerance
    for k in order:
        for f in search.sets[k][1].report.findings:
            key = (f.name, f.where.get("module"))
            if key in seen:
                continue
            seen.add(key)
            evidence = dict(f.evidence) | ({"input_set": k} if len(search.sets) > 1 else {})
            if f.name != "precision-divergence":
                out.append(dataclasses.replace(f, evidence=evidence))
                continue
            module = f.where.get("module")
            if not the_plan.verified:
                out.append(
                    dataclasses.replace(
                        f, evidence=evidence, fix=_next_step(the_plan, search) or f.fix, trial=Trial.untried(_NO_PLAN)
                    )
                )
                continue
            holder = _kept_by(module, the_plan.keep_fp32) if module else None
            fix = next((x for x in the_plan.fp32_ops if x.module == module), None)
            if holder is not None:
                done = f" The plan keeps `{holder}` in fp32: end-to-end error {_fmt(the_plan.final_error)}, verified."
            elif fix is not None:
                done = (
                    f" The plan computes {_op_text(fix)} in fp32: end-to-end error {_fmt(the_plan.final_error)}, "
                    "verified."
                )
            else:
                done = (
                    f" The plan does not need to keep it: the end-to-end error stays within the target {target:.3g} "
                    "without it."
                )
            out.append(
                dataclasses.replace(
                    f,
                    severity=Severity.WARNING,
                    message=f.message + done,
                    evidence=evidence,
                    fix=_APPLY,
                    trial=Trial.checked(
                        "the plan applied"
                        + (f" ({_names(the_plan.keep_fp32[:4])} in fp32)" if the_plan.keep_fp32 else ""),
                        metric="end-to-end relative error against fp64",
                        before=the_plan.baseline_error,
                        after=the_plan.final_error,
                        on="the inputs given (the worst set)",
                    ),
                )
            )
    return out


def _floor_finding(the_plan: Plan, search: Search) -> Finding:
    _, _, floor, rounding, target, tolerance = max(search.sets, key=lambda s: s[2] / max(s[5], 1e-300))
    cand = the_plan.candidate
    amplified = f", {floor / rounding:.2g}x the rounding of the inputs themselves ({rounding:.2g})" if rounding else ""
    return catalog.make(
        "precision-divergence",
        severity=Severity.WARNING,
        title=f"Rounding the inputs to {cand} already costs more than the tolerance",
        message=(
            f"Rounding the inputs to {cand} alone moves the output by {_fmt(floor)} (the {search.reference} model "
            f"fed {cand}-rounded inputs, against fp64){amplified}: the model is ill-conditioned at {cand}. No "
            f"keep-in-fp32 plan goes below that floor with {cand} inputs, so the tolerance {tolerance:.3g} is out of "
            f"reach and the plan is judged against {target:.3g} instead. For you: run in {cand}, this model's output "
            f"is off by about {floor:.1%} whatever stays in fp32."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "input-rounding",
            "count": None,
            "numel": None,
            "dtype": cand,
            "floor_rel": floor,
            "input_rounding_rel": rounding,
            "tolerance": tolerance,
            "target": target,
        },
        fix=(
            "if that error matters, give the modules that read the inputs fp32 inputs (keep them in fp32 and do not "
            "cast the inputs), or make the model less sensitive to its inputs (a smaller scale on attention scores, "
            f"a normalisation before them); otherwise accept the plan judged against {target:.3g}"
        ),
        trial=Trial.untried(
            "a change to how the model reads its inputs, which no keep-in-fp32 set can make: the floor itself is "
            "what was measured"
        ),
    )


def _range_cause(search: Search) -> ModuleRow | None:
    for _, compared, *_ in search.sets:
        for r in compared.rows:
            if r.module and (r.out_of_range or r.nonfinite):
                return r
    return None


def _root_ops(search: Search) -> bool:
    """Whether the model's own ops (outside any submodule) diverge on some set."""
    return any(r.module == "" and r.diverged for _, compared, *_ in search.sets for r in compared.rows)


def _next_step(the_plan: Plan, search: Search) -> str | None:
    steps = []
    cand = the_plan.candidate
    if not the_plan.verified:
        ranged = _range_cause(search) if cand in _RANGE_LIMITED else None
        if cand in _RANGE_LIMITED and any(math.isinf(floor) for _, _, floor, *_ in search.sets):
            steps.append(
                f"the inputs themselves do not fit {cand} (values above 65504 become Inf before the first module): "
                "bf16 has fp32's range, try `fpdoctor plan MODEL --candidate bf16`, or scale the inputs"
            )
        elif ranged is not None:
            steps.append(
                f"the cause is range (`{ranged.module}`'s values do not fit {cand}, max 65504): bf16 has fp32's "
                "range, try `fpdoctor plan MODEL --candidate bf16`"
            )
        if _root_ops(search):
            steps.append(
                "the error is in the model's own forward (ops outside any submodule), which no module can keep in "
                "fp32: move those ops into a submodule (then a plan can keep it), or compute them in fp32 explicitly"
            )
        divergent = _divergent(search)
        if divergent:
            top = divergent[0]
            steps.append(
                f"look at `{top.module}` first (the largest isolated error: "
                + ("non-finite" if math.isinf(top.ratio or 0.0) else f"{top.ratio:.0f}x its noise floor")
                + f"); `fpdoctor compare MODEL --candidate {cand} --module {top.module}` shows it alone"
            )
    return "; ".join(steps) or None


def _unverified_finding(the_plan: Plan, search: Search) -> Finding:
    target = the_plan.target if the_plan.target is not None else the_plan.tolerance
    return catalog.make(
        "precision-divergence",
        title=f"No keep-in-fp32 set brings {the_plan.candidate} within the target",
        message=(
            f"Without exceptions the end-to-end error is {_fmt(max(search.baseline))}; the closest set, "
            f"{len(the_plan.closest)} module(s) in fp32 ({_names(the_plan.closest[:6])}), reaches "
            f"{_fmt(the_plan.final_error)}, above the target {target:.3g}. The plan keeps nothing and gives no code."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "divergence",
            "count": len(the_plan.closest),
            "numel": None,
            "dtype": the_plan.candidate,
            "closest": the_plan.closest,
            "closest_error": the_plan.final_error,
            "target": target,
        },
        fix=_next_step(the_plan, search) or "run the model in fp32, or in bf16 if fp16's range is the cause",
        trial=Trial.untried(_NO_PLAN),
    )
