"""`fpdoctor.plan(model, inputs, candidate=...)`: the smallest keep-in-fp32 set, verified.

1. compare() ranks modules by isolated error against the noise floor, on every input set.
2. The floor: the reference model fed inputs rounded to the candidate's format. No plan goes
   below it (the kept modules get rounded inputs too), so the plan is judged against the
   tolerance or, where that is out of reach, against FLOOR_MARGIN times the floor - and says so.
3. Greedy: keep the divergent modules in fp32 (worst first), adding the next worst leaves until
   the candidate's final output is finite and within target of the fp64 output on every set.
4. Bisection: drop kept modules again, halves first, while the result stays within target.
5. At the op: a kept module inside which compare found the one op that overflows is replaced by
   that op, and what consumes its result up to the softmax, in fp32 - where that stays within
   target (see op_fixes.py).
6. Verify: run the candidate with the final set; each kept module is checked to be needed.
The plan is data (`Plan`) that `apply_plan(model, plan)` applies in place, plus pasteable code
(plain torch, see codegen.py). A plan that cannot be verified keeps nothing and says what was
reached, what was not, and where to look next (plan_report.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor import progress
from fpdoctor.precision.audit.audit import as_given
from fpdoctor.precision.audit.boundary import cast_inputs_to, keep_in_fp32
from fpdoctor.precision.candidates import (
    cast_inputs,
    check_name,
    compute_dtype,
    copy_module,
    make_run,
    model_device,
    run_flags,
    split_inputs,
    uncompiled,
)
from fpdoctor.precision.compare import built_up, use
from fpdoctor.precision.compare.compare import compare_set
from fpdoctor.precision.compare.noise import ReplayNoise
from fpdoctor.precision.inputs import describe, input_sets, named_tensors
from fpdoctor.precision.metrics import flat_sample, floating, fp8_format, output_format, rel_error
from fpdoctor.precision.names import PLAN_CANDIDATES, PRECISIONS, REFERENCES
from fpdoctor.precision.plan.codegen import fp8_code, plan_code
from fpdoctor.precision.plan.metric import Measured, Metric, check_tolerance, floor_of, logits_of, measure
from fpdoctor.precision.plan.metric import metric as _metric
from fpdoctor.precision.plan.op_fixes import OpFix, edit, install
from fpdoctor.precision.profile import CompareResult
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Finding, Report

# real dtypes (fp16-accumulate's fix is fp16 with the kept modules in fp32); fp8 belongs to the user's recipe
_APPLICABLE = tuple(name for name, p in PRECISIONS.items() if p.applies)

# Within 2x (6 dB) of what rounding the inputs alone costs is as close as this precision gets:
# the kept modules' outputs are rounded once more on the way back, which adds about as much again.
FLOOR_MARGIN = 2.0
# Leave-one-out checks (is each kept module needed?) for plans up to this size; larger ones are
# bisected already, and each check is a forward per input set.
NEEDED_CHECKS = 8
# Judged by the decisions (--metric kl|top1), the search starts from what-ifs: the logits' layer alone
# (fp32 logits), it and the leaf before it (fp32 between them, as compare's decisions fix tries), and
# each of this many modules compare ranks worst alone; one forward per input set each.
WHAT_IF = 4


@dataclass
class Plan:
    candidate: str
    keep_fp32: list[str]
    fp32_outputs: list[str]  # kept modules whose outputs stay fp32: their range does not fit the candidate
    verified: bool
    final_error: float  # the metric with the plan applied (worst set): relative L2 error of the output against
    # fp64 (rel), the share of rows whose top-1 differs from fp64's (top1), mean KL in nats (kl)
    tolerance: float  # what was asked for (or 16x the output's noise floor, to the metric's power)
    baseline_error: float  # the same without any exception
    input_floor: float = 0.0  # the reference fed candidate-rounded inputs: no plan goes below it
    target: float | None = None  # what the plan was judged against: the tolerance, or FLOOR_MARGIN x the floor
    closest: list[str] = field(default_factory=list)  # unverified: the set that came closest
    fp32_ops: list[OpFix] = field(default_factory=list)  # ops (and what consumes them) computed in fp32
    metric: str = "rel"  # what final_error, tolerance, target and the floors measure (metric.py)
    # no set of modules is the fix: the inputs' rounding is the floor's cause, and the report's finding
    # carries the fix (checked there); what it is, as the report says it
    instead: str | None = None

    @property
    def reachable(self) -> bool:
        """Whether the tolerance asked for is above what rounding the inputs alone costs."""
        return self.input_floor <= self.tolerance

    def to_code(self) -> str:
        if self.instead is not None:  # the cast alone would be printed as the plan: it is the broken run
            return (
                f"# no set of modules kept in fp32 is the fix: {self.instead}\n"
                "# apply the fix of the report's first finding (whether it was checked, it says)\n"
            )
        if not self.verified:
            aim = _metric(self.metric).bound(self.target if self.target is not None else self.tolerance)
            return f"# no verified plan: nothing kept in fp32 brings {self.candidate} to {aim} (the report says why)\n"
        if self.candidate not in _APPLICABLE:
            return fp8_code(self.candidate, self.keep_fp32)
        code = plan_code(self.candidate, self.keep_fp32, self.fp32_outputs)
        dtype = str(compute_dtype(self.candidate))
        return code + "".join("\n" + edit(fix, fix.end, dtype) for fix in self.fp32_ops)

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "metric": self.metric,
            "keep_fp32": self.keep_fp32,
            "fp32_outputs": self.fp32_outputs,
            "verified": self.verified,
            "final_error": self.final_error,
            "tolerance": self.tolerance,
            "target": self.target if self.target is not None else self.tolerance,
            "input_floor": self.input_floor,
            "baseline_error": self.baseline_error,
            "closest": self.closest,
            "fp32_ops": [fix.as_dict() for fix in self.fp32_ops],
            "code": self.to_code(),
        }


@dataclass
class PlanResult:
    plan: Plan
    report: Report
    tried: list[tuple[list[str], float]] = field(default_factory=list)


@dataclass
class _Set:
    """One input set as plan judges it."""

    inputs: Any
    compared: CompareResult
    truth: torch.Tensor
    tolerance: float = 0.0
    floor: float = 0.0  # the reference fed candidate-rounded inputs
    input_rounding: float = 0.0  # relative error of rounding the inputs themselves
    target: float = 0.0
    logits: torch.Tensor | None = None  # the fp64 output whole, [rows, classes], where it is logits
    logits_layer: str | None = None  # the leaf that made them
    before_logits: str | None = None  # the leaf whose call ended before it
    rounded: Measured | None = None  # the exact output rounded to the candidate's format
    reference_run: Measured | None = None  # the reference precision's run, where it is not fp64
    input_run: Measured | None = None  # the reference fed candidate-rounded inputs
    features_run: Measured | None = None  # coarse output: the reference whose logits layer is fed rounded features

    def aim(self, m: Metric, tolerance: float | None) -> None:
        """The floor, tolerance and target in the plan's metric (see metric.py)."""
        rows = self.compared.rows
        if m.decisions and self.rounded is not None:
            out_floor = m.value(self.rounded)
            # the format is the limit: the target is for logits kept wider, over what rounding their features and
            # the inputs costs (16x a floor of 20% flips would let every row flip); so where the exact logits pass
            # the format's max (rounded, they are Inf, and 256x that floor no target at all)
            if self.coarse_output or not math.isfinite(out_floor):
                out_floor = self.wider_floor(m)
        else:  # the output's noise floor: compare's figure for rounding it to the candidate
            out_floor = next((r.floor for r in reversed(rows) if r.module == ""), rows[-1].floor)
        if self.reference_run is not None:
            ran = m.value(self.reference_run)
            out_floor = max(out_floor, ran if math.isfinite(ran) else 0.0)
        n = 0 if self.logits is None else self.logits.shape[0]
        self.tolerance = tolerance if tolerance is not None else m.target(out_floor, n)
        self.floor = m.value(self.input_run) if self.input_run is not None else 0.0
        margin = FLOOR_MARGIN**m.power
        self.target = max(self.tolerance, margin * self.floor) if math.isfinite(self.floor) else self.tolerance

    def wider_floor(self, m: Metric) -> float:
        """Where the output's format is too coarse: the floor of logits kept wider, what rounding their
        features (`features_run`) or the inputs (`input_run`) to the candidate costs, the larger."""
        found = [m.value(r) for r in (self.features_run, self.input_run) if r is not None]
        return max([v for v in found if math.isfinite(v)], default=0.0)

    @property
    def coarse_output(self) -> bool:
        """Rounding the exact output to the candidate's format alone flips decisions: compare found the
        format too coarse for them (output-too-coarse), or so many flip that the decisions rule's 16x of
        them would let half the rows flip. No target can be read from that format's floor."""
        if self.logits is None or self.rounded is None or self.rounded.top1 is None:
            return False
        if self.compared.report.by_name("output-too-coarse"):
            return True
        return use.DECISION_RATIO * (1.0 - self.rounded.top1) >= 0.5

    def decided(self, run: Measured) -> bool:
        """The run's top-1 is one compare would not call changed (use.Decisions.changed); where the
        output's format is the limit, judged over what rounding the inputs costs, as a top-1 plan is."""
        if self.logits is None or self.rounded is None:
            return False
        top1 = _metric("top1")
        floor = self.wider_floor(top1) if self.coarse_output else top1.value(self.rounded)
        return top1.value(run) <= top1.target(floor, self.logits.shape[0])


class _Values(list[float]):
    """A run's metric per input set, and whether it kept every set's decisions (KL plans)."""

    decided: bool = True


def _candidate_with(
    model: nn.Module, candidate: str, keep: list[str], fp32_outputs: set[str], fp8_kernel: str = "auto"
) -> nn.Module:
    run = make_run(model, candidate, fp8_kernel)
    dtype = compute_dtype(candidate)
    modules = dict(model.named_modules())
    for name in keep:
        fp32_module = copy_module(modules[name]).float()  # the original module, not a simulated one
        parent, _, child = name.rpartition(".")
        holder = run.get_submodule(parent) if parent else run
        setattr(holder, child, keep_in_fp32(fp32_module, back_to=None if name in fp32_outputs else dtype))
    return run


def _replaying(noise: list[torch.Tensor] | None) -> contextlib.AbstractContextManager[Any]:
    """The random draws compare recorded, replayed from the first (see noise.py); nothing without."""
    return ReplayNoise(noise) if noise is not None else contextlib.nullcontext()


def _measured(
    model: nn.Module,
    inputs: Any,
    candidate: str,
    keep: list[str],
    *,
    fp32_outputs: set[str],
    truth: torch.Tensor,
    logits: torch.Tensor | None = None,
    fp8_kernel: str = "auto",
    noise: list[torch.Tensor] | None = None,
    ops: list[OpFix] | None = None,
    ends: dict[str, str] | None = None,
) -> Measured:
    """The output with `keep` in fp32 and the `ops` fixes in place, against fp64 (`truth`, its sample;
    `logits`, whole, where the output is logits); `ends` receives where each op fix's fp32 region
    ended (file:line)."""
    run = _candidate_with(model, candidate, keep, fp32_outputs, fp8_kernel).eval()
    mode = install(run, ops, compute_dtype(candidate)) if ops else None
    args, kwargs = split_inputs(cast_inputs(inputs, compute_dtype(candidate), copy=True))
    try:
        with torch.no_grad(), _replaying(noise):
            output = run(*args, **kwargs)
    except RuntimeError:  # an fp32 output reached a module still in the candidate dtype
        return Measured(math.inf)
    if mode is not None and ends is not None:
        ends.update({k: v for k, v in mode.ends.items() if v is not None})
    return measure(output, truth, logits)


def _end_to_end(s: _Set) -> float:
    """The candidate's end-to-end error on the set as compare measured it (its root row's)."""
    return next((r.propagated for r in s.compared.rows if r.module == ""), 0.0)


def plan(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str = "fp16",
    reference: str = "fp32",
    tolerance: float | None = None,
    fp8_kernel: str = "auto",
    metric: str | None = None,
    decisions: str | None = None,
) -> PlanResult:
    """Find and verify the smallest set of modules to keep in fp32 for `candidate`.

    `inputs`: one input set (a tensor, a tuple of positional arguments, a dict of keyword
    arguments) or a list of them (or any iterable): the plan must hold on every set.
    `metric`: what the plan targets and ranks its what-ifs by: "kl" (KL of the logits' softmax
    against fp64's), "top1" (top-1 agreement with fp64) or "rel" (relative error of the output).
    Default: "kl" where the output is logits whose decisions compare finds changed (the relative
    error misses them there; KL is continuous, so it ranks modules that leave the same number of
    flips apart, and reads the whole distribution that sampling and the loss read; top-1 is measured
    beside it), "top1" there for an fp8 candidate (its logits are returned in fp32: their KL floor is
    ~0); "rel" otherwise, and whenever a tolerance is given without a metric. "kl" and
    "top1" need an output of logits.
    `tolerance`: the value to reach in the metric's units (relative error; KL in nats; for top1 the
    share of rows whose top-1 may differ); default 16x the output's floor (256x for KL, which grows
    with the error's square; compare's decisions-changed rule for top1). One below what rounding
    the inputs alone costs is out of reach, and the report says so.
    `fp8_kernel`: how fp8 candidates multiply, as in compare(); `decisions="argmax"`: the output's scores
    decide by their argmax, as in compare() (then the metrics of logits apply)."""
    candidate = check_name(candidate, PLAN_CANDIDATES, "candidate")
    reference = check_name(reference, REFERENCES, "reference")
    if metric is not None:
        check_tolerance(_metric(metric), tolerance)
    elif tolerance is not None and not tolerance > 0:
        raise ValueError(f"tolerance must be a positive value in the plan's metric, e.g. 1e-3, got {tolerance!r}")
    model = uncompiled(model)  # module names as compare reports them
    sets = input_sets(inputs)
    rng = RngState.capture()  # every run starts from it, as compare's passes do; the user's is left as it was
    try:
        with progress.task(f"plan {candidate}: compare against fp64", unit="runs") as runs:
            return _plan(
                model,
                sets,
                candidate=candidate,
                reference=reference,
                tolerance=tolerance,
                fp8_kernel=fp8_kernel,
                metric=metric,
                rng=rng,
                runs=runs,
                decisions=decisions,
            )
    finally:
        rng.restore()


def _plan(
    model: nn.Module,
    sets: list[Any],
    *,
    candidate: str,
    reference: str,
    tolerance: float | None,
    fp8_kernel: str,
    metric: str | None,
    rng: RngState,
    runs: progress.Task,
    decisions: str | None = None,
) -> PlanResult:
    """compare on every input set, then the search; `runs` says which stage runs and counts the
    forward passes of the candidate with a set kept in fp32."""
    from fpdoctor.precision.plan.plan_report import Search, build

    given: tuple[list[Finding], str | None] = as_given(model, sets[0])
    device = model_device(model)
    judged: list[_Set] = []
    for k, one in enumerate(sets):
        if len(sets) > 1:
            runs.describe(f"plan {candidate}: compare against fp64, input set {k + 1} of {len(sets)}")
        judged.append(
            _judge_set(
                model,
                one,
                candidate=candidate,
                reference=reference,
                fp8_kernel=fp8_kernel,
                rng=rng,
                device=device,
                decisions=decisions,
            )
        )
    for s in judged:  # a candidate that does not run has nothing to plan: its line first
        failed = next((f for f in s.compared.report.findings if f.evidence.get("kind") == "candidate-failed"), None)
        if failed is not None:
            at = failed.evidence.get("location")
            raise ValueError(
                f"the model does not run in {candidate} ({failed.evidence.get('error')}"
                + (f", at {at}" if at else "")
                + f"): {failed.fix}, then plan; `fpdoctor compare --candidate {candidate}` names each such line"
            )
    logits = all(s.logits is not None for s in judged)
    if metric is not None and metric != "rel" and not logits:
        raise ValueError(
            f"metric {metric!r} judges an output of logits, and this model's output is not logits (its last call is "
            "not a Linear from features to classes, or the fp64 output is not finite): use the metric rel"
        )
    # the default: KL where compare finds the logits' decisions changed far beyond rounding's floor (the
    # relative error misses them there); the relative error elsewhere, where the two agree, and where the
    # structural test for logits cannot tell them from a regression head of the same shape. Logits the candidate
    # makes non-finite changed their decisions too (compare leaves those to its non-finite findings): their
    # relative error is no measure, and the sets that make them finite are told apart by their KL.
    changed = (
        logits
        and tolerance is None
        and any(s.compared.report.by_name("decisions-changed") or not math.isfinite(_end_to_end(s)) for s in judged)
    )
    # an fp8 candidate returns its logits in fp32: their KL floor is ~0, and 256x it no target;
    # compare's decisions rule (top1), with its floor of one row, is
    default = ("top1" if fp8_format(candidate) is not None else "kl") if changed else "rel"
    m = _metric(metric if metric is not None else default)
    for s in judged:
        s.aim(m, tolerance)
    # Modules whose fp64 output does not fit the candidate's range keep fp32 outputs when kept.
    fp32_outputs = {r.module for s in judged for r in s.compared.rows if r.out_of_range and r.module}
    tried: list[tuple[list[str], float]] = []
    measured: dict[tuple[str, ...], list[Measured]] = {}  # every run, every way, by what it kept

    def errors(
        keep: list[str],
        ops: list[OpFix] | None = None,
        ends: dict[str, str] | None = None,
        outputs: set[str] | None = None,
    ) -> list[float]:
        got = []
        for s in judged:
            rng.restore()
            with run_flags(candidate, device):  # the backend flags compare ran the candidate under
                got.append(
                    _measured(
                        model,
                        s.inputs,
                        candidate,
                        keep,
                        fp32_outputs=fp32_outputs if outputs is None else outputs,
                        truth=s.truth,
                        logits=s.logits,
                        fp8_kernel=fp8_kernel,
                        noise=s.compared.noise,
                        ops=ops,
                        ends=ends,
                    )
                )
            runs.advance()
        values = _Values(m.value(x) for x in got)
        # a KL within its target can still flip decisions where the logits are large (a temperature near 0: 256x
        # a large floor is no bound): a plan under KL also keeps every set's top-1 within compare's rule
        values.decided = m.name != "kl" or all(
            s.decided(x) for x, s in zip(got, judged, strict=True) if s.logits is not None
        )
        key = (*keep, *(f"{f.module}:{f.op}" for f in ops or []))
        measured[key] = got
        tried.append((list(key), max(values)))
        return values

    def ok(values: list[float]) -> bool:
        within = all(math.isfinite(v) and v <= s.target for v, s in zip(values, judged, strict=True))
        return within and getattr(values, "decided", True)

    def excess(values: list[float]) -> float:
        """How far the worst set is above its target (<= 1 within it)."""
        return max(v / s.target if s.target > 0 else math.inf for v, s in zip(values, judged, strict=True))

    runs.describe(f"plan {candidate}: the candidate as it is")
    baseline = errors([])
    ranked = built_up.ranked(r for s in judged for r in s.compared.rows)
    units: list[tuple[list[str], set[str]]] = [([module], set()) for module in ranked]
    what_if: list[tuple[list[str], list[float]]] = []
    if m.decisions and not ok(baseline):  # the what-ifs, ranked by the metric, lead the greedy search
        head, before = judged[0].logits_layer, judged[0].before_logits
        trials = [([head], {head})] if head else []
        trials += [([name], set()) for name in ranked[:WHAT_IF] if name != head]
        if head and before:
            trials.append(([before, head], {before, head}))
        for mods, outs in trials:
            runs.describe(f"plan {candidate}: what-if, {' and '.join(mods)} alone in fp32")
            what_if.append((mods, errors(mods, outputs=fp32_outputs | outs)))
        what_if.sort(key=lambda t: excess(t[1]))
        order = {tuple(mods): outs for mods, outs in trials}
        helped = [(mods, order[tuple(mods)]) for mods, v in what_if if excess(v) < excess(baseline)]
        units = helped + units
    # compare's divergence fix that kept a module with the leaf before it, fp32 between them (what the module
    # reads was lost in the candidate's format before it computed), checked: the first unit tried
    pairs = [
        (list(f.evidence["kept_fp32"]), {f.evidence["fp32_between"]})
        for s in judged
        for f in s.compared.report.by_name("precision-divergence")
        if f.evidence.get("fp32_between") and f.trial is not None and f.trial.tried
    ]
    units = pairs[:1] + units
    keep: list[str] = []
    current = baseline
    best: tuple[float, list[str], list[float]] = (excess(baseline), [], baseline)
    # the output's format too coarse for what it holds (compare's output-too-coarse, its fix checked): no
    # target set from the floor of that format sees it, so the plan starts from the layer kept in fp32,
    # returning fp32, that the check ran
    coarse = [
        f.where["module"]
        for s in judged
        for f in s.compared.report.by_name("output-too-coarse")
        if f.where.get("module") and f.trial is not None and f.trial.tried
    ]
    if coarse:
        keep, fp32_outputs = [coarse[0]], fp32_outputs | {coarse[0]}
        runs.describe(f"plan {candidate}: {coarse[0]} in fp32, returning fp32 (its output's format is too coarse)")
        current = errors(keep)
        best = (excess(current), list(keep), current)
    if not ok(current):
        for mods, outs in units:  # greedy: the what-ifs that help most, then the worst modules first
            new = [x for x in mods if x not in keep and not any(x.startswith(k + ".") for k in keep)]
            if not new:
                continue
            keep += new
            fp32_outputs |= outs
            runs.describe(f"plan {candidate}: keep in fp32, worst first: {len(keep)} module(s), the last {new[-1]}")
            current = errors(keep)
            if excess(current) < best[0]:
                best = (excess(current), list(keep), current)
            if ok(current):
                break
    if ok(current) and len(keep) > 1:  # bisection: drop what is not needed, halves first
        chunk = len(keep) // 2
        while chunk >= 1:
            runs.describe(f"plan {candidate}: drop what is not needed, {chunk} of the {len(keep)} kept at a time")
            i = 0
            while i < len(keep):
                trial = keep[:i] + keep[i + chunk :]
                values = errors(trial)
                if ok(values):
                    keep, current = trial, values
                else:
                    i += chunk
            chunk //= 2
    runs.describe(f"plan {candidate}: verify {len(keep)} module(s) in fp32")
    verified_errors = errors(keep) if ok(current) else best[2]
    verified = ok(verified_errors)
    ops: list[OpFix] = []
    by_op: dict[str, tuple[float, float]] = {}  # module -> (error keeping it whole, with only its op in fp32)
    if verified and candidate in _APPLICABLE:
        # a kept module where compare found the one op that overflows: that op alone, and what
        # consumes it up to the softmax, in fp32 instead of the whole module
        for fix in _op_fixes(judged, keep):
            runs.describe(f"plan {candidate}: {fix.op} alone in fp32 instead of {fix.module}")
            ends: dict[str, str] = {}
            trial_keep = [k for k in keep if k != fix.module]
            values = errors(trial_keep, [*ops, fix], ends)
            if ok(values):
                by_op[fix.module] = (max(verified_errors), max(values))
                keep, verified_errors = trial_keep, values
                ops.append(dataclasses.replace(fix, end=ends.get(fix.module)))
    needed: dict[str, float] = {}
    effects: dict[str, tuple[float, float]] = {}  # module -> (mean effect, the spread it is weighed against)
    dropped: dict[str, tuple[float, float]] = {}
    if verified and len(keep) <= NEEDED_CHECKS:
        spread = _spread(verified_errors)
        for name in list(keep):  # why each kept module is there: the error without it, on every set
            runs.describe(f"plan {candidate}: is {name} needed?")
            without = errors([k for k in keep if k != name], ops)
            needed[name] = max(without)
            if spread is None:
                continue  # one input set: no spread to weigh the effect against (the report says so)
            # by factors: input sets of other sizes have errors of other sizes
            effect = statistics.fmean(
                math.inf if not math.isfinite(w) else math.log(max(w, 1e-300) / v)
                for w, v in zip(without, verified_errors, strict=True)
            )
            effects[name] = (effect, spread)
            if effect <= spread:  # within what the end-to-end error varies by from one input set to the next
                dropped[name] = effects.pop(name)
                keep = [k for k in keep if k != name]
        if dropped:
            runs.describe(f"plan {candidate}: verify {len(keep)} module(s) in fp32")
            verified_errors = errors(keep, ops)
            # a target missed by no more than the spread is missed by noise, not by what was dropped
            verified = all(
                math.isfinite(v) and v <= s.target * math.exp(spread or 0.0)
                for v, s in zip(verified_errors, judged, strict=True)
            )
    # the set the problem shows most on (its table and findings lead the report), and the set the
    # plan comes closest to its target on (its numbers are the plan's)
    worst = max(range(len(judged)), key=lambda k: (baseline[k] / max(judged[k].target, 1e-300), baseline[k]))
    tightest = max(range(len(judged)), key=lambda k: verified_errors[k] / max(judged[k].target, 1e-300))
    final_key = (*keep, *(f"{f.module}:{f.op}" for f in ops)) if verified else tuple(best[1])
    the_plan = Plan(
        candidate,
        keep if verified else [],
        [k for k in keep if k in fp32_outputs] if verified else [],
        verified,
        verified_errors[tightest],
        judged[tightest].tolerance,
        max(baseline),
        input_floor=judged[tightest].floor,
        target=judged[tightest].target,
        closest=[] if verified else best[1],
        fp32_ops=ops,
        metric=m.name,
    )
    search = Search(
        sets=[(describe(s.inputs), s.compared, s.floor, s.input_rounding, s.target, s.tolerance) for s in judged],
        baseline=baseline,
        final=verified_errors,
        worst=worst,
        needed=needed,
        given=given,
        reference=reference,
        tolerance_asked=tolerance,
        by_op=by_op,
        effects=effects,
        dropped=dropped,
        metric=m,
        what_if=[(mods, max(v)) for mods, v in what_if],
        measured=(measured.get((), []), measured.get(final_key, [])),
        metric_asked=metric is not None,
        head=judged[0].logits_layer if m.decisions else None,
        the_plan_outputs=[k for k in keep if k in fp32_outputs] if m.decisions else [],
        coarse_output=m.decisions and any(s.coarse_output for s in judged),
        inputs_past_range=any(_past_range(s.inputs, candidate) for s in judged),
        decisions_back=m.decisions
        and verified
        and all(s.decided(x) for s, x in zip(judged, measured.get(final_key, []), strict=True)),
    )
    return PlanResult(the_plan, build(the_plan, search), tried)


def _spread(errors: list[float]) -> float | None:
    """The run-to-run spread of the end-to-end error over the input sets: the standard deviation
    of its logarithm (a factor, as effects are weighed); None for one set, or an error that is
    zero or non-finite."""
    if len(errors) < 2 or not all(math.isfinite(e) and e > 0 for e in errors):
        return None
    return statistics.stdev(math.log(e) for e in errors)


def _judge_set(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str,
    reference: str,
    fp8_kernel: str,
    rng: RngState,
    device: torch.device,
    decisions: str | None = None,
) -> _Set:
    """compare on one input set, its fp64 output and what its floors measure (the target comes with
    the metric: _Set.aim)."""
    compared = compare_set(
        model, inputs, candidate=candidate, reference=reference, fp8_kernel=fp8_kernel, decisions=decisions
    )
    truth_run = make_run(model, "fp64").eval()
    args, kwargs = split_inputs(cast_inputs(inputs, torch.float64, copy=True))
    leaves = {n: m for n, m in truth_run.named_modules() if not list(m.children())}
    ended: list[str] = []  # the leaves in the order their calls end: the last made the output, as compare says

    def end(name: str, args: tuple[Any, ...], out: Any) -> None:
        if not any(a is out for a in args):  # an identity in this mode (Dropout in eval): nothing made, as compare
            ended.append(name)

    hooks = [m.register_forward_hook(lambda _, a, o, n=n: end(n, a, o)) for n, m in leaves.items()]
    rng.restore()
    try:
        with torch.no_grad(), run_flags(candidate, device), _replaying(compared.noise):  # module by module
            output = truth_run(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    truth = flat_sample(output)
    if truth is None:
        raise ValueError(
            "the model's output has no floating tensor to judge (ids a decoding loop made?): plan keeps modules "
            "by an error of floating outputs; give it a make() that returns the logits over a fixed sequence "
            "(teacher-forced, one forward), and run `fpdoctor compare` on this one to judge its ids by agreement"
        )
    head = ended[-1] if ended else None
    first = next(floating(output), None)
    ids = use.reads_ids(inputs)
    # an output declared to decide nothing (decisions="none": a regression from a Linear head) is no logits
    made_by_head = (
        decisions != "none" and head is not None and use.logits_source(head, leaves[head], first, ids=ids) is not None
    )
    is_logits = made_by_head
    # compare's own test of what the output decides, which plan's metrics then judge: scores against a
    # class table (prototypes, a cosine head), logits divided by a temperature (not probabilities)
    decided = compared.report.data.get("decisions")
    is_logits = is_logits or (decided is not None and not str(decided.get("source", "")).startswith("probabilities"))
    one = _Set(inputs, compared, truth, logits=logits_of(output) if is_logits else None)
    del output, truth_run
    # the layer that makes them, where one does (scores against a table are the model's own ops')
    one.logits_layer = head if made_by_head else None
    one.before_logits = ended[-2] if made_by_head and len(ended) > 1 else None
    logits = one.logits
    if logits is not None and bool(torch.isfinite(logits).all()):
        one.rounded = floor_of(logits, output_format(candidate))  # compare's floor
    else:
        one.logits = None

    def reference_on(given: Any) -> Any:
        """The reference model, nothing kept, on `given` inputs: measured as every run of the plan is."""
        rng.restore()
        with run_flags(reference, device):
            return _measured(
                model,
                given,
                reference,
                [],
                fp32_outputs=set(),
                truth=truth,
                logits=one.logits,
                noise=compared.noise,
            )

    if reference != "fp64":  # the reference's own end-to-end error: part of the output's floor
        one.reference_run = reference_on(inputs)
    cand_dtype = compute_dtype(candidate)
    rounded = cast_inputs(inputs, cand_dtype)
    before, after = flat_sample(inputs), flat_sample(rounded)
    if before is not None and after is not None:
        one.input_rounding = rel_error(after, before)
    if one.input_rounding > 0:
        # the reference model fed the inputs the candidate gets: what no keep-in-fp32 set can undo
        one.input_run = reference_on(rounded)
    if one.coarse_output and one.logits_layer is not None:
        # the format of the output is the limit, and a plan keeps the logits wider: the least it can reach with
        # the rest in the candidate is the exact layer fed features rounded to that format (compare's floor,
        # one layer down)
        def round_features(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(
                a.to(cand_dtype).to(a.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                for a in args
            )

        handle = model.get_submodule(one.logits_layer).register_forward_pre_hook(round_features)
        try:
            one.features_run = reference_on(inputs)
        finally:
            handle.remove()
    return one


def _op_fixes(judged: list[_Set], keep: list[str]) -> list[OpFix]:
    """For each kept module, the op inside it compare found overflowing (on any input set)."""
    fixes = []
    for name in keep:
        found = next((s.compared.overflows[name] for s in judged if name in s.compared.overflows), None)
        if found is not None and "index" in found:
            fixes.append(OpFix(name, found["op"], found["index"], found.get("location")))
    return fixes


def apply_plan(model: nn.Module, the_plan: Plan) -> nn.Module:
    """Put `model` in the plan's dtype, with its modules kept in fp32 behind boundary casts, and
    its floating inputs cast to that dtype on the way in, so it takes the inputs you have (in place;
    each kept module is replaced by an fp32 copy of itself, as the plan checked it: a reference to the
    module taken before, an optimizer's included, holds the old one, and a weight it tied with a
    module left in the dtype is two weights from here on; for serving, not for training)."""
    if the_plan.candidate not in _APPLICABLE:
        raise ValueError(
            f"{the_plan.candidate} ran in fpdoctor's own fp8 layers; apply the plan in your fp8 recipe "
            "instead (Plan.to_code() shows a module filter)"
        )
    if the_plan.instead is not None:
        raise ValueError(
            f"no set of modules kept in fp32 is the fix ({the_plan.instead}): apply the fix of the plan report's "
            "first finding"
        )
    if not the_plan.verified:
        raise ValueError(
            f"this plan is not verified: no keep-in-fp32 set brought {the_plan.candidate} within "
            f"{the_plan.target if the_plan.target is not None else the_plan.tolerance:.3g} of fp64; "
            "its report says what was reached and where to look next"
        )
    dtype = compute_dtype(the_plan.candidate)
    inner = uncompiled(model)  # the plan names modules inside a torch.compile wrapper
    # the kept modules as the plan checked them: copies made before the cast, with fp32 weights of their
    # own (not rounded through `dtype`; a weight tied to a module left in `dtype` stays with that one)
    kept = {n: copy_module(inner.get_submodule(n)) for n in the_plan.keep_fp32}
    inner.to(dtype)
    cast_inputs_to(inner, dtype)
    for name in the_plan.keep_fp32:
        parent, _, child = name.rpartition(".")
        holder = inner.get_submodule(parent) if parent else inner
        setattr(holder, child, keep_in_fp32(kept[name], back_to=None if name in the_plan.fp32_outputs else dtype))
    if the_plan.fp32_ops:
        install(inner, the_plan.fp32_ops, dtype)
    return model


def _past_range(inputs: Any, candidate: str) -> bool:
    """An input tensor holds a finite value past the candidate's largest: it is Inf before the first module."""
    dtype = compute_dtype(candidate)
    if not dtype.is_floating_point:
        return False
    limit = torch.finfo(dtype).max
    return any(
        bool((t.detach().abs() > limit).logical_and(t.detach().isfinite()).any())
        for _, t in named_tensors(inputs)
        if t.is_floating_point() and torch.finfo(t.dtype).max > limit
    )
