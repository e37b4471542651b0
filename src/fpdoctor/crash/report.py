"""The `fpdoctor run` report: the findings in the order of the story, and the data beside them
(a summary, the table of processes that matter, every process's threads, ops and native frames)."""

from __future__ import annotations

import datetime
import os
import shlex
from dataclasses import replace
from typing import Any

from fpdoctor.crash.collect import Process, innermost, user_frame
from fpdoctor.crash.findings import (
    FATAL,
    Context,
    Event,
    command_failed,
    exception_finding,
    exception_name,
    failures,
    fatal_signal,
    nonzero_exit,
    on_ranks,
    op_text,
    rank_stopped,
    short,
)
from fpdoctor.crash.parse import Frame
from fpdoctor.report.model import Finding, Report, Severity
from fpdoctor.signals import signal_name

TABLE_ROWS = 32


def build(ctx: Context) -> Report:
    events = failures(ctx)
    first = events[0] if events else None
    findings: list[Finding] = []
    job = [p for p in ctx.collected.processes if p.is_rank]
    for event in events:
        p, o = event.process, event.outcome
        after = first is not None and event is not first  # failures() puts the cause first
        # after the first failure, a rank that did not crash by itself, or a process fpdoctor
        # stopped, is a consequence
        peer = first is not None and first.process.is_rank and p.is_rank and o.kind != "signal"
        stopped = ctx.launched.stopped and o.kind in ("terminated", "killed")
        if first is not None and after and (peer or stopped):
            findings.append(rank_stopped(ctx, p, first))
        elif o.kind in FATAL:
            findings.append(fatal_signal(ctx, p, o, first=event is first and len(events) > 1))
        elif o.kind == "exited":
            findings.append(nonzero_exit(ctx, p, o, first=event is first and len(events) > 1))
        else:
            findings.append(exception_finding(ctx, p, first=event is first and len(events) > 1))
    if first is not None and first.process.is_rank:
        failed = {e.process.pid for e in events}
        findings += [rank_stopped(ctx, p, first) for p in job if p.pid not in failed]
    if not events and ctx.launched.exit_status != 0 and not ctx.interrupted:
        # a failed command is never OK in the report file (stderr gets nothing: its own output says why)
        findings.append(command_failed(ctx))
    if ctx.launched.exit_status == 0:
        # the command went on and succeeded: what failed inside it was handled
        findings = [_soften(f) for f in findings]
    if ctx.environment is not None and events:
        findings += ctx.environment.findings
    if ctx.kernel is not None and events:
        findings += on_ranks(ctx.kernel.findings, ctx, job or ctx.collected.processes)
    return Report(command="run", findings=findings, data=_data(ctx, events))


def _soften(f: Finding) -> Finding:
    """A crash inside a command that exited 0 is still worth a warning; an exception that ended a
    child it handled (an optional-dependency probe, `python -c 'import apex'`) is routine."""
    if f.severity is not Severity.ERROR:
        return f
    severity = Severity.WARNING if f.name == "fatal-signal" else Severity.INFO
    return replace(f, severity=severity, message=f.message + "\nThe command went on and exited 0, so this was handled.")


def _clock(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3] if t else "?"


def _short_frame(frame: Frame | None) -> str:
    return f"{os.path.basename(frame.file)}:{frame.line} in {frame.function}" if frame else ""


def _ended_text(p: Process) -> str:
    o = p.outcome()
    if o.kind in FATAL or (o.kind == "signal"):
        return f"{o.kind} {o.signal}"
    if o.kind == "exception":
        return f"exception {exception_name(p)}"
    if o.kind == "exited" and o.exit_code:
        return f"exited {o.exit_code}"
    return o.kind


def _process_data(p: Process) -> dict[str, Any]:
    o = p.outcome()
    out: dict[str, Any] = {
        "pid": p.pid,
        "ppid": p.ppid,
        "argv": p.argv,
        "rank": p.rank,
        "local_rank": p.local_rank,
        "world_size": p.world_size,
        "host": p.host,
        "cuda_visible_devices": p.record.get("cuda_visible_devices"),
        "start": p.start,
        "ended": o.kind,
        "signal": o.signal,
        "exit_code": o.exit_code,
        "end": o.time,
        "threads": [t.to_dict() for t in p.threads()],
    }
    if p.exceptions:
        out["exceptions"] = [
            {k: e.get(k) for k in ("type", "message", "thread", "time", "traceback")} for e in p.exceptions
        ]
    if p.fault is not None and o.kind != "signal":
        # a fatal signal after the story's failure (an abort while shutting down after an exception)
        out["later_fault"] = {"signal": p.fault.signal, "threads": [t.to_dict() for t in p.fault.threads]}
    if p.native:
        out["native"] = [t.to_dict() for t in p.native]
    if p.ops:
        out["ops"] = [op_text(op) + ("" if op.get("done") else "  <- in flight") for op in p.ops[-20:]]
    if p.library_log:
        out["library_log"] = p.library_log
    if p.launcher is not None:
        out["launcher"] = {"exitcode": p.launcher.exitcode, "traceback": p.launcher.traceback}
    return {k: v for k, v in out.items() if v is not None}


def _data(ctx: Context, events: list[Event]) -> dict[str, Any]:
    launched, col = ctx.launched, ctx.collected
    status = str(launched.exit_status)
    if launched.returncode < 0:
        status += f" (the command died of {signal_name(-launched.returncode)})"
    summary: list[tuple[str, str]] = [("command", shlex.join(launched.argv)), ("exit status", status)]
    python = [p for p in col.processes if p.record]
    ranks = [p for p in python if p.is_rank]
    summary.append(("processes", f"{len(python)} Python process(es)" + (f", {len(ranks)} rank(s)" if ranks else "")))
    if events:
        e = events[0]
        what = e.outcome.signal or (
            f"exit status {e.outcome.exit_code}" if e.outcome.kind == "exited" else exception_name(e.process)
        )
        summary.append(("first failure", f"{short(e.process)} {what} at {_clock(e.time)}"))
    if launched.stopped:
        summary.append(("stopped", "fpdoctor terminated the command: it was still running after the first failure"))
    if launched.unended:
        summary.append(
            ("not ended", f"pid {launched.pid} was still there after SIGKILL: stuck in a kernel call (a hung driver?)")
        )
    if ctx.interrupted:
        summary.append(("interrupted", ", ".join(launched.signals)))
    summary.append(("breadcrumbs", "on" if ctx.breadcrumbs else "off"))
    if events and ctx.environment is not None:
        summary.append(("environment", ctx.environment.source))
    if events and ctx.kernel is not None and ctx.kernel.note is None:
        summary.append(("kernel log", f"{len(ctx.kernel.lines)} new NVIDIA line(s)"))
    not_checked = dict(ctx.not_checked)
    if events and ctx.environment is not None and ctx.environment.note:
        not_checked["environment"] = ctx.environment.note
    if events and ctx.kernel is not None and ctx.kernel.note:
        not_checked["kernel log"] = ctx.kernel.note
    data: dict[str, Any] = {
        "summary": summary,
        "exit_status": launched.exit_status,
        "failures": len(events),  # processes that crashed, raised, were killed or exited badly
        "processes": [_process_data(p) for p in col.processes],
        "not_checked": not_checked,
    }
    # the processes that tell the story: the command, the ranks, whatever failed (not every
    # DataLoader worker or compile subprocess that came and went)
    failed = {e.process.pid for e in events}
    shown = [p for p in python if p.direct or p.is_rank or p.pid in failed or p.outcome().failed]
    if shown and (events or len(shown) > 1):
        rows = [
            [
                short(p) + (f" (pid {p.pid})" if p.is_rank else ""),
                _ended_text(p),
                _short_frame(user_frame(p.stack()) or innermost(p.stack())),
            ]
            for p in shown[:TABLE_ROWS]
        ]
        if len(python) > len(shown[:TABLE_ROWS]):
            rows.append([f"{len(python) - len(rows)} more", "", "in data.processes"])
        data["table"] = {"title": "processes", "columns": ["process", "ended", "where"], "rows": rows}
    if ctx.rerun and events and not ctx.breadcrumbs:
        data["rerun"] = ctx.rerun
    if col.stream_dumps or col.native:
        data["unattributed"] = {
            "dumps": [[t.to_dict() for t in d.threads] for d in col.stream_dumps],
            "native": [t.to_dict() for t in col.native],
        }
    if events and ctx.kernel is not None and ctx.kernel.lines:
        data["kernel_log"] = ctx.kernel.lines[-50:]
    return data
