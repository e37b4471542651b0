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
from fpdoctor.precision.plan.metric import KL_MIN, Measured, Metric, metric
from fpdoctor.precision.plan.op_fixes import OpFix
from fpdoctor.precision.profile import METRIC, CompareResult, ModuleRow, known
from fpdoctor.report.model import Finding, Report, Severity, Trial

if TYPE_CHECKING:
    from fpdoctor.precision.plan.plan import Plan

_NO_PLAN = (
    "no keep-in-fp32 set reached the target (the closest set and its error are in the message): the next step "
    "named is not tried"
)
_LAST_RESORT = "run the model in fp32, or in bf16 if fp16's range is the cause"
# the command prints the plan's code after the report; the Python API returns it on the result
_APPLY = (
    "apply the plan: paste the plan's code (printed after this report; data.plan.code in JSON) after the "
    "model is built, or in Python fpdoctor.apply_plan(model, result.plan)"
)
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
    metric: Metric = field(default_factory=lambda: metric("rel"))
    metric_asked: bool = True
    # the what-ifs (--metric kl|top1): a module set alone in fp32, the metric then (worst set)
    what_if: list[tuple[list[str], float]] = field(default_factory=list)
    measured: tuple[list[Measured], list[Measured]] = ([], [])  # without exceptions, with the plan: every way
    head: str | None = None  # the logits' layer
    the_plan_outputs: list[str] = field(default_factory=list)  # kept modules whose outputs stay fp32
    decisions_back: bool = False  # with the plan, compare would not call the decisions changed on any set
    coarse_output: bool = False  # top1, kl: rounding the exact output alone flips too many decisions for a target
    inputs_past_range: bool = False  # an input holds values past the candidate's largest finite value


def _fmt(value: float) -> str:
    return "non-finite" if math.isinf(value) else f"{value:.3g}"


def _factor(log_ratio: float) -> str:
    """A mean log ratio as the factor it is."""
    return "a non-finite factor" if math.isinf(log_ratio) else f"{math.exp(log_ratio):.3g}"


def _val(m: Metric, value: float) -> str:
    """A value of the plan's metric; a relative error as a bare number, as the report always said it."""
    return _fmt(value) if m.name == "rel" else m.show(value)


def _noun(m: Metric) -> str:
    return {"rel": "end-to-end error", "top1": "share of rows whose top-1 differs", "kl": "KL"}[m.name]


def _worst(m: Metric, measured: list[Measured]) -> str:
    """Every figure of the run on the set where the plan's metric is worst."""
    return max(measured, key=m.value).text() if measured else "not measured"


def _names(modules: list[str]) -> str:
    return ", ".join(f"`{m}`" for m in modules) or "nothing"


def _inputs_rounded(f: Finding) -> tuple[str, str] | None:
    """(what, the fix) where compare's finding names the inputs' rounding as the cause, its fix checked."""
    if "whole_numbers" in f.evidence:
        return "the inputs' whole numbers are rounded", "the ids kept exact"
    if f.evidence.get("inputs_as_given") and f.trial is not None and f.trial.tried:
        return "the model's inputs are rounded before it computes on them", "that computation before the cast"
    return None


def _broken(f: Finding) -> bool:
    """compare's finding that the floor model is itself far off fp64: no plan judged against it holds."""
    return f.evidence.get("kind") == "reference-broken"


def _kept_by(module: str, keep: list[str]) -> str | None:
    return next((k for k in keep if module == k or module.startswith(k + ".")), None)


def build(the_plan: Plan, search: Search) -> Report:
    described, compared, floor, rounding, _, _ = search.sets[search.worst]
    m = search.metric
    findings: list[Finding] = list(search.given[0])
    findings += _compare_findings(the_plan, search)
    # whole numbers the format rounds (compare's input-rounding finding, its fix checked), or inputs
    # rounded before the model computes on them (a standardisation inside it, its fix checked), are
    # the floor's cause: no "ill-conditioned model" beside it, and no module set is the fix
    whole = next((cause for f in findings if (cause := _inputs_rounded(f)) is not None), None)
    # the plan is the bare cast (nothing kept) and the inputs' rounding is past the tolerance: the error is the
    # floor's, which no set of modules changes; its fix is how the model reads its inputs (not tried here)
    floor_only = not whole and the_plan.verified and _bare(the_plan) and not the_plan.reachable
    broken = next((f for f in findings if _broken(f)), None)
    if any(fl > tol for _, _, fl, _, _, tol in search.sets) and not whole:
        found = _floor_finding(the_plan, search)
        findings.append(dataclasses.replace(found, severity=Severity.ERROR) if floor_only else found)
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
                    f"without exceptions {_val(m, search.baseline[k])}; {with_plan} {_val(m, search.final[k])} "
                    f"(target {m.bound(target)})",
                )
            )
    if search.given[1]:
        summary.append(("model as given", search.given[1]))
    if m.decisions:
        summary.append(("without exceptions", _worst(search.metric, search.measured[0])))
        why = "" if search.metric_asked else f"; {_DEFAULT_FP8 if search.metric.name == 'top1' else _DEFAULT}"
        summary.append(("plan metric", m.describe + why))
    else:
        summary.append(("without exceptions", f"end-to-end error {_fmt(max(search.baseline))}"))
        summary.append(("error metric", METRIC))
    if rounding > 0:
        amplified = (
            f", {floor / rounding:.2g}x the inputs' own rounding of {rounding:.2g}"
            if math.isfinite(floor)
            else ": rounding the inputs alone breaks it"
        )
        summary.append(
            (
                "input rounding floor" + (f" (set #{search.worst})" if len(search.sets) > 1 else ""),
                f"{_val(m, floor)}: the {search.reference} model fed {the_plan.candidate}-rounded inputs{amplified}; "
                "no plan goes below it",
            )
        )
    summary.append(("target", _target_text(the_plan, search)))
    if search.what_if:
        summary.append((f"what-if, alone in fp32 (by {m.name})", _what_if_text(search)))
    # where the plan returns the logits from its layer kept in fp32, the format is no longer the limit
    wider = search.head is not None and search.head in search.the_plan_outputs
    coarse = next(
        (f for f in findings if f.name == "output-too-coarse" and not (f.trial is not None and f.trial.tried)), None
    )
    coarse = None if wider else coarse
    # a target set from the format's own floor cannot see what the format loses, nor reach it from modules
    too_coarse = ""
    if coarse is not None and search.head is not None:  # a layer makes the logits: keeping it wider is the fix
        too_coarse = (
            f"; the output's format itself flips some decisions ({coarse.code}): `{search.head}` kept in fp32, "
            "returning fp32, is its fix" + (", which this target does not need" if the_plan.verified else "")
        )
    elif coarse is not None:
        too_coarse = (
            f"; but the output's format itself is too coarse for it ({coarse.code}): no set of modules kept in fp32 "
            "changes that, its fix does"
        )
    if whole:  # the floor is the inputs' rounding: no set of modules is the fix
        the_plan.instead = whole[0]
        summary.append(("keep in fp32", f"no module set is the fix: {whole[0]}"))
        summary.append(("verified", f"the finding's fix instead ({whole[1]}), checked"))
    elif broken is not None:
        the_plan.instead = (
            f"the {search.reference} model itself is {_fmt(broken.evidence['reference_rel'])} off fp64, so a target "
            "set from its error proves nothing"
        )
        summary.append(("keep in fp32", f"no module set is the fix: {the_plan.instead}"))
        summary.append(("verified", f"no: fix the {search.reference} model first (the first finding says how)"))
    elif floor_only:
        the_plan.instead = (
            f"rounding the inputs to {the_plan.candidate} is the error ({_val(m, the_plan.input_floor)}), which no set "
            "of modules kept in fp32 changes"
        )
        summary.append(("keep in fp32", f"no module set is the fix: {the_plan.instead}"))
        summary.append(
            ("verified", "no: the fix is how the model reads its inputs (the findings below say how; not tried here)")
        )
    elif the_plan.verified:
        summary.append(("keep in fp32", _names(the_plan.keep_fp32)))
        for fix in the_plan.fp32_ops:
            summary.append((f"compute in fp32 in `{fix.module}`", _op_text(fix)))
        if m.decisions:
            aim = m.bound(_target(the_plan))
            text = f"yes: {m.show(the_plan.final_error)} (target {aim}); {_worst(m, search.measured[1])}"
        else:
            text = f"yes: end-to-end error {_fmt(the_plan.final_error)} (target {the_plan.target:.3g})"
        # an error no module kept in fp32 fixes (a router's top-k that picks otherwise): the plan alone is not the fix
        beside = next((f for f in findings if f.severity == Severity.ERROR and f.name in _BESIDE_THE_PLAN), None)
        if beside is not None:
            text += (
                f"; but not the whole fix: {beside.code} {beside.name} below is an error that no module kept in fp32 "
                "takes away, and its fix goes with the plan"
            )
        summary.append(("verified", text + too_coarse))
    else:
        summary.append(("keep in fp32", "no verified plan"))
        summary.append(
            (
                "verified",
                f"NO: the closest set ({len(the_plan.closest)} module(s) in fp32: {_names(the_plan.closest[:6])}"
                f"{' ...' if len(the_plan.closest) > 6 else ''}) reaches {_val(m, the_plan.final_error)} "
                f"(target {m.bound(_target(the_plan))}){too_coarse}",
            )
        )
    summary += _why(the_plan, search)
    step = None if whole or broken else _next_step(the_plan, search)  # the finding's checked fix is the next step
    if step:
        summary.append(("next step", step))
    return Report(
        command="plan",
        findings=findings,
        data={
            "summary": summary,
            "plan": the_plan.as_dict(),
            "metric": m.name,
            "what_if": [{"modules": mods, "value": v} for mods, v in search.what_if],
            "measured": {
                "without_exceptions": [dataclasses.asdict(x) for x in search.measured[0]],
                "with_plan" if the_plan.verified else "closest": [dataclasses.asdict(x) for x in search.measured[1]],
            },
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


_DEFAULT = (
    "the default where compare finds the logits' decisions changed, which the relative error misses: KL is "
    "continuous, so it ranks modules that leave the same number of flips apart, and it reads the whole distribution "
    "that sampling and the loss read; top-1 agreement is measured beside it"
)
_DEFAULT_FP8 = (
    "the default where compare finds the logits' decisions changed by an fp8 candidate: its layers return "
    "fp32, so rounding the exact output costs no KL to speak of and 256x it is no target; compare's "
    "decisions rule is"
)
_FLOOR_TEXT = {
    "rel": "16x the output's noise floor",
    "top1": "compare's decisions-changed rule: at most 16x the rows that rounding the exact output flips, or 1% "
    "of the rows where that is more (where rounding alone flips many, output-too-coarse says the format is the "
    "limit)",
    "kl": "256x the KL of the exact output rounded to the candidate's format (16x its error: KL grows with the "
    "error's square)",
}


def _target(the_plan: Plan) -> float:
    return the_plan.target if the_plan.target is not None else the_plan.tolerance


def _target_text(the_plan: Plan, search: Search) -> str:
    m = search.metric
    what = "the tolerance asked for" if search.tolerance_asked is not None else _FLOOR_TEXT[m.name]
    if m.name == "kl" and search.tolerance_asked is None and the_plan.tolerance <= KL_MIN:
        # 256x a floor of ~1e-14 (fp32 logits from an fp8 candidate) is no target: the least one chased is said
        what = f"the least KL a plan chases ({KL_MIN:g} nats: 256x its floor is below it)"
    if search.tolerance_asked is None and search.coarse_output:  # plan.py _Set.coarse_output
        what = (
            f"rounding the exact output to {the_plan.candidate} alone changes the decisions (output-too-coarse), so "
            "the target is for logits kept wider: "
            + (
                "16x what rounding their features or the inputs to it costs, or 1% of the rows where that is more"
                if m.name == "top1"
                else "256x the KL that rounding their features or the inputs to it costs"
            )
        )
    target = _target(the_plan)
    # a KL under a large floor (logits of a temperature near 0) can still flip decisions: a KL plan keeps both
    decided = "; and every set's top-1 within compare's decisions rule" if m.name == "kl" else ""
    if target > the_plan.tolerance and m.bound(target) != m.bound(the_plan.tolerance):
        return (
            f"{m.bound(target)}: the tolerance {m.bound(the_plan.tolerance)} ({what}) is below the input rounding "
            f"floor, out of reach; the plan is judged against {FLOOR_MARGIN_TEXT[m.power]} the floor instead{decided}"
        )
    return f"{m.bound(target)}: {what}{decided}"


FLOOR_MARGIN_TEXT = {1: "2x", 2: "4x (2x the error)"}


def _what_if_text(search: Search) -> str:
    m = search.metric
    head = search.head
    parts = []
    for mods, value in search.what_if:
        out = " (fp32 logits)" if head in mods else ""
        parts.append(f"{' and '.join(f'`{x}`' for x in mods)}{out}: {m.show(value)}")
    return f"without exceptions {m.show(max(search.baseline))}; " + "; ".join(parts)


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
    m = search.metric
    target = _target(the_plan)
    divergent = {r.module for r in _divergent(search)}
    for name in the_plan.keep_fp32:
        if name in search.needed:
            text = (
                f"without it the end-to-end error is {_fmt(search.needed[name])}"
                if m.name == "rel"
                else f"without it, {m.show(search.needed[name])}"
            )
            if name in search.effects:
                effect, spread = search.effects[name]
                text += (
                    f"; keeping it divides the {_noun(m) if m.decisions else 'error'} by {_factor(effect)} on average "
                    f"over {len(search.sets)} input sets, beyond their run-to-run spread (a factor of "
                    f"{_factor(spread)})"
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
            elif name in search.the_plan_outputs and name != search.head:  # its fp32 output feeds what is kept
                text += "; its output stays fp32 for the module kept after it, which reads what it computes"
            elif m.decisions and name not in divergent:
                text += "; compare does not call it divergent by itself: its rounding changes the decisions"
            elif name not in divergent:  # compare does not name it: its error is amplified further on
                text += "; compare does not call it divergent by itself, but what follows amplifies its error"
            lines.append((f"why `{name}`", text))
    for name, (effect, spread) in search.dropped.items():
        lines.append(
            (
                f"why not `{name}`",
                f"keeping it divides the {_noun(m)} by {_factor(effect)} on average over {len(search.sets)} "
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
                f"its overflowing {fix.op} and what consumes it in fp32 reach {_val(m, op)}, within the target; "
                f"keeping the whole module in fp32 reaches {_val(m, whole)} but computes all of it in fp32",
            )
        )
    fixed = {fix.module for fix in the_plan.fp32_ops}
    for row in _divergent(search)[:6]:
        holder = _kept_by(row.module, the_plan.keep_fp32)
        if holder == row.module or row.module in fixed:
            continue
        ratio = (
            "non-finite"
            if math.isinf(row.ratio or 0.0)
            else f"{row.ratio:.0f}x its noise floor"
            if known(row.judged_floor)
            else f"an error of {row.isolated:.3g} where rounding loses nothing"
        )
        if holder is not None:
            text = f"compare names it ({ratio}); it runs in fp32 as part of `{holder}`"
        else:
            text = (
                f"compare names it ({ratio} by itself), but the {_noun(m)} stays within the target "
                f"{m.bound(target)} without keeping it"
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


# compare's findings that no set of modules kept in fp32 answers: a verified plan says they stand beside it
_BESIDE_THE_PLAN = ("selection-changed",)


def _compare_findings(the_plan: Plan, search: Search) -> list[Finding]:
    """compare's findings, the worst set's first, each set's divergences once per module; under a
    verified plan its divergences are warnings saying what the plan does about them."""
    order = [search.worst] + [k for k in range(len(search.sets)) if k != search.worst]
    seen: set[tuple[str, Any]] = set()
    out: list[Finding] = []
    m = search.metric
    target = _target(the_plan)
    # a floor model far off fp64 (compare's reference-broken): no plan judged against it is the fix
    broken = any(_broken(f) for _, c, *_ in search.sets for f in c.report.findings)
    for k in order:
        for f in search.sets[k][1].report.findings:
            key = (f.name, f.where.get("module"))
            if key in seen or f.name == "error-builds-up":  # what the plan's own search measures and answers
                continue
            seen.add(key)
            evidence = dict(f.evidence) | ({"input_set": k} if len(search.sets) > 1 else {})
            if f.name == "decisions-changed" and the_plan.verified and search.decisions_back:
                out.append(_decisions_back(the_plan, search, f, evidence))
                continue
            if f.name == "decisions-changed" and not the_plan.verified:
                # no module set gave the decisions back: compare's own fix where its run gave them back
                # (a checked trial there always did: use.finding); where compare judged the divergence's
                # checked fix by top-1 and it did not, never that fix: the next step, untried
                checked = f.trial is not None and f.trial.tried
                judged = any(key in f.evidence for key in ("running_state_kept", "lines_in_fp32"))
                if checked:
                    out.append(dataclasses.replace(f, evidence=evidence))
                elif judged:
                    step = _next_step(the_plan, search) or _LAST_RESORT
                    out.append(dataclasses.replace(f, evidence=evidence, fix=step, trial=Trial.untried(_NO_PLAN)))
                else:
                    out.append(dataclasses.replace(f, evidence=evidence, **_checked_or_next(the_plan, search)))
                continue
            if (
                f.name != "precision-divergence" or _inputs_rounded(f) is not None or _broken(f)
                or f.evidence.get("kind") == "own-code"
            ):  # fmt: skip
                # another finding, inputs whose values the format rounds, or the model's own code around its
                # submodules (its ops, not a module, compare's check in fp32): no module set is its fix
                out.append(dataclasses.replace(f, evidence=evidence))
                continue
            module = f.where.get("module")
            if not the_plan.verified or (_bare(the_plan) and not the_plan.reachable) or broken:
                # no plan, or one that keeps nothing against an input floor past the tolerance ("apply the plan"
                # would change nothing, and a fix that changes nothing is never printed as the fix): compare's
                # own fix for it, checked (a line in fp32, a state, a constant), stays as it was tried: no module
                # set is its fix, and the plan's next step would be a guess beside it
                checked = f.trial is not None and f.trial.tried
                out.append(
                    dataclasses.replace(f, evidence=evidence)
                    if checked
                    else dataclasses.replace(
                        f, evidence=evidence, fix=_next_step(the_plan, search) or f.fix, trial=Trial.untried(_NO_PLAN)
                    )
                )
                continue
            holder = _kept_by(module, the_plan.keep_fp32) if module else None
            fix = next((x for x in the_plan.fp32_ops if x.module == module), None)
            got = f"end-to-end error {_fmt(the_plan.final_error)}" if m.name == "rel" else m.show(the_plan.final_error)
            if holder is not None and f.evidence.get("kind") == "accumulation" and len(the_plan.keep_fp32) > 1:
                # the states' lines run in every call of their module's code: name the whole set kept
                done = (
                    f" The plan keeps {_names(the_plan.keep_fp32[:6])} in fp32, `{holder}` among them: {got}, verified."
                )
            elif holder is not None:
                others = [k for k in the_plan.keep_fp32 if k != holder]
                also = f" (and {_names(others[:6])})" if others else ""
                done = f" The plan keeps `{holder}` in fp32{also}: {got}, verified."
            elif fix is not None:
                done = f" The plan computes {_op_text(fix)} in fp32: {got}, verified."
            elif f.trial is not None and f.trial.tried:
                # the plan keeps nothing for it: "apply the plan" would change nothing, so compare's own fix,
                # checked, stays the fix, beside what the plan's target says
                out.append(
                    dataclasses.replace(
                        f, severity=Severity.WARNING, evidence=evidence,
                        message=f.message + f" The plan's target {m.bound(target)} is met without a change for it; "
                        "its own fix below is checked.",
                    )
                )  # fmt: skip
                continue
            else:
                done = (
                    f" The plan does not need to keep it: the {_noun(m)} stays within the target {m.bound(target)} "
                    "without it."
                )
            if m.decisions:
                done += f" The plan targets {m.describe}; with it, {_worst(search.metric, search.measured[1])}."
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
                        metric=m.title,
                        before=m.figure(the_plan.baseline_error),
                        after=m.figure(the_plan.final_error),
                        on="the inputs given (the worst set)",
                    ),
                )
            )
    return out


def _bare(the_plan: Plan) -> bool:
    """The plan keeps no module and computes no op in fp32: applied, it is the candidate's cast alone."""
    return not the_plan.keep_fp32 and not the_plan.fp32_ops


def _decisions_back(the_plan: Plan, search: Search, f: Finding, evidence: dict[str, Any]) -> Finding:
    """compare's decisions-changed under a plan that gives the decisions back: a warning, checked by
    top-1 agreement on the plan's own runs."""
    before = min((x.top1 for x in search.measured[0] if x.top1 is not None), default=None)
    after = min((x.top1 for x in search.measured[1] if x.top1 is not None), default=None)
    kept = f" ({_names(the_plan.keep_fp32[:4])} in fp32)" if the_plan.keep_fp32 else ""
    return dataclasses.replace(
        f,
        severity=Severity.WARNING,
        message=f.message + f" The plan{kept} gives them back: {_worst(search.metric, search.measured[1])}, verified.",
        evidence=evidence,
        fix=_APPLY,
        trial=Trial.checked(
            "the plan applied" + kept,
            metric="top-1 agreement with fp64",
            before=metric("top1").figure(1.0 - before) if before is not None else None,
            after=metric("top1").figure(1.0 - after) if after is not None else None,
            on="the inputs given (the worst set)",
        ),
    )


def _floor_finding(the_plan: Plan, search: Search) -> Finding:
    _, _, floor, rounding, target, tolerance = max(search.sets, key=lambda s: s[2] / max(s[5], 1e-300))
    cand = the_plan.candidate
    m = search.metric
    amplified = f", {floor / rounding:.2g}x the rounding of the inputs themselves ({rounding:.2g})" if rounding else ""
    if m.decisions:
        moves, off = f"leaves {m.show(floor)}", ""
    else:
        moves, off = f"moves the output by {_fmt(floor)}", f" For you: run in {cand}, this model's output is off by "
        off += (
            f"about {floor:.1%}" if floor >= 1e-3 else f"about {floor:.2g} of its size"
        ) + " whatever stays in fp32."
    return catalog.make(
        "precision-divergence",
        severity=Severity.WARNING,
        title=f"Rounding the inputs to {cand} already costs more than the tolerance",
        message=(
            f"Rounding the inputs to {cand} alone {moves} (the {search.reference} model fed {cand}-rounded inputs, "
            f"against fp64){amplified}"
            # it amplifies the inputs' rounding, or the tolerance is tighter than what that rounding costs
            + (f": the model is ill-conditioned at {cand}." if rounding and floor > rounding else ".")
            + " No keep-in-fp32 plan goes below that "
            f"floor with {cand} inputs, so the tolerance {m.bound(tolerance)} is out of reach and the plan is judged "
            f"against {m.bound(target)} instead.{off}"
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "input-rounding",
            "count": None,
            "numel": None,
            "dtype": cand,
            "floor_rel" if m.name == "rel" else f"floor_{m.name}": floor,
            "input_rounding_rel": rounding,
            "tolerance": tolerance,
            "target": target,
        },
        fix=(
            "if that error matters, give the modules that read the inputs fp32 inputs (keep them in fp32 and do not "
            "cast the inputs, their parameters and buffers in fp32 too: a centring of raw values done before the "
            "cast), or make the model less sensitive to its inputs (a normalisation before what amplifies them); "
            f"otherwise accept the plan judged against {m.bound(target)}"
        ),
        trial=Trial.untried(
            "a change to how the model reads its inputs, which no keep-in-fp32 set can make: the floor itself is "
            "what was measured"
        ),
    )


def _range_cause(search: Search) -> ModuleRow | None:
    """The first module whose own values leave the format's range: not one whose NaN/Inf came in with
    its inputs (an attention's output after its q·kᵀ overflowed inside another module)."""
    for _, compared, *_ in search.sets:
        for r in compared.rows:
            came_in = r.input_error is not None and math.isinf(r.input_error)
            if r.module and (r.out_of_range or (r.nonfinite and not came_in)):
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
        if cand in _RANGE_LIMITED and search.inputs_past_range:
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
    target = _target(the_plan)
    m = search.metric
    without = (
        f"the end-to-end error is {_fmt(max(search.baseline))}" if m.name == "rel" else m.show(max(search.baseline))
    )
    return catalog.make(
        "precision-divergence",
        title=f"No keep-in-fp32 set brings {the_plan.candidate} within the target",
        message=(
            f"Without exceptions {without}; the closest set, {len(the_plan.closest)} module(s) in fp32 "
            f"({_names(the_plan.closest[:6])}), reaches {_val(m, the_plan.final_error)}, short of the target "
            f"{m.bound(target)}. The plan keeps nothing and gives no code."
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
        **_checked_or_next(the_plan, search),
    )


def _checked_or_next(the_plan: Plan, search: Search) -> dict[str, Any]:
    """The unverified plan's fix: compare's checked fix of a divergence where one helped (the same
    fix `compare` prints, with its trial), else the next step to try, untried."""
    for _, compared, *_ in search.sets:
        for f in compared.report.findings:
            trial = f.trial
            if f.name == "precision-divergence" and trial is not None and trial.tried and _helped(trial):
                return {"fix": f"{f.fix} (no module set is the fix: compare's, checked)", "trial": trial}
    return {
        "fix": _next_step(the_plan, search) or _LAST_RESORT,
        "trial": Trial.untried(_NO_PLAN),
    }


def _helped(trial: Trial) -> bool:
    return isinstance(trial.before, float) and isinstance(trial.after, float) and trial.after < trial.before
