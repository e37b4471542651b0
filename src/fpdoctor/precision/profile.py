"""The per-module error profile of a compare run: rows, the divergence verdict, the report."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.formats import DTYPE_FORMAT, FORMATS
from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.decide import pct
from fpdoctor.precision.fit import describe as describe_misfit
from fpdoctor.precision.fit import negligible, within
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import SAMPLE, sqnr_db
from fpdoctor.precision.units import plain_fp32
from fpdoctor.report.model import Finding, Report, Severity, Trial
from fpdoctor.report.render import ordinal

# The one metric behind every "error" compare and plan print, the end-to-end error included.
METRIC = (
    "relative L2 error against the fp64 run, ||candidate - fp64|| / ||fp64||, over an evenly strided sample of "
    f"the output (every k-th value, at most {SAMPLE}); SQNR = -20 log10 of it; the end-to-end error is this for "
    "the model's output"
)
# What compare keeps as the floor where none was measured (rounding the fp64 output overflows the
# format, no reference error): any error is above it; renderings say "unknown", never this value.
UNKNOWN_FLOOR = 1e-300
# 16x the floor is 12 dB: input and output rounding plus fp32 accumulation stay below it on every
# healthy layer we measured (MiniLM in fp16 and bf16), accumulation loss and overflow do not.
DIVERGENCE_RATIO = 16.0
# A row says why when its propagated error moves 10 dB (3.2x) or more against what feeds it (its
# inputs' error, its submodules'): on healthy layers each module stays within a few dB of its
# inputs' error (MiniLM, the test MLPs), and a move that large is what a reader stops at.
MOVES = 10 ** (10 / 20)
# a divergent module whose model's end-to-end error stays within this of its floor is a warning: what follows it
# absorbs its error, and the output is where rounding puts it
ABSORBED = 2.0


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
        return math.inf if math.isinf(self.isolated) else self.isolated / max(self.judged_floor, UNKNOWN_FLOOR)

    @property
    def judged_floor(self) -> float:
        """The floor the isolated error is judged against: a container's worst own op's, else the output's."""
        return self.floor if self.isolated_floor is None else self.isolated_floor

    # Containers are judged on their own ops, never on what their submodules add, so compare no
    # longer sets this; plan and older reports read it.
    inherited: bool = False
    isolated_of: int | None = None  # the rows isolated_rows were taken from
    isolated_floor: float | None = None  # a container's: the floor of its worst own op
    own: dict[str, Any] | None = None  # a container's own ops (container_ops.Own.as_dict): worst op, where, how many
    whole_isolated: float | None = None  # a container re-run whole on the fp64 inputs, where compare did
    input_error: float | None = None  # the candidate's error at this module's inputs (their samples)
    rms: float | None = None  # of the fp64 output (its sample)
    values: tuple[int, int, int] | None = None  # the propagated sample: (values, of the output's, every k-th)
    missing: str | None = None  # why a leaf has no isolated figure
    single: bool = True  # its output is one tensor (a printed `.to(x.dtype)` applies), not a tuple or a dict
    weighted: bool = True  # it holds floating parameters (a printed fix keeps them and casts its input to them)
    # Why a container's own op, above its floor when run alone in the candidate's dtype, is not
    # called a divergence: the candidate's run of the container as its code is written does not
    # show it (code that upcasts the op, or computes it in another form, when the model is fp16).
    unconfirmed: str | None = None
    # what its own parameters lose in the candidate's format, measured (an fp8 weight whose outliers set its
    # scale): where its error moves against its inputs', this is why, not their error amplified
    own_loss: str | None = None
    notes: list[tuple[str, str]] = field(default_factory=list)  # (for the table, in full), from annotate()
    reasons: list[tuple[str, str]] = field(default_factory=list)  # those of the notes that say why a figure moves

    def elements(self) -> dict[str, str]:
        """What each figure was computed on, in words."""
        out = {"propagated": _values_text(self.values) if self.values else "not sampled"}
        own = self.own
        if own is not None and own.get("op"):
            rows = own.get("rows")
            where = f", {rows[0]} of {rows[1]} rows" if rows else ""
            left = f"; {own['left_out']} sampled values beyond its range left out" if own.get("left_out") else ""
            out["isolated"] = (
                f"op {own['op']}'s output{where}: {_values_text(own['values'])}{left}, the op run in {own['dtype']} "
                f"({own['judged']} own op(s) judged, this one the worst)"
            )
        elif own is not None:
            out["isolated"] = _own_missing(own)[1]
        elif self.isolated_rows is not None:
            of = f" of {self.isolated_of}" if self.isolated_of else ""
            out["isolated"] = f"{self.isolated_rows}{of} rows, evenly spread, all their values"
        elif self.isolated is not None:
            out["isolated"] = "all rows: " + (_values_text(self.values) if self.values else "the whole output")
        else:
            out["isolated"] = f"not measured: {self.missing}" if self.missing else "not measured"
        return out

    @property
    def exceeds(self) -> bool:
        return self.ratio is not None and (math.isinf(self.ratio) or self.ratio > DIVERGENCE_RATIO)

    @property
    def diverged(self) -> bool:
        return self.exceeds and not self.inherited and self.unconfirmed is None

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
            "floor_rel": self.judged_floor if known(self.judged_floor) else None,  # None: unknown
            "reference_rel": self.reference,
            "ratio": self.ratio if known(self.judged_floor) or self.ratio is None or math.isinf(self.ratio) else None,
            "diverged": self.diverged,
            "inherited": self.inherited,
            "nonfinite": self.nonfinite,
            "out_of_range": self.out_of_range,
            "output_floor_rel": self.floor if known(self.floor) else None,
            "input_error_rel": self.input_error,
            "isolated_of_rows": self.isolated_of,
            "own_ops": self.own,
            "whole_isolated_rel": self.whole_isolated,
            "elements": self.elements(),
            "note": "; ".join(short for short, _ in self.notes) or None,
            "why": [full for _, full in self.notes],
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


def children(rows: list[ModuleRow], name: str, call: int, *, at: int | None = None) -> list[ModuleRow]:
    """Rows of `name`'s descendants from this call: in post-order they come right before it. `at`: the
    call's own index in `rows`, where the caller knows it (a loop over rows: no search per row, which
    is quadratic in a model of 80,000 module calls)."""
    position = at if at is not None else next(
        (k for k, r in enumerate(rows) if r.module == name and r.call == call), len(rows)
    )  # fmt: skip
    prefix = f"{name}." if name else ""
    found = []
    for k in range(position - 1, -1, -1):
        row = rows[k]
        if not row.module.startswith(prefix) or row.module == name:
            break
        found.append(row)
    return found


def annotate(rows: list[ModuleRow]) -> None:
    """Each row's notes: what its isolated figure was computed on where that is not the whole
    output, why a figure is missing, and why its propagated error moves by MOVES or more against
    its inputs' error or its submodules' - each from quantities measured, never a guessed cause."""
    for k, row in enumerate(rows):
        notes: list[tuple[str, str]] = []
        own = row.own
        if own is not None and own.get("op"):
            at = f" ({own['location']})" if own.get("location") else ""
            notes.append((f"op {_short_op(own['op'])}", f"isolated: its worst own op, {own['op']}{at}"))
            if own.get("failed"):
                notes.append(("ops not run", "isolated: these own ops were not judged: " + "; ".join(own["failed"])))
        elif own is not None:
            notes.append(_own_missing(own))
        elif row.isolated is None:
            notes.append(("not measured", f"isolated: {row.missing or 'not measured'}"))
        if row.unconfirmed is not None:
            notes.append(("not in its run", f"isolated: {row.unconfirmed}"))
        came_in = row.input_error is not None and math.isinf(row.input_error) and math.isinf(row.propagated)
        if came_in:
            notes.insert(0, ("Inf/NaN came in", "non-finite: its inputs already hold NaN/Inf in the candidate's run"))
        row.reasons = [] if came_in else _moves(rows, k)
        row.notes = row.reasons + notes


def _moves(rows: list[ModuleRow], k: int) -> list[tuple[str, str]]:
    """Why the propagated error moves against what feeds this row, if it does."""
    row = rows[k]
    error, inputs = row.propagated, row.input_error
    inside = _direct(rows, k)
    if math.isinf(error):
        # the first module inside it, in the order they ran, to output NaN/Inf from inputs that were not
        started = [
            r
            for r in children(rows, row.module, row.call, at=k)[::-1]
            if math.isinf(r.propagated) and not (r.input_error is not None and math.isinf(r.input_error))
        ]
        if started:
            name = started[0].module or "<root>"
            fed = " from finite inputs" if started[0].input_error is not None else ""
            return [(f"Inf/NaN: {name}", f"non-finite: first at `{name}` inside it, which outputs NaN/Inf{fed}")]
        if not row.exceeds and row.isolated is not None and inputs is not None:
            return [
                (
                    "Inf/NaN, not alone",
                    f"non-finite in the candidate's run from finite inputs (their error {_fmt(inputs)}), yet finite "
                    f"when re-run alone on the fp64 inputs (isolated {_fmt(row.isolated)}, "
                    f"{_ratio_text(row)})",
                )
            ]
        return []
    if row.exceeds or inputs is None or math.isinf(inputs):
        return []  # a diverging row's verdict explains its figure
    finite = [r for r in inside if math.isfinite(r.propagated)]
    top = max(finite, key=lambda r: r.propagated, default=None)
    if top is not None and error * MOVES < top.propagated:
        share = top.rms / row.rms if top.rms and row.rms else None
        ops = [op for op in (row.own or {}).get("ops", []) if op.startswith(("aten.add", "aten.sub"))]
        drop = top.propagated / max(error, 1e-300)
        full = (
            f"its output error {_fmt(error)} is {drop:.3g}x below that of `{top.module}` inside it "
            f"({_fmt(top.propagated)})"
            + (f": `{top.module}`'s output has {share:.3g}x the RMS of this module's output" if share else "")
            + (f"; its own ops include {', '.join(ops)}" if ops else "")
        )
        return [(f"diluted /{drop:.2g}", full)]
    base = max(inputs, top.propagated if top is not None else 0.0)
    if inputs <= 0 or error <= MOVES * max(base, row.floor):
        return []
    if row.own_loss is not None:
        return [
            (
                "its weight",
                f"its own weight: {row.own_loss}; output error {_fmt(error)} against input error {_fmt(inputs)}, "
                f"{_ratio_text(row)} alone on the fp64 inputs",
            )
        ]
    gain = error / base
    judged = (
        f"alone on the fp64 inputs {'its worst own op' if not row.leaf else 'it'} stays within {_ratio_text(row)}"
        if row.ratio is not None
        else f"its isolated error was not measured ({row.elements()['isolated']})"
    )
    fed = f"input error {_fmt(inputs)}"
    if top is not None:
        fed += f", its submodules' at most {_fmt(top.propagated)} (`{top.module}`)"
    return [
        (
            f"amplified x{gain:.2g}" if row.ratio is not None else f"x{gain:.2g} input error",
            f"amplified from its inputs: {fed}, output error {_fmt(error)} (gain {gain:.3g}); {judged}",
        )
    ]


def _moved_by(row: ModuleRow) -> float:
    """How far a row's error moved against what feeds it, in either direction (for ranking)."""
    fed = max(row.input_error or 0.0, row.floor)
    if math.isinf(row.propagated):
        return math.inf
    return max(row.propagated / fed, fed / max(row.propagated, 1e-300))


def _direct(rows: list[ModuleRow], k: int) -> list[ModuleRow]:
    """The rows of this call's direct submodules (those not inside another submodule's row)."""
    inside = children(rows, rows[k].module, rows[k].call, at=k)
    names = {r.module for r in inside}
    return [r for r in inside if not any(r.module.startswith(f"{n}.") for n in names if n != r.module)]


def _ratio_text(row: ModuleRow, *, short: bool = False) -> str:
    """A row's isolated error / floor for a message or the table: never a ratio to an unknown floor."""
    if row.ratio is None:
        return "-" if short else "its isolated error was not measured"
    if math.isinf(row.ratio):
        return "non-finite" if short else "non-finite alone"
    if not known(row.judged_floor):
        return "floor unknown" if short else "its floor unknown"
    return f"{row.ratio:.2g}x" if short else f"{row.ratio:.2g}x its floor"


def _own_missing(own: dict[str, Any]) -> tuple[str, str]:
    if own.get("failed"):
        return "own op failed", "isolated: not measured: " + "; ".join(own["failed"])
    return "no own ops", (
        "no ops of its own: all it computes is in its submodules (views, copies and casts are not judged)"
    )


def _short_op(op: str) -> str:
    name = op.removeprefix("aten.").split(".")[0]
    if "scaled_dot_product" in name:
        return "sdpa"
    return name if len(name) <= 12 else name[:11] + "…"


def _values_text(values: Any) -> str:
    n, total, step = values
    return f"all {total} values" if step == 1 and n == total else f"{n} of {total} values, every {ordinal(step)}"


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
    accumulation: dict[str, Any] | None = None,
    on: torch.device | None = None,
    inputs_cause: dict[str, Any] | None = None,
) -> CompareResult:
    """`on`: where the candidate ran (TF32 is CUDA's); `input_floor`: the reference's end-to-end
    error fed candidate-rounded inputs, measured when the whole model diverges and no submodule
    does; `causes`: per module, what compare found behind its divergence (an op inside it that
    overflows, parameters that do not fit the format, inputs of its worst op made too coarse);
    `accumulation`: where no part diverges yet the end-to-end error is far above all of them, the
    running states tried (compare's accumulation step); `inputs_cause`: where rounding the inputs
    costs far more than the output's floor, what in them the format rounds ({} for nothing found)."""
    label = candidate if device is None else f"{candidate} on {device}"
    findings = []
    first = _origin(rows)
    diverged = [r for r in rows if r.diverged]
    first_text = f"`{first.module}`" if first is not None else "none"
    if first is not None and first.module == "":
        finding, first_text = _root_finding(
            first, label, candidate, reference, input_floor, cause=(causes or {}).get(""), inputs_cause=inputs_cause
        )
        after = [f"`{r.module}`" for r in diverged if r.module]
        if after:  # leaves fed what its own ops made (_origin): they show the error, not make it
            finding = dataclasses.replace(finding, message=finding.message.replace(
                "no submodule diverges by itself.",
                f"{', '.join(after)} diverge{'s' if len(after) == 1 else ''} too, from inputs already far off "
                "(what came in is above what its own ops add).",
            ))  # fmt: skip
        findings.append(finding)
    elif first is not None:
        cause = (causes or {}).get(first.module)
        found = _divergence(
            first, diverged, label=label, candidate=candidate, device=device, reference=reference, cause=cause, on=on
        )
        root = rows[-1]
        if root.module == "" and math.isfinite(root.propagated) and root.propagated <= ABSORBED * root.floor:
            # the module's error does not reach the output: a warning, not an error that fails a CI job on a
            # model whose end-to-end error is where rounding puts it (a standardisation of bf16 inputs after its
            # fix: 30x its floor inside, 1.6x at the output)
            found = dataclasses.replace(
                found,
                severity=Severity.WARNING,
                message=found.message + (
                    f" It does not reach the output: the end-to-end error is {_fmt(root.propagated)}, "
                    f"{root.propagated / root.floor:.2g}x its floor ({_fmt(root.floor)}), as what follows absorbs it."
                ),
            )  # fmt: skip
        findings.append(found)
    if first is None and accumulation is not None:
        finding, first_text = _accumulation_finding(accumulation, label, candidate, reference)
        findings.append(finding)
    elif first is None and inputs_cause is not None and input_floor is not None and rows:
        # no part diverges and rounding the inputs explains the error: never OK on that error
        root = rows[-1]
        if root.propagated <= INPUT_EXPLAINS * input_floor:
            finding, first_text = _input_finding(
                root, label, candidate, reference, input_floor, found=inputs_cause,
                evidence=_root_evidence(root, candidate, reference, input_floor),
            )  # fmt: skip
            findings.append(finding)
    final = rows[-1] if rows else None
    summary = [
        (
            "candidate / floor model",
            f"{label} / {reference}: every error is measured against fp64 (the referee); "
            + (
                f"the noise floor is rounding to {candidate}'s format alone"
                if reference == "fp64"
                else f"the {reference} model's own error sets the noise floor where it exceeds rounding"
            ),
        ),
        ("modules compared", str(len(rows))),
        ("first divergent module", first_text),
        ("end-to-end error", _fmt_error(final.propagated, final.cosine) if final else "-"),
        ("error metric", METRIC),
    ]
    ranked = sorted(
        (r for r in rows if r.ratio is not None and not r.inherited), key=lambda r: r.ratio or 0.0, reverse=True
    )
    moved = sorted((r for r in rows if r.reasons), key=lambda r: -_moved_by(r))
    if moved:
        shown = "; ".join(f"`{r.module or '<root>'}`: {r.reasons[0][1]}" for r in moved[:3])
        summary.append(
            ("why errors move", shown + (f"; and {len(moved) - 3} more (JSON has all)" if len(moved) > 3 else ""))
        )
    if ranked:
        worst = ", ".join(f"`{r.module or '<root>'}` " + _ratio_text(r, short=True) for r in ranked[:3])
        summary.append(("largest isolated error / floor", worst))
        # one past the divergence ratio that is no divergence: why, in the text too (the table's note is cut)
        past = next((r for r in ranked[:3] if r.exceeds and not r.diverged and r.unconfirmed), None)
        if past is not None:
            summary.append((f"why `{past.module or '<root>'}` is no divergence", str(past.unconfirmed)))
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


# A floor model this far off the fp64 run at the output (relative) is broken itself: no floor
BROKEN_REFERENCE = 0.1


def broken_reference(off: float, propagated: float, reference: str, candidate: str) -> Finding:
    """The floor model (fp32, where the candidate is narrower) off the fp64 run by `off` (measured end to
    end, BROKEN_REFERENCE or more): every floor it sets is its own error, so the candidate's may look
    within it. Said first: the model is broken in fp32 already, and that is the fix to find."""
    return catalog.make(
        "precision-divergence",
        title=f"The {reference} model itself is {_fmt(off)} off the fp64 run: it sets no floor for {candidate}",
        message=(
            f"The {reference} model's own output is off the fp64 run by {_fmt(off)} (relative), so the "
            f"floor it sets for {candidate} at each module is its own error, and {candidate}'s error "
            f"({_fmt(propagated)}) may look within it. The model loses its precision in {reference} already: "
            f"that is where to start, before {candidate}."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "reference-broken",
            "floor_model": reference,
            "reference_rel": off,
            "propagated_rel": propagated,
            "candidate": candidate,
        },
        fix=(
            f"Fix the {reference} model first: `fpdoctor compare MODEL --candidate {reference} --reference fp64` "
            f"names where it loses against fp64 and checks a fix; then compare {candidate} again"
        ),
        trial=Trial.untried(
            f"the {reference} model is the one to fix, and this run compared {candidate} with it: its own comparison "
            "with fp64 finds and checks that fix"
        ),
        severity=Severity.ERROR,
    )


# A leaf whose inputs came in this many times further off than its own ops make its output is not
# where the error is made (_origin)
FED_DOMINATES = 2.0


def _origin(rows: list[ModuleRow]) -> ModuleRow | None:
    """The first divergent row in model order, unless it is a leaf fed inputs already far off (what came
    in is FED_DOMINATES above its own error) and a container around it diverges by its own ops by at
    least 1/DIVERGENCE_RATIO of that: the error is made there and only shows in the leaf (a model's own
    torch.cdist that cancels, before the readout that amplifies it)."""
    diverged = [r for r in rows if r.diverged]
    first = diverged[0] if diverged else None
    if first is None or not first.leaf or first.input_error is None or first.isolated is None:
        return first
    fed = first.input_error
    if not (math.isfinite(fed) and fed > FED_DOMINATES * first.isolated):
        return first
    for row in diverged[1:]:
        around = row.module == "" or first.module.startswith(row.module + ".")
        own = row.isolated if row.own and row.own.get("op") else None
        if around and not row.leaf and own is not None and (not math.isfinite(own) or own * DIVERGENCE_RATIO >= fed):
            return row
    return first


# The whole model's error is put down to rounding its inputs when the reference, fed the rounded
# inputs, is already within 2x (6 dB) of it.
INPUT_EXPLAINS = 2.0
# a fix of the inputs (input_cause.py) is the fix where it takes the input floor down this many times
INPUT_FIX_FALLS = 10.0


def _root_finding(
    root: ModuleRow,
    label: str,
    candidate: str,
    reference: str,
    input_floor: float | None,
    *,
    cause: dict[str, Any] | None = None,
    inputs_cause: dict[str, Any] | None = None,
) -> tuple[Finding, str]:
    """The whole model diverges and no submodule does: it is not a keep-in-fp32 candidate. Either
    rounding the inputs explains it, or the model's own ops (its forward, outside any submodule) do."""
    rounding = (
        f"rounding the inputs to {candidate} alone costs {_fmt(input_floor)} at the output (the {reference} model "
        f"fed {candidate}-rounded inputs)"
        if input_floor is not None
        else ""
    )
    # the model's whole error on the fp64 inputs: what rounding the inputs is weighed against
    whole = root.whole_isolated if root.whole_isolated is not None else root.isolated
    explained = (
        input_floor is not None and whole is not None and math.isfinite(whole) and whole <= INPUT_EXPLAINS * input_floor
    )
    own, at = _own_op(root)
    evidence = _root_evidence(root, candidate, reference, input_floor)
    # rounding the inputs explains the error, unless a fix of where its worst op's inputs are made was
    # checked: the check holds what the user's raw inputs become in fp32 (a centring done in the model)
    checked = cause is not None and cause.get("trial") is not None and cause["trial"].tried
    # a checked fix of the inputs' values themselves (an offset subtracted before the cast) keeps the inputs in
    # the candidate's format: it goes before one that feeds them in fp32 to lines computed in fp32
    without = (inputs_cause or {}).get("floor_without")
    columns = without is not None and input_floor is not None and without * INPUT_FIX_FALLS < input_floor
    wide = cause is not None and bool((cause.get("evidence") or {}).get("inputs_as_given"))
    if explained and (not checked or (columns and wide)):
        assert input_floor is not None
        return _input_finding(root, label, candidate, reference, input_floor, found=inputs_cause, evidence=evidence)
    if cause is not None and cause.get("fix"):  # its worst op's inputs are the cause: where they are made
        unforced = bool((cause.get("evidence") or {}).get("unforced"))  # no amplifier: what its lines make
        finding = catalog.make(
            "precision-divergence",
            title=f"The whole model's own ops lose precision in {candidate}"
            if unforced
            else f"The values the whole model's {own} reads are made in {candidate}",
            message=(
                f"In {label}, the whole model's own ops (its forward, outside any submodule) lose precision: the "
                f"worst, {own}{at}, adds an error of {_fmt(root.isolated)} "
                f"({against_floor(root.isolated, root.ratio, root.judged_floor)}); no submodule diverges by itself."
                + cause["message"]
            ),
            where={"module": "", "op": own, "phase": "forward", "iteration": root.call},
            evidence={"kind": "divergence", **evidence, "diverged": ["<root>"], **cause["evidence"]},
            fix=cause["fix"],
            trial=cause["trial"],
        )
        said = "what it and the lines around it make" if unforced else "the values it reads"
        return finding, f"no submodule: the whole model's own {own}, from {said}"
    past = root.out_of_range and candidate not in ("fp32", "tf32")  # the exact output passes the format's max
    if past:
        at_op = f" ({own} at {at.strip(' ()')})" if own and at else f" ({own})" if own else ""
        fix = (
            f"compute the model's own ops that make its output{at_op} in fp32 and return their result in fp32: its "
            f"exact values pass {candidate}'s max, so cast back to {candidate} they are Inf again (their operands "
            ".float(), no cast back; what reads the model's output then takes fp32); or move them into a submodule, "
            "which `fpdoctor plan` can keep in fp32 with its output left in fp32"
        )
    elif candidate not in ("fp32", "tf32"):
        fix = (
            "the whole model is not a keep-in-fp32 candidate: move the ops of its forward that lose precision into a "
            "submodule (then `fpdoctor plan` can keep that in fp32), or compute them in fp32 explicitly (their "
            "operands .float(), the result cast back)"
        )
    else:
        fix = (
            "rewrite the ops of its forward that lose precision in a stable form (a difference of two close large "
            "values computed directly, not as the difference of their expansions), or compute them in fp64 (their "
            "operands .double(), the result cast back)"
        )
    finding = catalog.make(
        "precision-divergence",
        title=f"The whole model's own ops make values past {candidate}'s range"
        if past
        else f"The whole model's own ops lose precision in {candidate}",
        message=(
            f"In {label}, the whole model's own ops (its forward, outside any submodule) "
            + (f"make values past {candidate}'s max: " if past else "")
            + (f"{'' if past else 'lose precision: '}the worst, {own}{at}, adds " if own else "add ")
            + f"an error of {_fmt(root.isolated)} ({against_floor(root.isolated, root.ratio, root.judged_floor)}); "
            "no submodule diverges by itself."
            + (f" Re-run whole on the fp64 inputs, its error is {_fmt(whole)}." if whole != root.isolated else "")
            + (f" For comparison, {rounding}." if rounding else "")
        ),
        where={"module": "", "op": own, "phase": "forward", "iteration": root.call},
        evidence={"kind": "divergence", **evidence, "diverged": ["<root>"]},
        fix=fix,
        trial=Trial.untried(UNTRIED_BY_COMPARE),
    )
    return finding, "no submodule: the whole model's own ops (outside any submodule)"


def _root_evidence(root: ModuleRow, candidate: str, reference: str, input_floor: float | None) -> dict[str, Any]:
    own, at = _own_op(root)
    return {
        "candidate": candidate,
        "referee": "fp64",  # every error is measured against the fp64 run
        "floor_model": reference,  # whose own error against fp64 sets the noise floor
        "isolated_rel": root.isolated,
        "floor_rel": root.judged_floor if known(root.judged_floor) else None,  # None: unknown
        "ratio": root.ratio if known(root.judged_floor) else None,  # None: no floor to divide by
        "propagated_rel": root.propagated,
        "whole_isolated_rel": root.whole_isolated,
        "own_op": own,
        "own_op_location": at.strip(" ()") or None,
        "input_floor_rel": input_floor,
        "count": 1,
        "numel": root.numel,
        "dtype": str(compute_dtype(candidate)),
    }


def input_rounding_finding(
    root: ModuleRow, label: str, candidate: str, reference: str, input_floor: float, *, found: dict[str, Any] | None
) -> Finding:
    """The finding for an end-to-end error that rounding the inputs explains, where compare judged the
    output by its use and no part of the model diverged (compare's units step)."""
    evidence = _root_evidence(root, candidate, reference, input_floor)
    return _input_finding(root, label, candidate, reference, input_floor, found=found, evidence=evidence)[0]


def _input_finding(
    root: ModuleRow,
    label: str,
    candidate: str,
    reference: str,
    input_floor: float,
    *,
    found: dict[str, Any] | None,
    evidence: dict[str, Any],
) -> tuple[Finding, str]:
    """The end-to-end error comes from rounding the inputs (the reference fed them rounded is within
    INPUT_EXPLAINS of it): never OK, whether or not the whole model counts as divergent. `found`:
    what in the inputs the format rounds (input_cause.cause), its fix checked without rounding it."""
    rounding = (
        f"rounding the inputs to {candidate} alone costs {_fmt(input_floor)} at the output (the {reference} model "
        f"fed {candidate}-rounded inputs)"
    )
    message = (
        f"In {label}, no module diverges by itself: the end-to-end error {_fmt(root.propagated)} "
        f"({against_floor(root.propagated, root.propagated / max(root.floor, UNKNOWN_FLOOR), root.floor)}) "
        f"comes from the inputs, as {rounding}."
    )
    after = (found or {}).get("floor_without")
    if found and after is not None and after * INPUT_FIX_FALLS < input_floor:
        finding = catalog.make(
            "precision-divergence",
            title=found.get("title") or f"The inputs hold whole numbers that {candidate} cannot",
            message=message + found["message"],
            where={"module": None, "op": None, "phase": "forward"},
            evidence={"kind": "input-rounding", **evidence, "whole_numbers": found["columns"]},
            fix=found["fix"],
            trial=Trial.checked(
                found["changed"],
                on=f"the {reference} model fed the rounded inputs",
                metric="end-to-end error",
                before=input_floor,
                after=after,
            ),
        )
        return finding, "no module: values in the inputs the format cannot hold, rounded"
    finding = catalog.make(
        "precision-divergence",
        title=f"Rounding the inputs to {candidate} already costs more than the noise floor",
        message=message
        + f" The model is ill-conditioned at {candidate} inputs: keeping parts of it in fp32 does not undo inputs "
        "already rounded; what first reads them must get them unrounded.",
        where={"module": None, "op": None, "phase": "forward"},
        evidence={"kind": "input-rounding", **evidence},
        fix=(
            "pass the inputs in fp32 and compute what first reads them in fp32, with the parameters and buffers it "
            "reads kept in fp32 too (a centring or scaling of raw values: do it before the cast), or make the model "
            "less sensitive to its inputs (a normalisation before what amplifies them); `fpdoctor plan` measures "
            "this floor and judges a plan against it, and `fpdoctor compare --inputs-as-given` judges the model "
            "fed its inputs in fp32"
        ),
        trial=Trial.untried(
            "a change to how the model reads its inputs: what compare measured is the floor itself (the model "
            "fed rounded inputs)"
        ),
    )
    return finding, f"no module: rounding the inputs explains the error ({_fmt(input_floor)})"


def _accumulation_finding(found: dict[str, Any], label: str, candidate: str, reference: str) -> tuple[Finding, str]:
    """No module or op diverges by itself, yet the end-to-end error is far above all they add:
    never OK. Named after the running state whose fp64 run takes the error away, where one does."""
    error, explained, state = found["error_rel"], found["explained_rel"], found["state"]
    dtype = found["dtype"]
    message = (
        f"In {label}, the end-to-end error is {_fmt(error)} ({sqnr_db(error):.1f} dB SQNR), {error / explained:.0f}x "
        f"the most that any module or op adds by itself on fp64 inputs, the output's rounding or rounding the "
        f"inputs explain ({_fmt(explained)}): the error is made by accumulation, over many steps that each round "
        "once."
    )
    evidence = {
        "kind": "accumulation",
        "candidate": candidate,
        "referee": "fp64",  # every error is measured against the fp64 run
        "floor_model": reference,  # whose own error against fp64 sets the noise floor
        "propagated_rel": error,
        "explained_rel": explained,
        "input_floor_rel": found["input_floor_rel"],
        "states_tried": found["states"],
        # which states had a checked run of their own, and which were kept in fp64 only with the others
        "tried_alone": [t["location"] for t in found["states"] if t.get("tried_alone")],
        "tried_only_together": [
            t["location"] for t in found["states"] if t.get("tried_together") and not t.get("tried_alone")
        ],
        "joint_rel": found.get("joint_rel"),
        "dtype": dtype,
    }
    if found.get("input_floor_note"):
        evidence["input_floor_note"] = found["input_floor_note"]
    where: dict[str, Any] = {"module": None, "op": None, "phase": "forward"}
    together = found.get("together")
    on = found.get("inputs") or label
    exact = [t for t in found["states"] if t.get("exact")]
    exact_text = "".join(
        f" The state updated with {t['op']} at {t['location']} is not tried: those ops select among values, which "
        f"{dtype} holds exactly." for t in exact
    )  # fmt: skip
    if together is not None:  # every state that rounds kept in fp64 together (with the lines their updates read)
        states, joint, feeding = together["states"], together["raised_rel"], together.get("feeding")
        places = " and ".join(f"{t['op']} at {t['location']}" for t in states)
        lines = ", ".join(t["location"] for t in states)
        plural = len(states) > 1
        evidence |= {"state_locations": [t["location"] for t in states], "raised_rel": joint}
        first = states[0]
        where = {"module": first["module"], "op": first["op"], "phase": "forward"}
        if feeding:
            fed = lines_text(feeding)
            message += (
                f" The running state{'s' if plural else ''} updated with {places} {'are' if plural else 'is'}"
                f" held in {dtype}, and each update reads values {fed} make in {dtype} every step (a decay factor "
                f"near 1 that {dtype} rounds to 1 stops decaying): kept in fp64 alone the state does not explain the "
                f"error; with those lines in fp32 beside it, the end-to-end error is {_fmt(joint)} (checked)."
            )
            evidence["feeding_lines"] = [f"{f}:{n}" for f, n in feeding]
            fix = (
                f"keep the running state{'s' if plural else ''} updated at {lines} in fp32 (create "
                f"{'each' if plural else 'it'} with dtype=torch.float32 and cast what is read from it back to "
                f"{dtype}) and compute {fed} in fp32 too, "
                + (
                    "their results kept in fp32 for the update that reads them"
                    if len(feeding) > 1
                    else "its result kept in fp32 for the update that reads it"
                )
                + " (.float() on what it reads)"
            )
            first_text = f"none by itself: accumulation in the running state at {lines}, with what {fed} make"
            changed = f"the running state at {lines} kept in fp64, {fed} in fp32, the rest in {candidate}"
        else:
            message += (
                f" The running states updated with {places} are held in {dtype}; kept in fp64 together, the "
                f"end-to-end error is {_fmt(joint)} (checked). They are one fix, not tried one by one: each loses "
                "more as its loop grows, so one that gains little alone on this input is needed on a longer one."
            )
            fix = (
                f"keep the running states updated at {lines} in fp32, all of them (create each with "
                f"dtype=torch.float32 and cast what is read from it back to {dtype})"
            )
            first_text = f"none by itself: accumulation in the running states at {lines}"
            changed = f"the running states at {lines} kept in fp64 together, the rest in {candidate}"
        message += exact_text
        fix += f": checked together on {on}, the end-to-end error goes from {_fmt(error)} to {_fmt(joint)}"
        trial = Trial.checked(
            changed, metric="end-to-end relative error against fp64", before=error, after=joint, on=on
        )
    elif state is not None:
        module = f"`{state['module']}`" if state["module"] else "the model"
        message += (
            f" The running state that {module}'s forward updates with {state['op']} at {state['location']} "
            f"({state['steps']} updates per forward) is held in {dtype}; with that state alone kept in fp64 the "
            f"end-to-end error is {_fmt(state['raised_rel'])} (checked)."
        )
        message += exact_text
        evidence |= {"state_op": state["op"], "state_location": state["location"], "state_module": state["module"],
                     "state_steps": state["steps"], "raised_rel": state["raised_rel"]}  # fmt: skip
        where = {"module": state["module"], "op": state["op"], "phase": "forward"}
        fix = (
            f"keep the running state updated at {state['location']} in fp32 (create it with dtype=torch.float32 "
            f"and cast what is read from it back to {dtype}): checked on {on}, that alone takes the end-to-end "
            f"error from {_fmt(error)} to {_fmt(state['raised_rel'])}"
        )
        first_text = f"none by itself: accumulation in the running state at {state['location']}"
        trial = Trial.checked(
            f"the running state at {state['location']} kept in fp64, the rest in {candidate}",
            metric="end-to-end relative error against fp64",
            before=error,
            after=state["raised_rel"],
            on=on,
        )
    else:
        tried = [t for t in found["states"] if t["raised_rel"] is not None]
        untried = [t for t in found["states"] if not t.get("tried_alone") and not t.get("tried_together")]
        together_only = [t for t in found["states"] if t.get("tried_together") and not t.get("tried_alone")]
        if together_only and found.get("joint_rel") is not None:
            message += (
                " No running state tried explains it: kept in fp64 together, "
                + " and ".join(f"{t['op']} at {t['location']} ({t['steps']} updates)" for t in together_only)
                + f" leave an end-to-end error of {_fmt(found['joint_rel'])} (none tried alone: together they "
                "did not take the error away)."
            )
        elif tried:
            message += (
                " No running state tried explains it: "
                + "; ".join(
                    f"{t['op']} at {t['location']} ({t['steps']} updates) kept in fp64 gives {_fmt(t['raised_rel'])}"
                    for t in tried
                )
                + "."
            )
        for t in untried:
            why = (
                "it is updated in place, which keeps its tensor's dtype"
                if t.get("in_place")
                else f"its update ops select among values, which {dtype} holds exactly"
                if t.get("exact")
                else "the run with it in fp64 failed"
            )
            message += (
                f" The running state updated with {t['op']} at {t['location']} ({t['steps']} updates per forward) "
                f"could not be tried in fp64: {why}."
            )
        if not found["states"]:
            message += " No op reads its own previous output many times in one forward."
        suspect = next((t for t in untried if t.get("in_place")), None)
        wide = "fp64" if dtype == "float32" else "fp32"  # an fp32 candidate's state is fp32 already
        fix = (
            f"keep the running state updated in place at {suspect['location']} in {wide} (create it with "
            f"dtype=torch.{'float64' if wide == 'fp64' else 'float32'} and cast what is read from it back to "
            f"{dtype}); not checked: fpdoctor cannot raise an in-place update without your code changed"
            if suspect is not None
            else f"look for a long chain of adds or a reduction computed in {dtype} (a sum over a sequence written "
            "as a loop, a cumulative op, a .sum() over many terms) and compute it in fp64 (.sum(dtype=torch.float64), "
            "the result cast back); where the output is the difference of two such totals (E(b) - E(a)), compute the "
            "difference from the terms that differ instead: the closer the totals, the more their rounding is "
            "amplified; `fpdoctor plan` cannot fix this, its candidates are below fp32"
            if dtype == "float32"  # an fp32 candidate: fp32 is what it already computes in
            else f"look for a long chain of adds or a reduction computed in {dtype} (a sum over a sequence written "
            "as a loop, a cumulative op) and compute it in fp32"
            + (
                f", or keep {' and '.join(f'`{m}`' for m in modules)} in fp32 (`fpdoctor plan` checks which)"
                if (modules := sorted({t["module"] for t in found["states"] if t.get("module")}))
                else "; `fpdoctor plan` cannot fix this by keeping modules in fp32 (the loop is in the model's own "
                "forward)"
            )
        )
        first_text = "none by itself: the error is made by accumulation (no single state found)"
        trial = Trial.untried(
            "no running state kept in fp64 removed the error (see the message)"
            if tried or together_only
            else "no running state could be raised to fp64 and re-run (see the message)"
        )
    finding = catalog.make(
        "precision-divergence",
        title=f"The end-to-end error in {candidate} is made by accumulation, not by any one op",
        message=message,
        where=where,
        evidence=evidence,
        fix=fix,
        trial=trial,
    )
    return finding, first_text


def _divergence(
    first: ModuleRow,
    diverged: list[ModuleRow],
    *,
    label: str,
    candidate: str,
    device: torch.device | None,
    reference: str,
    cause: dict[str, Any] | None,
    on: torch.device | None = None,
) -> Finding:
    own, at = _own_op(first)
    why = (
        f"its fp64 output does not even fit {candidate}'s range"
        if first.out_of_range and own is None
        else against_floor(first.isolated, first.ratio, first.judged_floor)
    )
    evidence: dict[str, Any] = {
        "kind": "divergence",
        "candidate": candidate,
        "device": None if device is None else str(device),
        "referee": "fp64",  # every error is measured against the fp64 run
        "floor_model": reference,  # whose own error against fp64 sets the noise floor
        "out_of_range": first.out_of_range,
        "isolated_rel": first.isolated,
        "floor_rel": first.judged_floor if known(first.judged_floor) else None,  # None: unknown
        "ratio": first.ratio if known(first.judged_floor) else None,  # None: no floor to divide by
        "propagated_rel": first.propagated,
        "own_op": own,
        "own_op_location": at.strip(" ()") or None,
        "count": len(diverged),
        "numel": first.numel,
        "dtype": str(compute_dtype(candidate)),
        "diverged": [r.module or "<root>" for r in diverged[:10]],
    }
    # a container is judged by its worst own op; a leaf by its whole output, the op inside it named after
    subject = f"module `{first.module}`'s own op {own}{at} (in its forward, outside its submodules)"
    if not own or first.leaf:
        subject = f"module `{first.module}`"
    adds = (
        "outputs NaN/Inf by itself"
        if first.isolated is not None and math.isinf(first.isolated)
        else f"adds an error of {_fmt(first.isolated)} by itself"
    )
    message = (
        f"In {label}, {subject} {adds} ({why}); {len(diverged)} module(s) diverge in all. The error of its "
        f"output, with all the candidate's error up to it, is {_fmt_error(first.propagated, None)}."
    )
    worst = (first.own or {}).get("error_rel") if own and first.leaf else None
    if own and first.leaf and worst == 0:
        # no op of its own loses anything alone: what it reads (a weight, a buffer in the format) is the error
        message += (
            f" None of its own ops loses anything run alone on its fp64 inputs ({own}{at} included): what it "
            "reads in this format (its weights, its buffers) makes the error."
        )
    elif own and first.leaf:
        loses = f" (an error of {_fmt(worst)} run alone on its fp64 inputs)" if worst is not None else ""
        message += f" The op inside it that loses most is {own}{at}{loses}."
    where: dict[str, Any] = {"module": first.module, "op": own, "phase": "forward", "iteration": first.call}
    fix = _fix(first.module, candidate, on, single=first.single, weighted=first.weighted)
    if first.out_of_range and candidate != "bf16":  # cast back to the format, its output is Inf again
        fix = (
            f"keep `{first.module}` in fp32 with its output left in fp32: its fp64 output passes {candidate}'s "
            "largest value, so cast back it is Inf again (`fpdoctor plan` finds the modules that must read it in "
            "fp32 and verifies the set); or use bf16, which has fp32's range"
        )
    trial = Trial.untried(UNTRIED_BY_COMPARE)
    if cause:
        evidence.update(cause.get("evidence", {}))
        message += cause.get("message", "")
        where["op"] = cause.get("op") or own
        fix = cause.get("fix") or fix
        trial = cause.get("trial") or trial
    return catalog.make("precision-divergence", message=message, where=where, evidence=evidence, fix=fix, trial=trial)


# compare measures what each module adds by itself; the end-to-end run with a fix in place is plan's
UNTRIED_BY_COMPARE = (
    "compare measures the error each module adds by itself; the end-to-end run with it kept in fp32 is what "
    "`fpdoctor plan` tries and verifies"
)


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
        op, trial = None, None
        overflow = overflows.get((row.module, row.call))
        if overflow is not None:
            op = overflow["op"]
            fmt = FORMATS.get(DTYPE_FORMAT.get(overflow["dtype"], ""))
            limit = fmt.max if fmt is not None else None
            size = overflow.get("reference_absmax")
            at = f" ({overflow['location']})" if overflow.get("location") else ""
            reach = f": its values reach {size:.3g}, beyond {candidate}'s max {limit:.6g}" if size and limit else ""
            message += (
                f" Inside it {op} overflows{reach}{at}, and the module's output itself passes {candidate}'s range: "
                "what reads it overflows too."
                if row.out_of_range
                else f" Its output fits {candidate}, but inside it {op} overflows{reach}{at}."
            )
            evidence |= {"overflow_inside": True, "overflow_op": op, "overflow_absmax": size, "overflow_limit": limit}
            evidence |= {"overflow_location": overflow.get("location")}
            checked = overflow.get("checked")
            if checked is not None:  # its line and the lines after it that consume its result, run in fp32
                first, last = checked["lines"]
                lines = f"line {first}" if first == last else f"lines {first}-{last}"
                not_op = f" (not {op}'s result: {size:.3g} is past the max)" if size else ""
                called, mine = checked.get("called") or [], checked.get("called_user") or []
                passed = "x what the line passes it, p one of its parameters"
                if called:  # torch's modules the lines call ran at them: in fp32 with them, their output cast back
                    mods = ", ".join(f"self.{c}" for c in called)
                    not_op += (
                        f"; the check ran the torch module{'s' if len(called) > 1 else ''} "
                        f"{'it calls' if first == last else 'they call'} ({mods}) in fp32 too, "
                        f"{'their outputs' if len(called) > 1 else 'its output'} cast back (not tried: cast back "
                        f"before that call instead, `self.{called[0]}(x.to(p.dtype))`, {passed}, which keeps "
                        f"{'their' if len(called) > 1 else 'its'} {candidate} weights)"
                    )
                if mine:  # a module of the user's runs its own lines: it read the values cast back, as it will
                    mods = ", ".join(f"self.{c}" for c in mine)
                    not_op += (
                        f"; a module of yours {'it calls' if first == last else 'they call'} ({mods}) reads them cast "
                        f"back, as the check ran it: `self.{mine[0]}(x.to(p.dtype))`, {passed}"
                    )
                fixes.append(
                    f"compute {lines} of {checked['file']} (inside `{row.module}`, where {op} overflows) in fp32: "
                    f"{op}'s operands .float(), and every op after it on {'that line' if first == last else 'them'} "
                    f"in fp32 too; cast back to {candidate} only what {lines} "
                    f"return{'s' if first == last else ''}{not_op}; checked: the "
                    f"end-to-end error goes from {_fmt(checked['before'])} to {_fmt(checked['after'])}"
                )
                trial = Trial.checked(
                    f"the ops at {lines} of {checked['file']} in fp32, their results cast back to {candidate}",
                    metric="end-to-end relative error against fp64",
                    before=checked["before"],
                    after=checked["after"],
                    on="the inputs given",
                )
            elif (whole := overflow.get("module_checked")) is not None:  # no one line cures it: the module does
                output = ", its output left in fp32 (cast back, it overflows again)" if whole["fp32_output"] else ""
                fixes.append(
                    f"keep `{row.module}` in fp32{output}: its ops overflow {candidate} on more lines than {op}'s, "
                    f"and no line of it alone in fp32 cures the output (`fpdoctor plan` writes the code); checked: "
                    f"the end-to-end error goes from {_fmt(whole['before'])} to {_fmt(whole['after'])}"
                )
                trial = Trial.checked(
                    f"`{row.module}` in fp32" + (", its output in fp32" if whole["fp32_output"] else ""),
                    metric="end-to-end relative error against fp64",
                    before=whole["before"],
                    after=whole["after"],
                    on="the inputs given",
                )
            elif row.out_of_range:  # cast back, what it makes overflows again where it is read
                fixes.append(
                    f"compute {op} inside `{row.module}` in fp32{at} (its operands .float()) and keep what it makes in "
                    f"fp32 for what reads it, past `{row.module}` (cast back to {candidate}, it overflows again); or "
                    "scale down the values that grow that large (the weights or the residual stream that feed it)"
                )
            else:
                fixes.append(
                    f"compute {op} inside `{row.module}` in fp32{at}: its operands .float(), the result cast back "
                    "after the ops that consume it (e.g. the softmax); or scale its operands down before it"
                )
        tensors = [e for e in within(misfit, row.module) if not negligible(e)]
        if row.out_of_range and overflow is None:
            # what it returns is past the format's max in fp64 already: no precision of its own ops, and no
            # tensor of its that fits, makes its output fit; what reads the output must stay wide too
            fixes.append(
                f"keep `{row.module}` and what reads its output in fp32: its exact output passes {candidate}'s max, "
                f"so cast back to {candidate} it overflows again (`fpdoctor plan` finds the fewest such modules "
                "and verifies them)"
            )
        if tensors:
            listed = "; ".join(describe_misfit(e) for e in tensors[:3])
            evidence["misfits"] = tensors[:10]
            if row.out_of_range:  # not what breaks it: its output does not fit, whatever they hold
                message += f" Its {listed}, beside that."
            else:
                message += f" Its {listed}: that alone breaks it in {candidate}."
                fixes.append(f"keep `{row.module}` in fp32, where its tensors fit (`fpdoctor plan` keeps it)")
        if message:
            if candidate in ("fp16", "fp16-accumulate"):
                bf16 = "bf16, which has fp32's range"
                fixes.append(f"also possible, not tried: {bf16}" if trial else f"or use {bf16}")
            found[row.module] = {"message": message, "evidence": evidence, "op": op, "fix": "; ".join(fixes)}
            if trial is not None:
                found[row.module]["trial"] = trial
    return found


# A fix that raises some ops is called checked when it divides the end-to-end error by at least
# this much (12 dB), as compare's running states are (compare.ACCUMULATION_FALLS).
RAISED_FALLS = 4.0
# ... or, where it leaves the module it names within DIVERGENCE_RATIO of its floor, takes the end-to-end
# error down by this much at least: the rest of the model's rounding may be most of what is left.
SETTLED_FALLS = 1.1


def forced_causes(forced: dict[str, dict[str, Any]], candidate: str) -> dict[str, dict[str, Any]]:
    """Per container whose worst own op's error its inputs' precision forces (compare/upstream.py):
    the message, evidence, fix and trial of its finding."""
    out: dict[str, dict[str, Any]] = {}
    for module, found in forced.items():
        op, lines, raised = found["op"], found.get("lines") or [], found.get("raised_rel")
        buffers = found.get("buffers") or []
        kind, again = _held(buffers, found.get("parameters") or [], candidate)
        error = found.get("error_rel")
        # the whole model's own worst op, no amplifier (compare.forced: no module to keep): the lines alone speak
        message = (
            ""
            if found.get("unforced")
            else f" {op} is not the cause: run exactly (in fp64) on its inputs rounded to {candidate}, it is as wrong "
            f"({_fmt(found['conditioned_rel'])}): at these inputs it amplifies the rounding of what it reads, so "
            f"no precision of {op} itself helps."
        )
        evidence: dict[str, Any] = {"conditioned_rel": found["conditioned_rel"]}
        dtype = str(compute_dtype(candidate)).removeprefix("torch.")
        where = lines_text(lines) if lines else ""
        held = ", ".join(f"`{b}`" for b in buffers)
        if (lines or buffers) and found.get("unforced"):
            # no amplifier: the op and those around it round what they make (a histogram's counts, its CDF)
            rounded = f", reading the {kind} {held}, which the cast to {dtype} rounded" if buffers else ""
            message += (
                f" The lines that feed it and read what it makes are {where or 'its line'}{rounded}: what they make "
                "is rounded."
            )
            evidence["unforced"] = True
        elif lines or buffers:
            made = f"made at {where}" if lines else ""
            rounded = f"the {kind} {held}, which the cast to {dtype} rounded"
            message += f" What it reads is {' from '.join(x for x in (made, rounded if buffers else '') if x)}."
        if lines or buffers:
            evidence |= {"feeding_lines": [f"{f}:{n}" for f, n in lines], "raised_rel": raised}
            if found.get("inputs_as_given"):
                evidence["inputs_as_given"] = True
            if buffers:
                evidence["rounded_buffers"] = buffers
        # it helped: the error falls RAISED_FALLS, or by half to within what the format's rounding of the output
        # explains (compare on the fixed model finds no divergence: a rope's remaining error is bf16's own)
        floor = found.get("floor_rel")
        near_floor = floor is not None and raised is not None and raised <= DIVERGENCE_RATIO * floor
        # or it leaves the module it names within its floor, and the end-to-end error lower: what is left
        # is the rest of the model's (a timestep embedding fixed in a bf16 denoiser: 0.0107 -> 0.0059)
        mine, mine_floor = found.get("module_raised_rel"), found.get("module_floor_rel")
        settled = (
            mine is not None and mine_floor is not None and math.isfinite(mine)
            and mine <= DIVERGENCE_RATIO * mine_floor
            and raised is not None and raised * SETTLED_FALLS <= (error or 0.0)
        )  # fmt: skip
        helped = (
            raised is not None
            and math.isfinite(raised)  # inf -> inf is no help
            and error is not None
            and (raised * RAISED_FALLS <= error or (near_floor and raised * 2 <= error) or settled)
        )
        # the module's figures beside the end-to-end ones where they are what makes it checked
        own = (
            f"`{found['module']}`'s output error goes from {_fmt(found['module_rel'])} to {_fmt(mine)} (its floor "
            f"{_fmt(mine_floor)}: it no longer diverges), and "
            if settled and found.get("module_rel") is not None and found.get("module")
            else "the model no longer diverges, and " if settled and found.get("module_rel") is not None
            else ""
        )  # fmt: skip
        given = bool(found.get("inputs_as_given")) and bool(lines)
        modules = found.get("called") or []
        # the modules those lines call, by the attribute the code calls them by: the check ran them in fp32 whole
        called = f"here {' and '.join(modules)}: every one of them" if modules else "a Linear, a norm"
        changes = [
            *([f"compute {where} in fp32"] if lines else []),
            *([f"keep {held} in fp32 ({again})"] if buffers else []),
        ]
        carried = [tuple(line) for line in found.get("carried") or []]
        if carried and helped:
            # the value handed from module to module (a residual stream) kept in fp32 where it is stored between
            # them, as the check ran it (RaisedLines.carried): what reads it computes from fp32, a layer with
            # weights reads it cast
            evidence["carried_lines"] = [f"{f}:{n}" for f, n in carried]
            rest = [line for line in lines if line not in carried]
            stream = lines_text(carried)
            readers = (
                (f", {lines_text(rest)} computing from it in fp32" if rest else "")
                + (f", {held} kept in fp32 ({again})" if buffers else "")
                + f"; a module of yours that reads it returns {dtype} (.to(p.dtype) on what it returns, p a parameter "
                f"of the model), and a layer with weights that reads it directly (a Linear) reads it as .to(p.dtype)"
            )
            checked = f"{own}the end-to-end error goes from {_fmt(error)} to {_fmt(raised)}"
            fix = carried_fix(
                "the value these modules are passed", stream, dtype, readers, given=given, checked=checked
            )
            trial = Trial.checked(
                f"the values made at {stream} kept in fp32 from module to module"
                + (f", the ops at {lines_text(rest)} in fp32" if rest else "")
                + (f", {held} held in fp32" if buffers else "")
                + (", the inputs fed in fp32" if given else "")
                + f", what else reads them cast to {dtype}",
                metric="end-to-end relative error against fp64",
                before=error,
                after=raised,
                on="the inputs given",
            )  # fmt: skip
        elif given and helped and not found.get("kept_wide"):
            # what the lines read is the model's input, rounded by the cast before the forward
            fix = (
                f"Do that computation before the cast: pass the model's inputs in fp32 (not cast to {dtype} before "
                f"the forward), compute {where} in fp32 from them"
                + (f" with {held} kept in fp32 ({again})" if buffers else "")
                + f", and cast what it produces to {dtype} (.to(p.dtype), p a parameter of the model, or in a module "
                "that holds none a buffer the model's cast converts: not a fixed dtype, which would break "
                f"compare's fp32 and fp64 runs); any other line that reads the inputs reads them cast to {dtype} "
                "(x.to(p.dtype)), "
                "as the check ran it; checked: "
                f"the end-to-end error goes from {_fmt(error)} to {_fmt(raised)}. Then `fpdoctor compare "
                "--inputs-as-given` checks the changed model fed its inputs as they are"
            )  # fmt: skip
            trial = Trial.checked(
                f"the inputs fed in fp32, the ops at {where} in fp32"
                + (f" with {held} held in fp32" if buffers else "")
                + f", their results cast back to {dtype}",
                metric="end-to-end relative error against fp64",
                before=error,
                after=raised,
                on="the inputs given",
            )  # fmt: skip
        elif lines and helped and found.get("kept_wide"):
            # as the check ran it (RaisedLines, cast_back=False): what the lines make read in fp32 everywhere
            fix = (
                f"{' and '.join(changes)}, and keep what they make in fp32 for what reads it (cast back to {dtype}, it "
                "is rounded again: a count past 256 in bf16, a CDF near 1): on those lines, torch.float32 where "
                f"they write torch.{dtype} or a dtype read from the model (dtype=x.dtype, a buffer's dtype), .float() "
                "on each tensor they read from the rest of the model; what reads their results then computes in fp32 "
                "(type promotion), and where an op needs its operands in one dtype, .float() the other"
                + (f"; pass the model's inputs in fp32 (not cast to {dtype} before the forward)" if given else "")
                + f"; checked: {own}the end-to-end error goes from {_fmt(error)} to {_fmt(raised)}"
                + (
                    ". Then `fpdoctor compare --inputs-as-given` checks the changed model fed its inputs as they are"
                    if given
                    else ""
                )
            )
            trial = Trial.checked(
                f"the ops at {where} in fp32, their results kept in fp32"
                + (f", {held} held in fp32" if buffers else "") + (", the inputs fed in fp32" if given else ""),
                metric="end-to-end relative error against fp64", before=error, after=raised, on="the inputs given",
            )  # fmt: skip
            evidence["kept_wide"] = True
        elif (lines or buffers) and helped:
            # as the check ran it (engine.raising.RaisedLines): every op of those lines in fp32, what
            # they produce cast back where the rest of the model reads it, not in the middle of a line
            back = f", and cast what they produce back to {dtype} where the rest of the model reads it" if lines else ""
            fix = (
                f"{' and '.join(changes)}{back}"
                + (
                    f": on those lines, torch.float32 where they write torch.{dtype} (a cast, a dtype= argument), "
                    ".float() on each tensor they read from the rest of the model, "
                    + (
                        f"and where a line calls a module ({called}), that module in fp32 too, as the check ran its "
                        "ops: its functional form on the input .float() with its own parameters .float() (a Linear "
                        "m: F.linear(x.float(), m.weight.float(), None if m.bias is None else m.bias.float()); a "
                        "LayerNorm: F.layer_norm(x.float(), m.normalized_shape, m.weight.float(), m.bias.float(), "
                        "m.eps), the parameters None where it has none), so that they still train and convert with "
                        "the model; "
                        if modules
                        else ""
                    )
                    + "then .to(p.dtype) on each value a later line reads (what the last line makes, and any other: "
                    "the v of a q, k, v), p a parameter of the model (not an input: token ids are integers; a fixed "
                    f".to(torch.{dtype}) breaks the model's fp32 and fp64 runs), or in a module with no parameters "
                    "the floating tensor those lines read as it came in (x.dtype, read before its .float())"
                    if lines
                    else ""
                )
                # the check cast the held values back where anything else read them: so must the code
                + (
                    f"; the ops that read {held} whole then compute in fp32 (type promotion; one value of it, "
                    f"alphas[t], leaves them in {dtype}), and where one needs its "
                    "operands in one dtype (a matmul, a lookup whose rows the rest reads), read "
                    f"{'them' if len(buffers) > 1 else 'it'} there as .to(x.dtype), x the tensor it meets (a fixed "
                    f".to(torch.{dtype}) breaks the model's fp32 and fp64 runs)"
                    if buffers
                    else ""
                )
                + f"; checked: {own}the end-to-end error goes from {_fmt(error)} to {_fmt(raised)}"
                + (" (the rest is the other modules' own rounding)" if own else "")
            )
            changed = [
                *([f"the ops at {where} in fp32"] if lines else []),
                *([f"{held} held in fp32"] if buffers else []),
            ]
            trial = Trial.checked(
                " and ".join(changed) + (f", their results cast back to {dtype}" if lines else ", the rest as it ran"),
                metric="end-to-end relative error against fp64",
                before=error,
                after=raised,
                on="the inputs given",
            )
        else:
            tried = (
                f"the change measured did not help enough: {' and '.join(changes)} leaves the end-to-end error at "
                f"{_fmt(raised)} (from {_fmt(error)}); what they read may be made earlier (a value passed in)"
                if (lines or buffers) and raised is not None
                else f"the run with {' and '.join(changes)} failed, so it was not measured"
                if lines or buffers
                else "the lines that make its inputs were not found"
            )
            fix = f"make what {op} reads in fp32 from where it is first computed, and cast {op}'s result back"
            inputs = found.get("input_floor_rel")
            if inputs is not None and error is not None and math.isfinite(inputs) and inputs * INPUT_EXPLAINS >= error:
                # what it reads is made from the model's inputs, which the cast rounded: their floor is the error
                message += (
                    f" Rounding the model's inputs to {candidate} alone costs {_fmt(inputs)} of the {_fmt(error)} at "
                    f"the output (the reference model fed {candidate}-rounded inputs): what {op} reads starts from "
                    f"the inputs, so the lines that first read them, fed them in fp32 (`fpdoctor compare "
                    "--inputs-as-given` judges the model fed them so), are where to look."
                )
                evidence["input_floor_rel"] = inputs
                tried += f"; rounding the inputs alone costs {_fmt(inputs)} (the reference fed them rounded)"
            trial = Trial.untried(tried)
        out[module] = {"message": message, "evidence": evidence, "op": op, "fix": fix, "trial": trial}
    return out


def carried_fix(what: str, stream: str, dtype: str, readers: str, *, given: bool, checked: str) -> str:
    """The fix "keep the residual stream in fp32", as compare's checks ran it (RaisedLines.carried): `what`
    is kept in fp32 where it is made (`stream`, the lines that make it) and carried; `readers`, how what
    reads it is changed; `given`: the model's inputs fed in fp32 too; `checked`: the figures."""
    return (
        f"Keep {what} in fp32 where it is made and carried from module to module (a residual stream): compute "
        f"{stream} in fp32 and do not cast what they make to {dtype} (x = x + f(x) with x in fp32 stays fp32 by "
        f"type promotion: drop a .to() that casts it back){readers}"
        + (f"; pass the model's inputs in fp32 (not cast to {dtype} before the forward)" if given else "")
        + f"; checked: {checked}. This is residual_in_fp32 in Mamba's and flash-attn's fused add + norm"
        + (". Then `fpdoctor compare --inputs-as-given` checks the changed model fed its inputs as they are" if given
           else "")
    )  # fmt: skip


def _held(held: list[str], parameters: list[str], candidate: str) -> tuple[str, str]:
    """What the model's cast rounded, in words ("buffer", "parameters"), and how to keep it in fp32."""
    dtype = str(compute_dtype(candidate)).removeprefix("torch.")
    many = len(held) > 1
    if not parameters:
        kind, what = "buffers" if many else "buffer", "buffer"
    else:
        kind = ("parameters" if many else "parameter") if len(parameters) == len(held) else "parameters and buffers"
        what = "parameter and buffer"
    it, its = ("them", "their values") if many else ("it", "its value")
    again = f"model.to(torch.{dtype}) rounds every floating {what}: " + plain_fp32(held, parameters)
    if not parameters:  # a buffer: the form only the user's own cast leaves alone, second
        again += (
            f"; or, where only your code casts the model, assign {it} again in fp32 after the cast, from {its} "
            f"saved before it (a clone taken before the cast: .float() of {it} after the cast gives the rounded "
            "value back)"
        )
    return kind, again


def line_spans(numbers: list[int]) -> str:
    """'line 20', 'lines 17-20', 'lines 20-21, 35-36 and 40' (runs of consecutive lines)."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = [f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    if len(parts) == 1:
        return f"line {parts[0]}" if len(runs[0]) == 1 else f"lines {parts[0]}"
    return "lines " + ", ".join(parts[:-1]) + f" and {parts[-1]}"


def lines_text(lines: list[tuple[str, int]]) -> str:
    """'lines 17-20 of run.py', 'lines 20-21 and 35 of run.py' (one file), else 'a.py:3, b.py:9'."""
    files = {f for f, _ in lines}
    if len(files) == 1:
        return f"{line_spans([n for _, n in lines])} of {lines[0][0]}"
    return ", ".join(f"{f}:{n}" for f, n in lines)


# where a finding's evidence names the source line of the op it is about
_LOCATIONS = ("location", "own_op_location", "overflow_location")


def _line_of(location: Any) -> str | None:
    """'file.py:14' of '/path/file.py:14 in forward' (evidence locations), else None."""
    if not isinstance(location, str) or ":" not in location:
        return None
    return location.split(" in ", 1)[0]


class ReferenceFailed(RuntimeError):
    """The model fails in the reference run: nothing to compare against. `fix`: what to do, where
    the failure says more than "fix the model"."""

    def __init__(self, message: str, fix: str = "fix the model or its example inputs first") -> None:
        super().__init__(message)
        self.fix = fix


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
    # an op the worst set's findings name already (its overflow, with the fix checked there) is not
    # named again by another set's risk of it
    ops = {(f.where.get("module"), f.where.get("op")) for f in main.report.findings if f.where.get("op")}
    named = {_line_of(f.evidence.get(key)) for f in main.report.findings for key in _LOCATIONS} - {None}
    for k, r in enumerate(results):
        for f in r.report.findings if k != worst else []:
            at = f"{f.where['file']}:{f.where['line']}" if "file" in f.where and "line" in f.where else None
            if (f.where.get("module"), f.where.get("op")) in ops or (at is not None and at in named):
                continue
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
            **({"top1": r.report.data["decisions"].get("top1")} if r.report.data.get("decisions") else {}),
        }
        for d, r in zip(described, results, strict=True)
    ]
    data["worst_input_set"] = worst
    growth = _growth(results, described)
    if growth is not None:
        data["error_grows_with_input_size"] = growth
        said = " Across the input sets it grows with the input's size: " + growth["text"] + "."
        for k, f in enumerate(findings):
            if f.evidence.get("kind") in ("accumulation", "divergence", "input-rounding"):
                findings[k] = dataclasses.replace(
                    f, message=f.message + said, evidence={**f.evidence, "growth": growth}
                )
    lines: list[tuple[str, str]] = []
    if given[1]:
        lines.append(("model as given", given[1]))
    if len(results) == 1:
        lines.append(("inputs", inputs_text(described[0])))
    else:
        lines.append(("input sets judged", f"{len(results)}; worst: #{worst}, {inputs_text(described[worst])}"))
        for k, r in enumerate(results):
            end = _fmt_error(r.rows[-1].propagated, r.rows[-1].cosine) if r.rows else "-"
            # each set's decisions too: the worst set by error need not be the one whose decisions move most
            made = r.report.data.get("decisions") or {}
            top1 = (
                f"; top-1 {pct(made['top1'])} (rounding: {pct(made['floor_top1'])})"
                if made.get("top1") is not None and made.get("floor_top1") is not None and made.get("kind") != "ids"
                else ""
            )
            lines.append(
                (f"  set #{k}", f"end-to-end error {end}{top1}; first divergent: {r.first_divergent or 'none'}")
            )
    if growth is not None:
        lines.append(("error grows with input size", growth["text"]))
    data["summary"][1:1] = lines
    main.input_sets, main.worst_set = len(results), worst
    return main


# The end-to-end error is said to grow with the input's size when, over input sets of at least
# two sizes, it never falls as the size grows and the largest is GROWS times the smallest's.
GROWS = 2.0


def _growth(results: list[CompareResult], described: list[dict[str, Any]]) -> dict[str, Any] | None:
    """End-to-end error against input size (floating and integer values given), when it grows."""
    points = sorted(
        (sum(math.prod(t["shape"]) for t in d["tensors"]), r.rows[-1].propagated)
        for d, r in zip(described, results, strict=True)
        if r.rows and math.isfinite(r.rows[-1].propagated)
    )
    if len({size for size, _ in points}) < 2 or points[0][1] <= 0:
        return None
    errors = [e for _, e in points]
    if any(b < a for a, b in itertools.pairwise(errors)) or errors[-1] < GROWS * errors[0]:
        return None
    text = " → ".join(f"{_fmt(e)} ({n} input values)" for n, e in points)
    return {"sizes": [n for n, _ in points], "errors": errors, "text": text}


TABLE_ROWS = 24  # text, markdown and html show at most this many modules; JSON has them all


def _table(rows: list[ModuleRow]) -> dict[str, Any]:
    """The per-module error profile, in model order; for large models the rows that matter most."""
    shown = rows
    title = (
        "Per module, in model order: SQNR against fp64 in dB (higher is better), on every k-th value of each "
        f"output (at most {SAMPLE}); a container's isolated error is its worst own op's (JSON: what each is on, why)"
    )
    if len(rows) > TABLE_ROWS:
        worst = sorted(range(len(rows)), key=lambda k: -(rows[k].ratio or 0.0))[: TABLE_ROWS - 1]
        shown = [rows[k] for k in sorted({*worst, len(rows) - 1})]  # and the output, last in post-order
        title += f"; the {len(shown)} of {len(rows)} with the largest isolated error / floor (JSON has all)"

    def db(value: float | None) -> str:
        return "-" if value is None else "non-finite" if math.isinf(value) else f"{sqnr_db(value):.1f}"

    def floor_db(value: float) -> str:
        return db(value) if known(value) else "unknown"

    def ratio(r: ModuleRow) -> str:
        if r.ratio is None:
            return "-"
        verdict = " diverges" if r.diverged else " (from inside)" if r.inherited else ""
        return _ratio_text(r, short=True) + verdict

    return {
        "title": title,
        "columns": ["module", "propagated", "isolated", "floor", "isolated/floor", "NaN/Inf", "note"],
        "rows": [
            [
                (r.module or "<root>") + (f" #{r.call}" if r.call else ""),
                db(r.propagated),
                db(r.isolated),
                floor_db(r.judged_floor),
                ratio(r),
                str(r.nonfinite) if r.nonfinite else "",
                _note(r),
            ]
            for r in shown
        ],
    }


def _own_op(row: ModuleRow) -> tuple[str | None, str]:
    """A container's worst own op and " (file:line)" where it is, for a message."""
    own = row.own or {}
    return own.get("op"), f" ({own['location']})" if own.get("location") else ""


NOTE_WIDTH = 20  # the table's note column: the text table must stay readable 100 columns wide


def _note(row: ModuleRow) -> str:
    text = "; ".join(short for short, _ in row.notes)
    return text if len(text) <= NOTE_WIDTH else text[: NOTE_WIDTH - 1] + "…"


def _fix(
    module: str, candidate: str, on: torch.device | None = None, *, single: bool = True, weighted: bool = True
) -> str:
    if candidate == "fp32" and (on is None or on.type != "cuda"):
        # no TF32 or reduced-precision reduction here: fp32 arithmetic itself loses more than rounding
        return (
            f"`{module}` loses more in fp32 than its output's rounding on this device, which has no TF32: "
            "its arithmetic cancels or amplifies (a - b of near-equal values, a long sum, a function of a "
            "large argument). Rewrite that computation stably (subtract a mean first, a compensated or "
            "pairwise sum, reduce the argument), or compute it in fp64 where that is affordable"
        )
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
    # bf16 has fp32's range: the way out of an fp16 overflow, never advice to a run in bf16 already
    other = "" if candidate == "bf16" else "use bf16 if the cause is range, "
    name = module.rpartition(".")[2] or module
    if name.isdigit() and "." in module:  # a member of a ModuleList or Sequential: self.blocks[1], not self.1
        name = f"{module.rpartition('.')[0].rpartition('.')[2]}[{name}]"

    # an output of several tensors (a state returned beside the result) is cast back tensor by tensor
    # the input cast to the module's own parameters' dtype, not a fixed .float(): compare's fp64 run of the
    # changed model (and any other precision) then still runs it (a GRU fed x.float() beside fp64 weights fails)
    def back(cast: str) -> str:
        if single:
            return f"self.{name}(x.{cast}).to(x.dtype)"
        return (
            "torch.utils._pytree.tree_map(lambda t: t.to(x.dtype) if torch.is_tensor(t) and t.is_floating_point() "
            f"else t, self.{name}(x.{cast}))"
        )

    other_text = f", or {other.rstrip(', ')}" if other else ""
    if not weighted:  # no parameters to keep: its arithmetic alone, on its inputs in fp32
        return (
            f"keep `{module}` in fp32 (fpdoctor plan finds the smallest such set): it holds no parameters, so its "
            f"arithmetic in fp32 is its inputs .float() with its output cast back (`{back('float()')}`){other_text}"
        )
    return (
        f"keep `{module}` in fp32 with its fp32 weights (before the model's cast, `saved = {{k: v.clone() for k, v in "
        f"model.get_submodule({module!r}).state_dict().items()}}`; after it, `model.get_submodule({module!r}).float()"
        ".load_state_dict(saved)`: .float() alone gives the rounded weights back; fpdoctor plan finds the smallest "
        "such set): its parameters and its arithmetic, called on its inputs cast to its parameters' dtype with its "
        f"output cast back (`{back('to(p.dtype)')}`, p = next(self.{name}.parameters())){other_text}"
    )


def _fmt_error(rel: float, cosine: float | None) -> str:
    if math.isinf(rel):
        return "non-finite"
    # Near 1 the digits that matter are in the distance from 1.
    cos = (
        ""
        if cosine is None
        else f", cosine {cosine:.4f}"
        if cosine < 0.999
        else f", cosine 1 - {max(1 - cosine, 0.0):.1e}"
    )
    return f"{_fmt(rel)} ({sqnr_db(rel):.1f} dB SQNR{cos})"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else ("non-finite" if math.isinf(value) else f"{value:.3g}")


def known(floor: float | None) -> bool:
    """Whether a floor was measured: compare keeps UNKNOWN_FLOOR where rounding overflows the format
    and no reference error was measured, so that any error is above it; it is never shown."""
    return floor is not None and math.isfinite(floor) and floor > UNKNOWN_FLOOR


def against_floor(error: float | None, ratio: float | None, floor: float) -> str:
    """An error's distance from its noise floor, in words: a measured ratio, or what is unknown."""
    if error is not None and math.isinf(error):
        where = f"the noise floor is {floor:.2g}" if known(floor) else "the noise floor is unknown"
        return f"non-finite (NaN/Inf), where the fp64 result is finite; {where}"
    if not known(floor):
        return (
            "no noise floor to weigh it against: rounding the fp64 output to the format either overflows or loses "
            "nothing (values the format holds exactly, whole numbers), and no reference error was measured"
        )
    return f"{_fmt_ratio(ratio)} the noise floor of {floor:.2g}"


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else ("infinitely above" if math.isinf(ratio) else f"{ratio:.0f}x")
