"""Machine B's compare report, judged against machine A's record: findings, the A vs B facts,
and the per-module table with both machines' errors side by side (against.py judges)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from fpdoctor import catalog
from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.decide import pct
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import sqnr_db
from fpdoctor.precision.profile import DIVERGENCE_RATIO, TABLE_ROWS, known
from fpdoctor.precision.record import against as judging
from fpdoctor.precision.record import machine
from fpdoctor.precision.record.against import FP64_AGREE, Judgement, Row, SetJudgement, UseJudgement
from fpdoctor.report.model import Finding, Report, Trial

LISTED = 10  # modules a message names before "and N more" (JSON keeps them all)


def apply(report: Report, j: Judgement, *, source: str) -> None:
    """Add the judgement to B's own compare report."""
    report.findings.extend(findings(j))
    _decisions_changed(report, j)
    data = report.data
    data["against"] = as_data(j, source)
    shown = _shown_set(j)
    if shown is not None:
        data["table"] = table(shown, several=len(j.sets) > 1)
    data["summary"][1:1] = summary(j, source) + _use_lines(j)
    # the lines after it are this machine's own compare against fp64, not a comparison with A
    data["summary"] = [
        (f"{key} (B against fp64)", value) if key in ("modules compared", "first divergent module") else (key, value)
        for key, value in data["summary"]
    ]


# -- findings -------------------------------------------------------------------------------------


def findings(j: Judgement) -> list[Finding]:
    found = _departures(j)
    inputs = _inputs_differ(j)
    if inputs is not None:
        found.append(inputs)
    if j.weights_differ or j.weights_only_a or j.weights_only_b:
        found.append(_weights_differ(j))
    found.extend(_computation_differs(j))
    return found


def _departures(j: Judgement) -> list[Finding]:
    found: list[Finding] = []
    named: set[str] = set()
    candidate = j.a.settings.candidate
    for s in j.sets:
        row = s.departure
        if row is None or s.blamed is None or s.blamed in named:
            continue
        named.add(s.blamed)
        through = s.blamed != row.module
        # the numbers of the module named: the container's own row when the departure came through it
        # (in post-order the container's call ends after the departing one inside it)
        after = s.rows[s.rows.index(row) :]
        shown = next((r for r in after if r.module == s.blamed), row) if through else row
        if row.departure is not None and math.isinf(row.departure):
            side = "machine B" if row.b.nonfinite else "machine A"
            how = f"NaN/Inf on {side} only ({row.a.nonfinite} on A, {row.b.nonfinite} on B)"
        elif row.basis == "floor" and not known(max(row.a.floor, row.b.floor)):
            how = (
                f"B's output differs from A's by {_fmt(row.departure)} relative to the fp64 output, where the noise "
                "floor is unknown (the fp64 output does not fit the format and no reference error was measured)"
            )
        else:
            how = (
                f"B's output differs from A's by {_fmt(row.departure)} relative to the fp64 output, "
                f"{row.ratio:.0f}x the limit of {row.limit:.2g} ({_basis(row)})"
            )
        at = f"at `{s.blamed or '<root>'}`"
        if through:
            at += (
                f", in its own ops (outside its submodules): `{row.module}` inside it departs only through its "
                "inputs (fed the fp64 inputs, B's copy of it stays within A's error)"
            )
        where_set = f" (input set #{s.index})" if len(j.sets) > 1 else ""
        message = (
            f"On this machine (B: {machine.name(j.b.machine)}), the {candidate} run departs from the record's "
            f"(A: {machine.name(j.a.machine)}) {at}{where_set}: {how}, while every module before it agreed. "
            f"Against fp64 there, A's error is {_fmt(shown.a.propagated)} and B's {_fmt(shown.b.propagated)}"
            + (
                f"; by itself (fed the fp64 inputs) A's adds {_fmt(shown.a.isolated)}, B's {_fmt(shown.b.isolated)}"
                if shown.a.isolated is not None and shown.b.isolated is not None
                else ""
            )
            + "."
            + _facts_sentence(j)
        )
        evidence: dict[str, Any] = {
            "kind": _kind(row),
            "count": len(s.departing()),
            "numel": shown.b.numel,
            "dtype": str(compute_dtype(candidate)),
            "candidate": candidate,
            # where the departure was first seen, when that is a module inside the one named
            "departing_module": row.module if through else None,
            "departure_rel": row.departure,
            "limit_rel": row.limit if row.basis != "floor" or known(max(row.a.floor, row.b.floor)) else None,
            "limit_basis": row.basis,
            "floor_rel": max(row.a.floor, row.b.floor) if known(max(row.a.floor, row.b.floor)) else None,
            # the module named, on each machine
            "a_propagated_rel": shown.a.propagated,
            "b_propagated_rel": shown.b.propagated,
            "a_isolated_rel": shown.a.isolated,
            "b_isolated_rel": shown.b.isolated,
            "a_nonfinite": shown.a.nonfinite,
            "b_nonfinite": shown.b.nonfinite,
            "machine_a": machine.name(j.a.machine),
            "machine_b": machine.name(j.b.machine),
            "facts_differ": j.facts_differ,
            # beside the module: what `fpdoctor env --diff` finds between the two machines
            "env_differences": [_env_evidence(d) for d in j.env_differences],
            "env_verdicts": j.env_verdicts or None,
            "input_set": s.index if len(j.sets) > 1 else None,
        }
        found.append(
            catalog.make(
                "machine-departure",
                message=message,
                where={"module": s.blamed, "op": None, "phase": "forward", "iteration": shown.call},
                evidence=evidence,
                fix=_departure_fix(j, s.blamed, row),
            )
        )
    return found


def _basis(row: Row) -> str:
    """What the departure's limit is made of, in words."""
    if row.basis == "carried error":
        return (
            f"{DIVERGENCE_RATIO:.0f}x the error both runs carried in: by itself this module agrees on both machines, "
            "and it may grow what it is fed"
        )
    if row.basis == "carried difference":
        return f"{judging.MOVES:.2g}x the largest difference between A and B carried in, {row.carried:.2g}"
    return (
        f"{DIVERGENCE_RATIO:.0f}x the noise floor; the error both runs carried in against fp64 is the same on "
        "both machines and is no allowance"
    )


def _kind(row: Row) -> str:
    """The finding's kind: `nan`, `+inf` or `-inf` from the side that has them, else "departure"."""
    bad = row.b if row.b.nonfinite else row.a if row.a.nonfinite else None
    if bad is None:
        return "departure"
    values = bad.candidate
    if bool(values.isnan().any()):
        return "nan"
    if bool((values == math.inf).any()):
        return "+inf"
    if bool((values == -math.inf).any()):
        return "-inf"
    return "nonfinite"  # every non-finite value fell between the sampled ones


def _departure_fix(j: Judgement, module: str, row: Row) -> str:
    candidate = j.a.settings.candidate
    where = f"`{module}`" if module else "the whole model's own ops"
    fixes = [
        f"keep {where} in fp32 on this machine (`fpdoctor plan MODEL --candidate {candidate}` here finds the "
        "smallest such set and verifies it)"
        if candidate != "fp32"
        else f"compute {where} without TF32 or reduced-precision reductions on this machine"
    ]
    a, b = j.a.machine, j.b.machine
    lines = []
    for key in j.facts_differ:
        if key not in machine.FLAG_FIXES:
            continue
        looser = b.get(key) is True or (key == "float32_matmul_precision" and b.get(key) not in (None, "highest"))
        if looser:
            lines.append(machine.FLAG_FIXES[key])
    if lines:
        fixes.append("set the precision flags as on machine A: " + "; ".join(lines))
    other = [k for k in j.facts_differ if k not in machine.FLAG_FIXES and k != "platform"
             and not k.startswith(judging.ENV_PREFIX)]  # fmt: skip
    variables = [d for d in j.env_differences if d["key"].startswith("env.")]
    if variables:
        lines = [f"unset {d['label']}" if d["a"] == "unset" else f"export {d['label']}={d['a']}" for d in variables]
        fixes.append("set the environment variables as on machine A: " + "; ".join(lines))
    if other:
        listed = ", ".join(f"{machine.LABELS.get(k, k)} {machine.show(a.get(k))} / {machine.show(b.get(k))}"
                           for k in other[:4])  # fmt: skip
        fixes.append(f"compare what differs between A and B ({listed}): `fpdoctor env` on both machines")
    if candidate in ("fp16", "fp16-accumulate") and (row.a.nonfinite or row.b.nonfinite):
        fixes.append("or use bf16, which has fp32's range")
    return "; ".join(fixes)


# Record keys the environment table (`fpdoctor env --diff`) judges; the other recorded facts
# (SM count, CPU, threads, Python, the fp8 kernel) are listed as they are.
_IN_TABLE = {
    "gpu", "capability", "driver", "torch", "cuda", "hip", "cudnn", "cublas", "tf32_matmul", "tf32_cudnn",
    "float32_matmul_precision", "fp16_reduction", "bf16_reduction", "deterministic",
}  # fmt: skip
ENV_SHOWN = 6  # environment differences a message lists (the evidence keeps them all)


def _env_evidence(d: dict[str, Any]) -> dict[str, Any]:
    return {k: d[k] for k in ("key", "label", "a", "b", "severity", "effect", "source")}


def _other_facts(j: Judgement) -> list[str]:
    return [k for k in j.facts_differ if k not in _IN_TABLE and not k.startswith(judging.ENV_PREFIX)]


def _facts_sentence(j: Judgement) -> str:
    parts = []
    if j.env_verdicts:
        parts.append(
            " On one machine only, the environment rules find: "
            + "; ".join(f"{v['verdict']} ({v['verdict_severity']}) on {v['side']}" for v in j.env_verdicts)
            + "."
        )
    if j.env_differences:
        listed = "; ".join(
            f"{d['label']} {machine.show(d['a'])} / {machine.show(d['b'])} ({d['severity']})"
            for d in j.env_differences[:ENV_SHOWN]
        )
        more = len(j.env_differences) - ENV_SHOWN
        parts.append(
            f" Environment differences that can change a result (A / B): {listed}"
            + (f"; and {more} more (evidence.env_differences)" if more > 0 else "")
            + "."
        )
    shown = [k for k in _other_facts(j) if k != "platform"][:5]
    if shown:
        listed = "; ".join(
            f"{machine.LABELS.get(k, k)} {machine.show(j.a.machine.get(k))} / {machine.show(j.b.machine.get(k))}"
            for k in shown
        )
        parts.append(f" Other recorded facts that differ (A / B): {listed}.")
    if not parts:
        same = "apart from the device" if j.facts_differ else "all of them"
        return f" The two machines' recorded facts are the same ({same})."
    return "".join(parts)


def _inputs_differ(j: Judgement) -> Finding | None:
    parts: list[str] = []
    sets: list[int] = []
    n_a, n_b = len(j.a.sets), len(j.b.sets)
    if n_a != n_b:
        parts.append(f"the record has {n_a} input set(s), this run {n_b}")
    for s in j.sets:
        if s.a_inputs is None or s.b_inputs is None:
            sets.append(s.index)
            continue
        if not s.inputs_match:
            sets.append(s.index)
            parts.append(f"input set #{s.index}: A {inputs_text(s.a_inputs)}, B {inputs_text(s.b_inputs)}")
        elif not s.noise_match:
            sets.append(s.index)
            parts.append(
                f"input set #{s.index}: the random numbers the forward draws itself differ (A "
                f"{j.a.sets[s.index].noise or 'none'}, B {j.b.sets[s.index].noise or 'none'})"
            )
    if not parts:
        return None
    return catalog.make(
        "reference-inputs-differ",
        message=(
            "The two runs did not see the same inputs: " + "; ".join(parts) + ". Those input sets were not compared "
            "module by module."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={
            "kind": "inputs",
            "count": len(sets),
            "input_sets": sets,
            "a_digests": [s.inputs["digest"] for s in j.a.sets],
            "b_digests": [s.inputs["digest"] for s in j.b.sets],
        },
    )


def _weights_differ(j: Judgement) -> Finding:
    listed = j.weights_differ
    parts = []
    if listed:
        names = ", ".join(f"`{m or '<root>'}`" for m in listed[:LISTED])
        more = f" and {len(listed) - LISTED} more" if len(listed) > LISTED else ""
        parts.append(f"The weights differ at {names}{more}: their own parameters or buffers are not the record's")
    for side, only in (("machine A", j.weights_only_a), ("machine B", j.weights_only_b)):
        if only:
            parts.append(f"only {side} has weights at " + ", ".join(f"`{m}`" for m in only[:LISTED]))
    parted = [s.parted.module for s in j.sets if s.parted is not None and s.parted_by_weights]
    if parted:
        parts.append(f"the fp64 outputs part first at `{parted[0] or '<root>'}`, which they explain")
    first = (listed or j.weights_only_a or j.weights_only_b)[0]
    message = "; ".join(parts) + "."
    return catalog.make(
        "reference-weights-differ",
        message=message[0].upper() + message[1:],
        where={"module": first, "op": None, "phase": "forward"},
        evidence={
            "kind": "weights",
            "count": len(listed),
            "modules": listed,
            "only_a": j.weights_only_a or None,
            "only_b": j.weights_only_b or None,
            "a_digests": {m: j.a.weights[m] for m in listed[:LISTED]},
            "b_digests": {m: j.b.weights[m] for m in listed[:LISTED]},
        },
    )


def _computation_differs(j: Judgement) -> list[Finding]:
    found: list[Finding] = []
    named: set[str] = set()
    versions = [k for k in ("torch", "cuda", "cudnn", "cublas", "python") if k in j.facts_differ]
    libraries = (
        " (" + "; ".join(f"{machine.LABELS[k]} {j.a.machine.get(k)} / {j.b.machine.get(k)}" for k in versions) + ")"
        if versions
        else ""
    )
    for s in j.sets:
        row = s.parted
        if row is None or s.parted_by_weights or row.module in named:
            continue
        named.add(row.module)
        if row.a.truth.numel() != row.b.truth.numel():
            how = f"its output has another size ({row.a.numel} values on A, {row.b.numel} on B)"
        else:
            how = (
                f"its fp64 output differs from A's by {row.truth_rel:.3g} relative (fp64 on two machines agrees to "
                f"about 1e-12; the limit is {FP64_AGREE:g})"
            )
        where_set = f" (input set #{s.index})" if len(j.sets) > 1 else ""
        found.append(
            catalog.make(
                "reference-computation-differs",
                message=(
                    f"`{row.module or '<root>'}` computes something else than on machine A{where_set}: {how}, while "
                    "every module before it agreed and its weights are the same. Its code or configuration changed"
                    f"{_or_parent(row.module)}, or an op's definition changed between the two machines' "
                    f"libraries{libraries}. Modules after it were not compared for departures."
                ),
                where={"module": row.module, "op": None, "phase": "forward", "iteration": row.call},
                evidence={
                    "kind": "computation",
                    "count": 1,
                    "numel": row.b.numel,
                    "fp64_rel": row.truth_rel,
                    "fp64_agree": FP64_AGREE,
                    "input_set": s.index if len(j.sets) > 1 else None,
                },
            )
        )
    only_a = sorted({m for s in j.sets for m, _ in s.only_a})
    only_b = sorted({m for s in j.sets for m, _ in s.only_b})
    if only_a or only_b:
        parts = [
            f"only machine {side} runs " + ", ".join(f"`{m or '<root>'}`" for m in only[:LISTED])
            + (f" and {len(only) - LISTED} more" if len(only) > LISTED else "")
            for side, only in (("A", only_a), ("B", only_b))
            if only
        ]  # fmt: skip
        found.append(
            catalog.make(
                "reference-computation-differs",
                title="The two runs do not call the same modules",
                message="The model is not built the same on both machines: " + "; ".join(parts) + ".",
                where={"module": (only_a or only_b)[0], "op": None, "phase": "forward"},
                evidence={"kind": "structure", "count": len(only_a) + len(only_b), "only_a": only_a, "only_b": only_b},
            )
        )
    return found


# -- summary, table and data -------------------------------------------------------------------


def summary(j: Judgement, source: str) -> list[tuple[str, str]]:
    a, b = j.a.machine, j.b.machine
    lines = [
        ("against", f"{source}: made {j.a.created or 'at an unknown time'} by fpdoctor {j.a.fpdoctor}, "
                    f"{j.a.calls} module calls"),
        ("machine A / B", f"{machine.name(a)} / {machine.name(b)} (this machine)"),
    ]  # fmt: skip
    for key in j.facts_differ:
        if key in ("gpu", "capability") or (key == "cpu" and not a.get("gpu")):
            continue  # in the line above
        both = f"{machine.show(a.get(key))} / {machine.show(b.get(key))}"
        lines.append((f"A / B: {machine.LABELS.get(key, key)}", both))
    lines.append(("B against A", _verdict(j)))
    return lines


def _verdict(j: Judgement) -> str:
    judged = [s for s in j.sets if s.judged]
    if not judged:
        return "not compared: the two runs did not see the same inputs"
    first = next((s for s in judged if s.departure is not None), None)
    parted = next((s for s in judged if s.parted is not None), None)
    calls = sum(len(s.rows) for s in judged)
    if first is not None and first.departure is not None:
        row = first.departure
        nonfinite = row.ratio is not None and math.isinf(row.ratio)
        how = "NaN/Inf on one machine only" if nonfinite else f"{row.ratio:.0f}x the limit"
        text = f"departs first at `{first.blamed or '<root>'}` ({how})"
    elif parted is not None and parted.parted is not None:
        why = "weights differ" if parted.parted_by_weights else "computes something else"
        text = f"the computations part at `{parted.parted.module or '<root>'}` ({why}); no departure before it"
    else:
        text = f"no module departs beyond the noise floor ({calls} module calls compared)"
    decided = next((s for s in judged if s.use is not None and s.use.departs), None)
    if decided is not None and decided.use is not None:
        u = decided.use
        text += (
            f"; its decisions depart from A's: top-1 agreement with A's fp64 output {pct(u.b.top1)} here, "
            f"{pct(u.a.top1)} in A's run"
        )
    if len(judged) < len(j.sets):
        text += f"; {len(j.sets) - len(judged)} input set(s) not compared (other inputs)"
    return text


def _use_text(u: UseJudgement, candidate: str) -> str:
    a, b = u.a, u.b
    rows = f"{b.rows} rows" if b.rows == u.rows else f"{b.rows} of {u.rows} rows (evenly spread)"
    kept = f"{u.kept} of those rows" if u.kept < b.rows else "the same rows"
    return (
        f"this machine's top-1 agreement {pct(b.top1)}, A's run {pct(a.top1)} (rounding A's fp64 output to "
        f"{candidate}: {pct(b.floor_top1)}); top-5 {pct(b.top5)} / {pct(a.top5)} over {rows} of {b.classes}; "
        f"KL {b.kl:.3g} / {a.kl:.3g} nats (rounding: {b.floor_kl:.3g}) over {kept}"
    )


def _use_lines(j: Judgement) -> list[tuple[str, str]]:
    """Per judged input set with an output of logits: both machines' decisions against A's fp64."""
    lines = []
    for s in j.sets:
        if s.use is None and s.use_missing is None:
            continue
        key = "decisions against A's fp64" + (f", input set #{s.index}" if len(j.sets) > 1 else "")
        if s.use is not None:
            lines.append((key, f"{s.use.b.source}: {_use_text(s.use, j.a.settings.candidate)}"))
        else:
            lines.append((key, f"not judged: {s.use_missing}"))
    return lines


def _decisions_changed(report: Report, j: Judgement) -> None:
    """`decisions-changed` where this run's candidate changes the decisions against A's fp64 output.
    This run's own compare judged them against its own fp64 output, which is A's where nothing
    parted: where it found them changed too, its finding (with its checked fix) gets A's figures;
    else one is added, its fix untried here."""
    changed = [s for s in j.sets if s.use is not None and s.use.changed]
    if not changed:
        return
    s = changed[0]
    u = s.use
    assert u is not None
    candidate = j.a.settings.candidate
    where_set = f" (input set #{s.index})" if len(j.sets) > 1 else ""
    a_run = (
        f"A's run keeps them ({pct(u.a.top1)}): this machine's {candidate} kernels change them, not the format"
        if u.departs
        else f"A's run changes them as well ({pct(u.a.top1)}): the {candidate} computation does, on both machines"
    )
    sentence = (
        f"Against the record's fp64 output (machine A{where_set}), this machine's top-1 agreement is "
        f"{pct(u.b.top1)} (rounding A's fp64 output to {candidate}: {pct(u.b.floor_top1)}); {a_run}."
    )
    evidence = {"against": u.to_dict() | ({"input_set": s.index} if len(j.sets) > 1 else {})}
    for k, f in enumerate(report.findings):
        if f.name == "decisions-changed":
            report.findings[k] = dataclasses.replace(
                f, message=f"{f.message} {sentence}", evidence=dict(f.evidence) | evidence
            )
            return
    flipped, floor = 1.0 - u.b.top1, 1.0 - u.b.floor_top1
    against = (
        f"{flipped / floor:.0f}x what rounding A's fp64 output to {candidate} changes ({pct(floor)})"
        if floor > 0
        else f"where rounding A's fp64 output to {candidate} changes none"
    )
    report.findings.append(
        catalog.make(
            "decisions-changed",
            message=(
                f"In {candidate}, this machine's output's top-1 class differs from the record's fp64 output on "
                f"{pct(flipped)} of its {u.b.rows} rows{where_set}, {against}: the computation changes the "
                f"decisions, whatever its relative error (KL {u.b.kl:.3g} nats). {a_run[0].upper()}{a_run[1:]}."
            ),
            where={"module": _head(u), "op": None},
            evidence={"decisions": u.b.to_dict(), **evidence},
            trial=Trial.untried(
                "this run's own compare, against its own fp64 output, did not find the decisions changed, so no "
                "module was re-run in fp32 here; `fpdoctor plan` on this machine checks a fix by top-1 agreement"
            ),
        )
    )


def _head(u: UseJudgement) -> str | None:
    """The module whose output the logits are, from how the report names them (use.logits_source)."""
    source = u.b.source
    if "`" not in source:
        return ""
    return source.split("`")[1]


def _or_parent(module: str) -> str:
    """A module's inputs come from its parent's own code too (the ops a container's forward runs
    between its children): where the change may be besides the module itself."""
    parent = module.rpartition(".")[0] if module else None
    if parent is None:
        return ""
    return f", or the code of `{parent or '<root>'}` that runs before it and makes its inputs"


def _shown_set(j: Judgement) -> SetJudgement | None:
    judged = [s for s in j.sets if s.judged and s.rows]
    for pick in (lambda s: s.departure is not None, lambda s: s.parted is not None, lambda s: True):
        found = next((s for s in judged if pick(s)), None)
        if found is not None:
            return found
    return None


def table(s: SetJudgement, *, several: bool) -> dict[str, Any]:
    """Per module, in model order: both machines' SQNR against fp64, and how far B is from A."""
    rows = s.rows
    title = "SQNR against fp64 in dB per module, in model order; A: the record's machine, B: this one"
    if several:
        title += f", input set #{s.index}"
    end = rows.index(s.parted) if s.parted is not None else len(rows)
    if len(rows) > TABLE_ROWS:
        keep = {len(rows) - 1}
        keep |= {rows.index(r) for r in (s.departure, s.parted) if r is not None}
        ranked = sorted(range(end), key=lambda k: -(rows[k].ratio or 0.0))
        keep |= set(ranked[: TABLE_ROWS - len(keep)])
        rows = [rows[k] for k in sorted(keep)]
        title += f"; the {len(rows)} of {len(s.rows)} that depart most (JSON has all)"

    def db(value: float | None) -> str:
        return "-" if value is None else "non-finite" if math.isinf(value) else f"{sqnr_db(value):.1f}"

    def verdict(r: Row) -> str:
        if r is s.parted:
            return "fp64 differs"
        if s.parted is not None and s.rows.index(r) > end:
            return "not judged"
        if r.ratio is None:
            return "non-finite on both"
        unknown = r.basis == "floor" and not known(max(r.a.floor, r.b.floor))
        text = "non-finite" if math.isinf(r.ratio) else "floor unknown" if unknown else f"{r.ratio:.2g}x"
        return text + (" departs" if r.departs else "")

    return {
        "title": title,
        "columns": ["module", "A propagated", "B propagated", "A isolated", "B isolated", "B vs A / limit",
                    "NaN/Inf A/B"],
        "rows": [
            [
                (r.module or "<root>") + (f" #{r.call}" if r.call else ""),
                db(r.a.propagated),
                db(r.b.propagated),
                db(r.a.isolated),
                db(r.b.isolated),
                verdict(r),
                f"{r.a.nonfinite}/{r.b.nonfinite}" if r.a.nonfinite or r.b.nonfinite else "",
            ]
            for r in rows
        ],
    }  # fmt: skip


def as_data(j: Judgement, source: str) -> dict[str, Any]:
    return {
        "record": {
            "source": source, "fpdoctor": j.a.fpdoctor, "created": j.a.created, "format": j.a.version,
            "calls": j.a.calls, "settings": vars(j.a.settings),
        },
        "machines": {"a": j.a.machine, "b": j.b.machine, "differ": j.facts_differ},
        "environment": {"differences": j.env_differences, "verdicts": j.env_verdicts},
        "fp64_agree": FP64_AGREE,
        "divergence_ratio": DIVERGENCE_RATIO,
        "weights_differ": j.weights_differ,
        "weights_only_a": j.weights_only_a,
        "weights_only_b": j.weights_only_b,
        "sets": [_set_data(s) for s in j.sets],
    }  # fmt: skip


def _set_data(s: SetJudgement) -> dict[str, Any]:
    return {
        "set": s.index,
        "judged": s.judged,
        "inputs_match": s.inputs_match,
        "noise_match": s.noise_match,
        "a_digest": None if s.a_inputs is None else s.a_inputs["digest"],
        "b_digest": None if s.b_inputs is None else s.b_inputs["digest"],
        "first_departure": s.blamed,
        "departing_call": None if s.departure is None else {"module": s.departure.module, "call": s.departure.call},
        "computation_differs_at": None if s.parted is None else {"module": s.parted.module, "call": s.parted.call},
        "explained_by_weights": s.parted_by_weights,
        "only_a": [list(k) for k in s.only_a],
        "only_b": [list(k) for k in s.only_b],
        "decisions": s.use.to_dict() if s.use is not None else None,
        "decisions_not_judged": s.use_missing,
        "modules": [
            {
                "module": r.module or "<root>",
                "call": r.call,
                "leaf": r.leaf,
                "a_propagated_rel": r.a.propagated,
                "b_propagated_rel": r.b.propagated,
                "a_isolated_rel": r.a.isolated,
                "b_isolated_rel": r.b.isolated,
                "departure_rel": r.departure,
                "limit_rel": r.limit,
                "ratio": r.ratio,
                "departs": r.departs,
                "fp64_rel": r.truth_rel,
                "same_computation": r.same_computation,
                "a_nonfinite": r.a.nonfinite,
                "b_nonfinite": r.b.nonfinite,
            }
            for r in s.rows
        ],
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else ("non-finite" if math.isinf(value) else f"{value:.3g}")
