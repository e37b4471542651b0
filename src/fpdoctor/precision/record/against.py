"""Judging machine B's compare run against machine A's record: the model of the comparison.

Both runs are compare records (recording.py makes B's the same way A's was made), so this is a
pure function of two records. Per input set, per module call present in both, in the fp64
pass's post-order (a module comes after everything inside it, and after every module whose
output its inputs are made of):

  inputs       the input sets' digests (dtype, shape, every value) and the digests of the random
               draws the forward made itself must match, else that set is not judged at all;
  weights      per module, the digest of its own parameters and buffers;
  computation  B's fp64 sample against A's. fp64 on two machines differs by summation order only:
               about sqrt(K) x 1.1e-16 per reduction of K terms, grown by the model's condition
               on the way to the output; 1e-12 is typical, and FP64_AGREE = 1e-9 leaves three
               orders of magnitude for deep or ill-conditioned models while any change of code,
               configuration or an op's definition (a GELU approximation, an epsilon, a scale)
               lands at 1e-6 or far above. The first module call whose fp64 output differs, with
               every one before it agreeing, is where the two computations part: explained by
               changed weights when it, a module inside it or a module around it has them, else
               its code or configuration changed. Nothing after it is judged further: a
               difference there cannot be told from the changed computation;
  departure    B's candidate sample against A's, relative to A's fp64 norm. Two machines running
               the same candidate differ by their kernels' rounding, which stays within a few
               noise floors (the row's floor, as compare judges a module today), plus what
               already differed between them on the way in. The error both runs carry in
               against fp64 is the same on both machines where everything before agrees, so it
               cancels in B - A and is no allowance: a module whose own computation differs
               (B's copy fed the fp64 inputs leaves the floor of A's, `alone_agrees` false) is
               judged against DIVERGENCE_RATIO times the floor, or MOVES times the largest
               difference carried in (the largest departure of the module calls before it),
               whichever is larger. Only a module whose isolated error agrees on both machines
               gets the old allowance, DIVERGENCE_RATIO times the smaller of the two propagated
               errors: a module that amplifies what it is fed may grow a small difference.
               A departure is beyond that limit, or non-finite values on one side only. The
               first departing module call, with everything before it agreeing, is named. A
               leaf that departs although B's copy of it, fed the fp64 inputs, stays within the
               floor of A's got the departure with its inputs: from its parent's own ops
               (outside any submodule), which is what is named;
  use          an output of logits, by what it decides (decide.py, as compare judges its own):
               B's candidate against A's fp64 output - top-1 agreement and top-5 over every row
               both records decided, KL over the rows both keep whole - beside A's own candidate
               judged the same way, with the floors A computed from its whole output (rounding
               its fp64 output to the candidate's format). Changed: B's candidate flips 16x the
               rows rounding flips, and 1% of them at least (decide.Decisions.changed), however
               small its relative error. It departs from A's run when it also flips 16x what
               A's candidate flipped: the machine, not the precision. Judged only where nothing
               before it parted (A's fp64 output is this run's referee only then); a format-1
               record keeps no decisions, and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fpdoctor.precision.decide import DECISION_RATIO, DECISION_SHARE, Decisions, kl
from fpdoctor.precision.metrics import SAMPLE, rel_error
from fpdoctor.precision.profile import DIVERGENCE_RATIO, MOVES
from fpdoctor.precision.record import machine
from fpdoctor.precision.record.record import CallRecord, CompareRecord, DecisionRecord, SetRecord

FP64_AGREE = 1e-9


@dataclass
class Row:
    """One module call judged on both machines."""

    module: str
    call: int
    leaf: bool
    a: CallRecord
    b: CallRecord
    truth_rel: float  # B's fp64 output against A's; inf when their sizes differ
    departure: float | None  # B's candidate output against A's, relative to A's fp64 norm; None: both non-finite
    limit: float  # what two machines' candidate outputs may differ by here
    carried: float = 0.0  # the largest difference between B and A carried in (earlier rows' departures)
    basis: str = "floor"  # what set the limit: "floor", "carried difference" or "carried error"

    @property
    def same_computation(self) -> bool:
        return self.truth_rel <= FP64_AGREE

    @property
    def departs(self) -> bool:
        return self.departure is not None and (math.isinf(self.departure) or self.departure > self.limit)

    @property
    def ratio(self) -> float | None:
        if self.departure is None:
            return None
        return math.inf if math.isinf(self.departure) else self.departure / self.limit

    @property
    def alone_agrees(self) -> bool:
        """B's module fed the fp64 inputs stays within what A's did: its own ops do not depart."""
        a, b = self.a.isolated, self.b.isolated
        if a is None or b is None or math.isinf(b):
            return False
        return b <= DIVERGENCE_RATIO * max(self.a.floor, self.b.floor, a)


@dataclass
class UseJudgement:
    """An output of logits judged by what it decides: B's candidate against A's fp64 output (`b`),
    beside A's own candidate (`a`), both with A's floors; `rows` of the output, `decided` of them
    judged by top-1 and top-5, `kept` of those by KL."""

    a: Decisions
    b: Decisions
    rows: int
    kept: int

    @property
    def changed(self) -> bool:
        """B's candidate changes far more decisions than rounding A's fp64 output does."""
        return self.b.changed

    @property
    def departs(self) -> bool:
        """B's candidate also changes far more decisions than A's did: the machine departs."""
        flipped = 1.0 - self.b.top1
        most = max(1.0 - self.a.top1, 1.0 - self.b.floor_top1, 1.0 / self.b.rows)
        return flipped >= DECISION_SHARE and flipped >= DECISION_RATIO * most

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a.to_dict(), "b": self.b.to_dict(), "rows": self.rows, "kept_rows": self.kept,
                "changed": self.changed, "departs": self.departs}  # fmt: skip


def judge_use(a: DecisionRecord, b: DecisionRecord) -> UseJudgement | str:
    """B's decisions and A's, each against A's fp64 output; a string says why they cannot be."""
    if (a.rows, a.classes) != (b.rows, b.classes):
        return f"the logits are {b.rows} rows of {b.classes} here, {a.rows} of {a.classes} in the record"

    def against_a(x: DecisionRecord) -> Decisions:
        best = a.truth_top1
        return Decisions(
            source=a.source, rows=a.decided, classes=a.classes,
            top1=float((x.candidate_top1 == best).double().mean()),
            top5=float((x.candidate_topk == best[:, None]).any(-1).double().mean()),
            kl=kl(a.truth_rows, x.candidate_rows), floor_top1=a.floor_top1, floor_kl=a.floor_kl,
        )  # fmt: skip

    return UseJudgement(against_a(a), against_a(b), rows=a.rows, kept=a.kept)


@dataclass
class SetJudgement:
    index: int
    a_inputs: dict[str, Any] | None
    b_inputs: dict[str, Any] | None
    inputs_match: bool = True
    noise_match: bool = True
    rows: list[Row] = field(default_factory=list)
    only_a: list[tuple[str, int]] = field(default_factory=list)  # module calls B did not make
    only_b: list[tuple[str, int]] = field(default_factory=list)
    parted: Row | None = None  # the first module call whose fp64 outputs differ
    parted_by_weights: list[str] = field(default_factory=list)  # the modules with changed weights that explain it
    departure: Row | None = None  # the first departing module call before `parted`
    blamed: str | None = None  # the module named for it (its parent when it came with its inputs)
    use: UseJudgement | None = None  # the output of logits judged by what it decides
    use_missing: str | None = None  # why an output of logits was not judged by what it decides

    @property
    def judged(self) -> bool:
        return self.inputs_match and self.noise_match and self.a_inputs is not None and self.b_inputs is not None

    def departing(self) -> list[Row]:
        """Every departing row up to where the computations part."""
        end = self.rows.index(self.parted) if self.parted is not None else len(self.rows)
        return [r for r in self.rows[:end] if r.departs]


@dataclass
class Judgement:
    a: CompareRecord
    b: CompareRecord
    sets: list[SetJudgement]
    weights_differ: list[str]
    weights_only_a: list[str]
    weights_only_b: list[str]
    facts_differ: list[str]
    # what `fpdoctor env --diff` finds between the two recorded machines: the differences of its
    # table, then the environment verdicts that fire on one side only
    env_differences: list[dict[str, Any]] = field(default_factory=list)
    env_verdicts: list[dict[str, Any]] = field(default_factory=list)


def judge(a: CompareRecord, b: CompareRecord) -> Judgement:
    """B's run (`b`) against A's record (`a`); see the module docstring for each test."""
    weights_differ = [m for m in a.weights if m in b.weights and a.weights[m] != b.weights[m]]
    sets = []
    for k in range(max(len(a.sets), len(b.sets))):
        sa = a.sets[k] if k < len(a.sets) else None
        sb = b.sets[k] if k < len(b.sets) else None
        one = SetJudgement(k, None if sa is None else sa.inputs, None if sb is None else sb.inputs)
        sets.append(one)
        if sa is None or sb is None:
            continue
        one.inputs_match = sa.inputs["digest"] == sb.inputs["digest"]
        one.noise_match = sa.noise == sb.noise
        if one.judged:
            _judge_set(one, sa.calls, sb.calls, weights_differ)
            _judge_decisions(one, a, sa, sb)
    return Judgement(
        a,
        b,
        sets,
        weights_differ,
        sorted(a.weights.keys() - b.weights.keys()),
        sorted(b.weights.keys() - a.weights.keys()),
        machine.differing(a.machine, b.machine),
        *environment(a.machine, b.machine),
    )


# A record's machine key -> its place in the environment facts (`fpdoctor env --save-facts`).
_FLAGS = {
    "tf32_matmul": "matmul_allow_tf32",
    "tf32_cudnn": "cudnn_allow_tf32",
    "float32_matmul_precision": "float32_matmul_precision",
    "fp16_reduction": "fp16_reduced_precision_reduction",
    "bf16_reduction": "bf16_reduced_precision_reduction",
    "deterministic": "deterministic_algorithms",
}
ENV_PREFIX = "env:"  # a recorded environment variable (recording.py); None: known to be unset


def env_facts(recorded: dict[str, Any]) -> dict[str, Any]:
    """A record's machine facts as environment facts, for the table of `fpdoctor env --diff`."""
    from fpdoctor.env.facts import SCHEMA

    variables = {k[len(ENV_PREFIX) :]: v for k, v in recorded.items() if k.startswith(ENV_PREFIX)}
    cublas = recorded.get("cublas")
    return {
        "schema": SCHEMA,
        # the variables a record names are every one of the table's, set or not: absent means unset
        "origin": {"kind": "record", "env_complete": bool(variables)},
        "torch": {
            "import": "ok",
            **{k: recorded.get(k) for k in ("cuda", "hip", "cudnn")},
            "version": recorded.get("torch"),
            "precision": {name: recorded[key] for key, name in _FLAGS.items() if recorded.get(key) is not None},
        },
        "gpus": [{"name": recorded["gpu"], "compute_capability": recorded.get("capability")}]
        if recorded.get("gpu")
        else [],
        "driver": {"version": recorded["driver"]} if recorded.get("driver") else None,
        "libraries": {
            "wheels": [],
            "copies": [],
            "loaded": [{"library": "cublas", "path": "(the recorded process)", "version": cublas}] if cublas else None,
            "loaded_known": ["cublas", "cudnn"],  # the only libraries a record reads from the process
        },
        "env": {k: str(v) for k, v in variables.items() if v is not None},
    }


def environment(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The environment differences between two records' machines (the table of `env --diff`),
    and the environment verdicts that fire on one side only."""
    from fpdoctor.env.diff import diff_env

    data = diff_env(env_facts(a), env_facts(b)).data
    return data["differences"], data["verdicts"]


def _judge_set(one: SetJudgement, a_calls: tuple[CallRecord, ...], b_calls: tuple[CallRecord, ...],
               weights_differ: list[str]) -> None:  # fmt: skip
    by_key = {(c.module, c.call): c for c in a_calls}
    b_keys = {(c.module, c.call) for c in b_calls}
    one.only_a = [(c.module, c.call) for c in a_calls if (c.module, c.call) not in b_keys]
    carried = 0.0  # the largest finite difference between B's and A's outputs so far
    for cb in b_calls:  # B's post-order
        ca = by_key.get((cb.module, cb.call))
        if ca is None:
            one.only_b.append((cb.module, cb.call))
            continue
        row = _row(ca, cb, carried)
        one.rows.append(row)
        if row.departure is not None and math.isfinite(row.departure):
            carried = max(carried, row.departure)
        if one.parted is None and not row.same_computation:
            one.parted = row
            one.parted_by_weights = [w for w in weights_differ if _related(w, row.module)]
        if one.parted is None and one.departure is None and row.departs:
            one.departure = row
    if one.departure is not None:
        one.blamed = _blame(one.departure, one.rows)


def _judge_decisions(one: SetJudgement, a: CompareRecord, sa: SetRecord, sb: SetRecord) -> None:
    """The output judged by what it decides, where it is logits on either machine (see `use`)."""
    da, db = sa.decisions, sb.decisions
    if db is None and da is None:
        return  # not logits (a format-1 record: B's run says whether they are)
    if a.version < 2:
        one.use_missing = (
            f"the record is of format {a.version} (made by fpdoctor {a.fpdoctor}), which keeps at most {SAMPLE} "
            "values of an output and not the class each of its rows picks; make the record again with this "
            "fpdoctor to judge top-1 agreement and KL against machine A"
        )
    elif isinstance(da, str):
        one.use_missing = f"the record keeps no decisions of the logits: on machine A {da}"
    elif isinstance(db, str):
        one.use_missing = f"on this machine {db}"
    elif da is None or db is None:
        one.use_missing = f"the output is logits on machine {'B' if da is None else 'A'} only"
    elif one.parted is not None:
        one.use_missing = (
            f"the fp64 outputs part at `{one.parted.module or '<root>'}`, so A's fp64 output is not this run's referee"
        )
    else:
        judged = judge_use(da, db)
        if isinstance(judged, str):
            one.use_missing = judged
        else:
            one.use = judged


def _row(a: CallRecord, b: CallRecord, carried_difference: float = 0.0) -> Row:
    same_size = a.truth.numel() == b.truth.numel()
    truth_rel = rel_error(b.truth, a.truth, a.norm) if same_size else math.inf
    a_bad, b_bad = a.nonfinite > 0, b.nonfinite > 0
    departure: float | None
    if a_bad and b_bad:
        departure = None  # both runs failed here: no departure of one from the other
    elif a_bad or b_bad or not same_size:
        departure = math.inf
    else:
        departure = rel_error(b.candidate.double(), a.candidate.double(), a.norm)
    floor = DIVERGENCE_RATIO * max(a.floor, b.floor, 1e-300)
    row = Row(a.module, a.call, a.leaf, a, b, truth_rel, departure, floor, carried_difference)
    if row.alone_agrees:  # its own computation agrees: what it was fed may have grown in it
        carried = min(a.propagated, b.propagated)
        grown = DIVERGENCE_RATIO * (carried if math.isfinite(carried) else 0.0)
        if grown > row.limit:
            row.limit, row.basis = grown, "carried error"
    if MOVES * carried_difference > row.limit:
        row.limit, row.basis = MOVES * carried_difference, "carried difference"
    return row


def _related(weights_at: str, module: str) -> bool:
    """Changed weights at `weights_at` explain a different output of `module`: they are its own,
    a module's inside it, or a container's around it (whose own parameters may feed it)."""
    inside = weights_at == module or weights_at.startswith(f"{module}.") or not module
    around = not weights_at or module.startswith(f"{weights_at}.")
    return inside or around


def _blame(row: Row, rows: list[Row]) -> str:
    """The module named for a departure: the row's, or for a leaf that departs only through its
    inputs, the nearest container above it that both runs judged (its own ops made them)."""
    if not row.leaf or not row.alone_agrees:
        return row.module
    names = {r.module for r in rows}
    parts = row.module.split(".")
    for k in range(len(parts) - 1, -1, -1):
        parent = ".".join(parts[:k])
        if parent in names:
            return parent
    return row.module
