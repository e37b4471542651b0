"""`diff_env(a, b)`: what differs between two machines that can change a result or crash.

Each side is a saved facts file, a collect_env report, a log (whatever `env --from` reads), a
facts dict, or "." for this machine. The environment rules run on each side, and a verdict that
fires on one side only comes first; then one finding per fact of the table (differences.py)
whose values differ. A fact one input does not show is unknown there, never a difference.
Everything else the two differ in is counted in one line, never shown (it changes no number,
and may be a secret). Never imports torch, except through the torch child of a live side.
"""

from __future__ import annotations

import os
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.differences import Entry, Seen, Side, entries
from fpdoctor.env.facts import Facts
from fpdoctor.env.refdata import refdata
from fpdoctor.env.rules import cap_severity, evaluate
from fpdoctor.env.summary import _source, env_value
from fpdoctor.errors import InputError
from fpdoctor.report.model import Finding, Report, Severity
from fpdoctor.report.redact import redact

LIVE = "."
CELL = 24  # characters of a value the table shows (the finding has it whole)
# Parts of a facts dict that describe the input, not the machine.
_NOT_MACHINE = {"schema", "origin", "texts", "not_checked", "missing", "probes", "log"}

# How to make B's value A's, per fact whose setting is a line of Python.
_SETTERS = {
    "flag.matmul_tf32": "torch.backends.cuda.matmul.allow_tf32 = {}",
    "flag.cudnn_tf32": "torch.backends.cudnn.allow_tf32 = {}",
    "flag.float32_matmul_precision": "torch.set_float32_matmul_precision({!r})",
    "flag.fp32_precision": "torch.backends.fp32_precision = {!r}",
    "flag.matmul_fp32_precision": "torch.backends.cuda.matmul.fp32_precision = {!r}",
    "flag.cudnn_fp32_precision": "torch.backends.cudnn.fp32_precision = {!r}",
    "flag.cudnn_conv_fp32_precision": "torch.backends.cudnn.conv.fp32_precision = {!r}",
    "flag.cudnn_rnn_fp32_precision": "torch.backends.cudnn.rnn.fp32_precision = {!r}",
    "flag.fp16_reduction": "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = {}",
    "flag.bf16_reduction": "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = {}",
    "flag.fp16_accumulation": "torch.backends.cuda.matmul.allow_fp16_accumulation = {}",
    "flag.deterministic_algorithms": "torch.use_deterministic_algorithms({})",
    "flag.fill_uninitialized_memory": "torch.utils.deterministic.fill_uninitialized_memory = {}",
    "flag.cudnn_deterministic": "torch.backends.cudnn.deterministic = {}",
    "flag.cudnn_benchmark": "torch.backends.cudnn.benchmark = {}",
    "flag.tunableop": "torch.cuda.tunable.enable({})",
}


def load_side(what: Any, name: str) -> dict[str, Any]:
    """One side's facts: a path (what `env --from` reads), "." for this machine, or a facts dict
    (or a report holding one). Raises InputError for input that is not facts."""
    if isinstance(what, dict):
        from fpdoctor.env.parse import _facts_from_json
        from fpdoctor.env.understand import understand

        return understand(_facts_from_json(what, name))
    if not isinstance(what, (str, os.PathLike)):
        kind = type(what).__name__
        raise InputError(f"{name}: pass a file path, {LIVE!r} for this machine, or a facts dict, not {kind}")
    if os.fspath(what) == LIVE:
        from fpdoctor.env.collect import collect_live

        return collect_live()
    from fpdoctor.env.parse import load

    return load(os.fspath(what))


def diff_env(a: Any, b: Any) -> Report:
    """The differences between machine A and machine B that can change a result or crash.

    `a`, `b`: a saved facts file (`fpdoctor env --save-facts`), a collect_env report or a log, a
    facts dict, or "." for this machine. Raises `fpdoctor.errors.InputError` for input that is not
    facts (a missing or unreadable file, a file that is neither facts, a report nor a log)."""
    raw_a, raw_b = load_side(a, "A"), load_side(b, "B")
    return judge(raw_a, raw_b)


def judge(raw_a: dict[str, Any], raw_b: dict[str, Any]) -> Report:
    """diff_env on two facts dicts already loaded."""
    ref = refdata()
    side_a, side_b = Side(Facts(raw_a), ref), Side(Facts(raw_b), ref)
    findings = verdicts(side_a, side_b)
    differences, unknown = compare(side_a, side_b)
    findings += [_finding(d) for d in differences]
    covered = {p for d in entries(side_a, side_b) for p in _covers(d)}
    left_out = sum(1 for p in _differing(raw_a, raw_b) if not _is_covered(p, covered))
    verdict_rows = [
        [
            f"verdict {f.evidence['verdict']} ({f.evidence['verdict_code']})",
            *(("fires", "-") if f.evidence["side"] == "A" else ("-", "fires")),
            f.severity.value,
        ]
        for f in findings
        if f.name == "verdict-on-one-side"
    ]
    rows = verdict_rows + [
        [d["label"], _cell(d["a"], d["a_inferred"]), _cell(d["b"], d["b_inferred"]), d["severity"]] for d in differences
    ]
    errors = sum(1 for d in differences if d["severity"] == "error")
    not_checked = {label: f"not shown by A's input ({_source(raw_a)})" for label in unknown["a"]}
    not_checked |= {label: f"not shown by B's input ({_source(raw_b)})" for label in unknown["b"]}
    if unknown["both"]:
        not_checked["not shown by either input"] = ", ".join(unknown["both"])
    summary = [
        ("A", _source(raw_a)),
        ("B", _source(raw_b)),
        ("verdicts on one side only", str(len(verdict_rows))),
        ("differences that can change a result or crash", f"{len(differences)} ({errors} error-level)"),
        ("left out", f"{left_out} other differences (hosts, unrelated packages, paths): they change no number"),
    ]
    return Report(
        command="env --diff",
        findings=findings,
        data={
            "inputs": {"a": _source(raw_a), "b": _source(raw_b)},
            "verdicts": [dict(f.evidence) for f in findings if f.name == "verdict-on-one-side"],
            "differences": differences,
            "unknown": unknown,
            "left_out": left_out,
            "summary": summary,
            "table": {
                "title": "What differs between A and B that can change a result or crash (*: inferred, not read)",
                "columns": ["fact", "A", "B", "severity"],
                "rows": rows,
            },
            "not_checked": not_checked,
        },
    )


def verdicts(a: Side, b: Side) -> list[Finding]:
    """The environment rules' verdicts that fire on one side only, A's first."""
    judged = {"A": evaluate(a.facts).findings, "B": evaluate(b.facts).findings}
    keys = {side: {_identity(f) for f in found} for side, found in judged.items()}
    out = []
    for side, other in (("A", "B"), ("B", "A")):
        for f in judged[side]:
            if _identity(f) in keys[other]:
                continue
            out.append(
                catalog.make(
                    "verdict-on-one-side",
                    severity=f.severity,
                    message=f"On {side} only: {f.title}. {f.message}",
                    fix=f.fix,
                    evidence={
                        "side": side,
                        "verdict": f.name,
                        "verdict_code": f.code,
                        "verdict_severity": f.severity.value,
                    },
                    references=f.references,
                )
            )
    return out


def _identity(f: Finding) -> tuple[str, str]:
    """A verdict is the same on both sides when its rule and the known issue it names are."""
    return f.name, str(f.evidence.get("issue") or f.evidence.get("known_issue") or "")


def compare(a: Side, b: Side) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """The table's facts whose values differ, and the facts unknown on A, on B, on both."""
    differences: list[dict[str, Any]] = []
    unknown: dict[str, list[str]] = {"a": [], "b": [], "both": []}
    for entry in entries(a, b):
        va, vb = _read(entry, a), _read(entry, b)
        if va is None or vb is None:
            if va is not None or vb is not None:
                unknown["a" if va is None else "b"].append(entry.label)
            elif not entry.key.startswith("env.") or a.env_known or b.env_known:
                unknown["both"].append(entry.label)
            continue
        if va.value == vb.value:
            continue
        # Redacted here, before a value is shortened for the table (a cut token no longer looks like one).
        secret_key = entry.key[4:] if entry.key.startswith("env.") else None
        va, vb = (Seen(redact(v.value, secret_key), v.inferred) for v in (va, vb))
        inferred = va.inferred or vb.inferred
        severity = cap_severity(entry.severity, "unconfirmed") if inferred else entry.severity
        differences.append(
            {
                "key": entry.key,
                "label": entry.label,
                "group": entry.group,
                "a": va.value,
                "b": vb.value,
                "a_inferred": va.inferred,
                "b_inferred": vb.inferred,
                "severity": severity.value,
                "severity_reason": entry.reason
                + ("" if severity is entry.severity else "; at most a warning here: a value is inferred, not read"),
                "effect": entry.effect,
                "source": entry.source,
            }
        )
    return differences, unknown


def _read(entry: Entry, side: Side) -> Seen | None:
    try:
        return entry.read(side)
    except (KeyError, TypeError, ValueError, AttributeError):  # a hand-edited file: that fact is unknown
        return None


def _shown(value: Any, inferred: str | None) -> str:
    text = env_value(value)
    return f"{text} (inferred: {inferred})" if inferred else text


def _cell(value: Any, inferred: str | None) -> str:
    text = str(value)
    text = text if len(text) <= CELL else text[: CELL - 1] + "…"
    return text + ("*" if inferred else "")


def _finding_name(group: str) -> str:
    """The catalogue entry of a difference in a fact of `group` (differences.Entry.group)."""
    if group == "hardware":
        return "hardware-differs"
    if group == "build":
        return "build-differs"
    if group == "library":
        return "library-differs"
    if group == "flag":
        return "math-flag-differs"
    if group == "startup":
        return "startup-differs"
    return "math-variable-differs"


def _finding(d: dict[str, Any]) -> Finding:
    a, b = _shown(d["a"], d["a_inferred"]), _shown(d["b"], d["b_inferred"])
    return catalog.make(
        _finding_name(d["group"]),
        severity=Severity(d["severity"]),
        message=f"{d['label']}: A {a} / B {b}. {_sentence(d['effect'])} "
        + _sentence("severity: " + d["severity_reason"]),
        where={"fact": d["key"]},
        evidence={k: d[k] for k in ("key", "a", "b", "a_inferred", "b_inferred", "severity_reason", "source")},
        fix=_fix(d),
        references=(d["source"],),
    )


def _fix(d: dict[str, Any]) -> str:
    key, a = d["key"], d["a"]
    if key in _SETTERS:
        return "# on B, as on A (or the other way round), before the results are compared\n" + _SETTERS[key].format(a)
    if d["group"] == "variable":
        name = key[4:]
        line = f"unset {name}" if a == "unset" else f"export {name}={_quoted(str(a))}"
        return f"# on B, as on A (or the other way round), before the run\n{line}"
    if d["group"] == "startup":
        return (
            f"Make the {d['label']} the same on both machines ({a} on A): remove or copy the code that runs at "
            "start-up. `python -I -S` starts without any of it (no site, no PYTHONPATH), to see whether the "
            "result follows it; `fpdoctor env` on each machine lists every hook with its file."
        )
    if d["group"] == "hardware" and key != "driver":
        return (
            "Different GPUs agree only to rounding: compare their results with a tolerance, and "
            "`fpdoctor compare MODEL --against RECORD` on B names the first module that departs from A's record."
        )
    return (
        f"Make the {d['label']} the same on both machines ({a} on A) to tell the software from the machine apart; "
        "`fpdoctor env` on each shows which copy of each library loads."
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")


def _quoted(text: str) -> str:
    return text if text and all(c.isalnum() or c in ":._-,/=" for c in text) else "'" + text.replace("'", "'\\''") + "'"


def _covers(entry: Entry) -> tuple[str, ...]:
    return (*entry.covers, entry.key) if entry.key.startswith("env.") else entry.covers


def _is_covered(path: str, covered: set[str]) -> bool:
    parts = path.split(".")
    return any(".".join(parts[:k]) in covered for k in range(1, len(parts) + 1))


def _differing(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The paths (list positions dropped: "gpus.uuid") of every value that differs between two
    facts dicts, apart from what describes the input rather than the machine."""
    fa = {p: v for p, v in flatten(a) if p.split(".", 1)[0] not in _NOT_MACHINE}
    fb = {p: v for p, v in flatten(b) if p.split(".", 1)[0] not in _NOT_MACHINE}
    return sorted(
        p.split("[", 1)[0] + "".join(s.split("]", 1)[-1] for s in p.split("[")[1:])
        for p in fa.keys() | fb.keys()
        if fa.get(p) != fb.get(p)
    )


def flatten(value: Any, path: str = "") -> list[tuple[str, Any]]:
    """Leaf values by path: "torch.version", "libraries.wheels[nvidia-cublas-cu12].version";
    items of a list of dicts are named by their package, path, index or name, else by position."""
    if isinstance(value, dict):
        out: list[tuple[str, Any]] = []
        for key, item in value.items():
            out += flatten(item, f"{path}.{key}" if path else str(key))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = []
        for i, item in enumerate(value):
            name = next((item[k] for k in ("package", "path", "index", "name") if item.get(k) is not None), i)
            if "tool" in item:
                name = f"{item['tool']}:{name}"
            out += flatten(item, f"{path}[{name}]")
        return out
    if isinstance(value, list):
        return [(path, tuple(sorted(map(str, value))))]
    return [(path, value)]
