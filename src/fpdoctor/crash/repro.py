"""`fpdoctor run --breadcrumbs --repro DIR`: a reproducer of the op a process had in flight when a
fatal signal killed it, written from its breadcrumbs (numerics/trace/repro.py writes it).

The breadcrumbs keep shapes, dtypes and the device of the first four tensor arguments, not their
values nor the scalar arguments: the reproducer calls the op with seeded values and the scalars
at their defaults, which is what a crash inside a library's kernel selection (cuBLAS heuristics'
SIGFPE) depends on. It is run once here; it reproduces when it dies of the same signal. An op a
fresh interpreter cannot call (a custom op of the user's script) is named, not scripted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fpdoctor.crash.findings import Context, _in_flight, failures
from fpdoctor.report.model import Report

# the signals a kernel or library raises inside an op (SIGKILL, SIGTERM come from outside)
_INSIDE = ("SIGFPE", "SIGSEGV", "SIGBUS", "SIGILL", "SIGABRT")


def attach(report: Report, ctx: Context, target: str) -> Report:
    """The report with the first fatal-signal finding told about the reproducer written to `target`."""
    from fpdoctor.numerics.trace import repro

    event = next(
        (e for e in failures(ctx) if e.outcome.kind == "signal" and e.outcome.signal in _INSIDE and e.process.ops),
        None,
    )
    if event is None:
        return report
    sig = str(event.outcome.signal)
    current = _in_flight(event.process)
    op = current[-1] if current else event.process.ops[-1]
    which = "the op in flight" if current else "the last op recorded (it had returned before the signal)"
    directory, done = repro.write_crash(target, op, sig)
    info: dict[str, Any] = {
        "op": repro.overload_of(op.get("op") or "?"),
        "of": which,
        "scripted": directory is not None,
    }
    fixes: list[str] = []
    if directory is None:
        info["why"] = done
        text = f"No reproducer of {which}: {done}."
    else:
        ran = repro.run_once(directory)
        info.update(
            dir=str(directory),
            command=f"python {directory / 'repro.py'}",
            reproduced=ran.get("signal") == sig,
            result=ran.get("message"),
        )
        said = (
            f"died of {sig} again"
            if info["reproduced"]
            else f"did not die of {sig}: {ran.get('message')}; not reproduced by the op alone on seeded values, the "
            "crash needs the job's own values, or is one that does not reproduce: the machine, a race, an "
            "uninitialised read or a nondeterministic kernel"
        )
        text = f"Reproducer of {which}: python {directory / 'repro.py'}, {done} (run once here: {said})."
        fixes = [*repro.rerun_commands(directory)]
        info["rerun"] = fixes
    findings = list(report.findings)
    at = next((i for i, f in enumerate(findings) if f.name == "fatal-signal" and f.evidence.get("signal") == sig), None)
    if at is None:
        report.data.setdefault("not_checked", {})["reproducer"] = text
        return report
    f = findings[at]
    notes = ("   # the reproducer under compute-sanitizer", "   # the reproducer with cuBLASLt's API log")
    fix = "\n".join(x for x in [f.fix, *(c + n for c, n in zip(fixes, notes, strict=False))] if x)
    findings[at] = dataclasses.replace(
        f, message=f"{f.message}\n{text}", fix=fix, evidence={**f.evidence, "reproducer": info}
    )
    return dataclasses.replace(report, findings=findings)
