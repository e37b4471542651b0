"""Collected processes -> one finding per failed process (crash/report.py assembles the report).

Which failure came first decides the story: under torchrun one rank dies and the others fail
after it (a collective loses its peer, the launcher stops them), so the first failure gets the
error-level finding and every other rank of the job gets `rank-stopped` with what it was doing.
A process whose failure only reports a child's (torchrun's ChildFailedError, a shell's exit
status) is the launcher, not a cause.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field, replace
from typing import Any

from fpdoctor import catalog
from fpdoctor.crash.collect import Collected, Outcome, Process, collective, innermost, is_library, user_frame
from fpdoctor.crash.launcher import Launched
from fpdoctor.crash.machine import Environment, KernelLog, gpu_for
from fpdoctor.crash.parse import Frame, ThreadStack
from fpdoctor.health.kernel_log import normalize_pci
from fpdoctor.meanings import ErrorText, explain_text, signal_meaning
from fpdoctor.report.model import Finding

STACK_LINES = 12  # frames of the failing thread shown in a finding's text; all of them are in data
FATAL = ("signal", "killed", "terminated")


@dataclass
class Context:
    launched: Launched
    collected: Collected
    breadcrumbs: bool
    environment: Environment | None = None
    kernel: KernelLog | None = None
    rerun: str | None = None  # the command that runs it again with breadcrumbs
    wait_s: float | None = None
    not_checked: dict[str, str] = field(default_factory=dict)

    @property
    def interrupted(self) -> bool:
        return bool({"SIGINT", "SIGTERM", "SIGHUP"} & set(self.launched.signals))


@dataclass
class Event:
    process: Process
    outcome: Outcome
    time: float


# Exceptions by which a parent reports that a child failed: the child's failure is the story.
_REPORTS_A_CHILD = ("ChildFailedError", "ProcessRaisedException", "ProcessExitedException", "CalledProcessError")


def _reports_a_child(p: Process, o: Outcome) -> bool:
    if o.kind in ("terminated", "killed"):
        return True  # stopped along with the job (by fpdoctor, a scheduler), not a failure of its own
    if o.kind != "exception":
        return not p.record  # a shell or another launcher that is not Python: its status is the child's
    exc = p.main_exception() or {}
    return str(exc.get("type", "")).endswith(_REPORTS_A_CHILD)


def failures(ctx: Context) -> list[Event]:
    """Failures by time. A parent whose failure only reports its failed child's (torchrun's
    ChildFailedError, a shell's status) is left out; a parent that failed in its own way after a
    child died (the RuntimeError of a DataLoader whose worker was killed) stays, after the child."""
    procs = ctx.collected.processes
    events = []
    for p in procs:
        o = p.outcome()
        if o.kind not in (*FATAL, "exception") and not _exited_badly(p, o):
            continue
        if ctx.interrupted and o.signal in ("SIGINT", "SIGTERM", "SIGHUP"):
            continue  # the user stopped the command through fpdoctor
        events.append(Event(p, o, o.time if o.time is not None else ctx.launched.ended))
    failed = {e.process.pid: e for e in events}
    parents = {p.pid: p.ppid for p in procs}
    launchers = set()
    for pid in failed:
        seen, up = set(), parents.get(pid)
        while up is not None and up not in seen:
            seen.add(up)
            if up in failed and _reports_a_child(failed[up].process, failed[up].outcome):
                launchers.add(up)
            up = parents.get(up)
    kept = [e for e in events if e.process.pid not in launchers]
    return sorted(kept, key=lambda e: (_consequence(e, kept, procs), e.time))


def _exited_badly(p: Process, o: Outcome) -> bool:
    """A rank (or the child mp.spawn reported) that ended with a non-zero status of its own and left
    neither an exception nor a signal: os._exit(N), sys.exit(N), a native exit()."""
    return o.kind == "exited" and bool(o.exit_code) and (p.is_rank or p.reported)


def _consequence(e: Event, events: list[Event], procs: list[Process]) -> bool:
    """Whether this failure follows from another one, whatever the clocks say (a rank killed by
    SIGKILL or gone by os._exit is seen only at fpdoctor's next look, up to a poll late):
    - a child its launcher stopped after reporting another child's failure (mp.spawn reports one
      and terminates the rest; torchrun's 'Root Cause (first observed failure)' names one);
    - a SIGTERM beside a failure of another kind: launchers stop the survivors with it;
    - a collective's lost connection beside a rank that died or exited: that peer went first."""
    p, kind = e.process, e.outcome.kind
    reported = {q.ppid: q.pid for q in procs if q.reported}
    if reported.get(p.ppid, p.pid) != p.pid and kind in ("terminated", "killed"):
        return True
    root = next((q for q in procs if q.launcher is not None and q.launcher.root_cause), None)
    if root is not None and root is not p and root.is_rank and kind in ("terminated", "killed"):
        return any(other.process is root for other in events)
    others = [x for x in events if x is not e]
    if kind == "terminated" and any(x.outcome.kind != "terminated" for x in others):
        return True
    if kind == "exception" and p.is_rank and _lost_peer(p):
        return any(x.process.is_rank and x.outcome.kind != "exception" for x in others)
    return False


def _lost_peer(p: Process) -> bool:
    exc = p.main_exception() or {}
    error = explain_text(f"{exc.get('type', '')}: {exc.get('message', '')}")
    return error is not None and error.key == "peer-gone"


# -- one finding per failed process ------------------------------------------------------------


def _who(p: Process, ctx: Context) -> str:
    if p.is_rank:
        extra = [f"pid {p.pid}" if p.index is None else f"mp.spawn's process {p.index}, pid {p.pid}"]
        if p.local_rank is not None:
            extra.append(f"local rank {p.local_rank}")
        if p.host:
            extra.append(f"host {p.host}")
        device = _device(p, ctx)
        if device.get("device"):
            extra.append(str(device["device"]) + (f" {device['uuid']}" if device.get("uuid") else ""))
        return f"rank {p.rank} ({', '.join(extra)})"
    command = shlex.join(p.argv) if p.argv else shlex.join(ctx.launched.argv) if p.direct else ""
    if len(command) > 100:
        command = command[:97] + "..."
    return f"pid {p.pid}" + (f" ({command})" if command else "")


def _device(p: Process, ctx: Context) -> dict[str, Any]:
    """where.device: the op in flight's device, else the one GPU the process could see, else the
    usual one GPU per local rank. The GPU behind it comes from the environment's GPU list or,
    without one (no NVML, --env-from another node, the list not read in time), from the
    CUDA_VISIBLE_DEVICES the process record holds."""
    gpus = ctx.environment.gpus if ctx.environment is not None else []
    visible = p.record.get("cuda_visible_devices")
    listed = [v.strip() for v in str(visible).split(",") if v.strip()] if visible is not None else None
    if listed and listed[0].startswith("-"):
        listed = []  # CUDA_VISIBLE_DEVICES=-1 hides every GPU
    count = len(listed) if listed is not None else len(gpus)
    current = _in_flight(p)
    index: int | None = None
    basis = None
    if current and str(current[-1].get("device") or "").startswith("cuda"):
        _, _, number = str(current[-1]["device"]).partition(":")
        index, basis = (int(number) if number.isdigit() else 0), "op in flight"
    elif count == 1:
        index, basis = 0, "the only GPU it could see"
    elif count and p.local_rank is not None and 0 <= p.local_rank < count:
        index, basis = p.local_rank, "LOCAL_RANK (one GPU per rank)"
    if index is None:
        return {}
    gpu = gpu_for(gpus, visible, index)
    out: dict[str, Any] = {"device": f"cuda:{index}", "device_basis": basis}
    if "index" in gpu:
        out["gpu"] = gpu["index"]
    if gpu.get("uuid"):
        out["uuid"] = gpu["uuid"]
    if gpu.get("name"):
        out["gpu_name"] = gpu["name"]
    if gpu.get("pci_bus_id"):
        out["pci"] = normalize_pci(str(gpu["pci_bus_id"]))
    return out


def on_ranks(found: list[Finding], ctx: Context, processes: list[Process]) -> list[Finding]:
    """Kernel-log findings name a GPU by its bus id; under torchrun the user thinks in ranks: add
    the rank (host, device) whose GPU that is, where the process records and the GPU list tell."""
    by_pci: dict[str, list[tuple[Process, dict[str, Any]]]] = {}
    for p in processes:
        device = _device(p, ctx)
        if device.get("pci"):
            by_pci.setdefault(device["pci"], []).append((p, device))
    out = []
    for f in found:
        pci, host = f.where.get("pci"), f.where.get("host")
        owners = by_pci.get(normalize_pci(str(pci)), []) if pci else []
        # bus ids repeat on every node: only the ranks of the host whose kernel log it is
        owners = [(p, d) for p, d in owners if host is None or p.host in (None, host)]
        ranks = sorted({p.rank for p, _ in owners if p.rank is not None})
        if not ranks:
            out.append(f)
            continue
        where = dict(f.where)
        if len(ranks) == 1:
            p, device = next((p, d) for p, d in owners if p.rank == ranks[0])
            where.update({"rank": p.rank, "host": where.get("host") or p.host, "device": device["device"]})
            said = f"rank {p.rank}'s GPU ({device['device']})"
        else:
            where["ranks"] = ranks
            said = f"the GPU of ranks {', '.join(map(str, ranks))}"
        out.append(replace(f, where=where, message=f"{f.message} This is {said}."))
    return out


def _where(p: Process, ctx: Context) -> dict[str, Any]:
    device = _device(p, ctx)
    where: dict[str, Any] = {
        "rank": p.rank,
        "local_rank": p.local_rank,
        "host": p.host,
        "pid": p.pid,
        **{k: device.get(k) for k in ("device", "gpu", "uuid")},
    }
    current = _in_flight(p)
    if current:
        where["module"] = current[-1].get("module")
        where["op"] = overload_name(current[-1].get("op"))
    return where


def overload_name(op: Any) -> str | None:
    """An op as where.op spells it (ARCHITECTURE.md, contract 2), str() of the OpOverload as numerics findings give it:
    the ring's schema name 'aten::addmm' is 'aten.addmm.default', 'aten::add.Tensor' is
    'aten.add.Tensor'; a name already in that form is kept, an unreadable one is unknown."""
    if not isinstance(op, str) or not op or op == "?":
        return None
    namespace, sep, rest = op.partition("::")
    if not sep:
        return op
    return f"{namespace}.{rest}" if "." in rest else f"{namespace}.{rest}.default"


def _in_flight(p: Process) -> list[dict[str, Any]]:
    """Ops started and not finished, oldest first; those of the thread that received the signal
    when the ring and the dump agree on it (faulthandler prints the same thread ident)."""
    started = [op for op in p.ops if not op.get("done")]
    stack = p.stack()
    thread = stack.thread.split()[0] if stack is not None else ""
    if thread.startswith("0x"):
        mine = [op for op in started if isinstance(op.get("thread"), int) and op["thread"] == int(thread, 16)]
        return mine or started
    return started


def op_text(op: dict[str, Any]) -> str:
    args = ", ".join(
        f"{dtype}{list(shape)}" for dtype, shape in zip(op.get("dtypes") or [], op.get("shapes") or [], strict=False)
    )
    text = f"{overload_name(op.get('op')) or '?'}({args})"
    if op.get("module") is not None:
        text += f" in {op['module'] or '<root module>'}"
    if op.get("device"):
        text += f" on {op['device']}"
    if op.get("phase") and op["phase"] != "forward":
        text += f" ({op['phase']})"
    return text


def _stack_lines(stack: ThreadStack | None) -> list[str]:
    """The stack, innermost first, with runs of library frames (torch, the standard library)
    folded after their first frame so that the user's own frames stand out."""
    if stack is None or not stack.frames:
        return []
    lines: list[str] = []
    run: list[Frame] = []

    def fold() -> None:
        if run:
            lines.append(f"    {run[0].text()}")
        if len(run) == 2:
            lines.append(f"    {run[1].text()}")
        elif len(run) > 2:
            lines.append(f"      ... {len(run) - 1} more library frames")
        run.clear()

    consumed = 0
    for frame in stack.frames:
        if len(lines) >= STACK_LINES:
            break
        consumed += 1
        if is_library(frame):
            run.append(frame)
            continue
        fold()
        lines.append(f"    {frame.text()}")
    fold()
    if consumed < len(stack.frames) or stack.truncated:
        lines.append("    ... (the whole stack is in data.processes)")
    return lines


def _frame_evidence(stack: ThreadStack | None) -> dict[str, Any]:
    inner: Frame | None = innermost(stack)
    user = user_frame(stack)
    out: dict[str, Any] = {}
    if inner is not None:
        out["frame"] = inner.text()
        out["function"] = inner.function
    if user is not None:
        out["user_frame"] = user.text()  # the innermost frame of the user's own code
    return out


def _fix_text(text: str, ctx: Context) -> str:
    command = shlex.join(ctx.launched.argv)
    script = _script(ctx.launched.argv)
    return text.replace("SCRIPT.py ARGS", script or "SCRIPT.py ARGS").replace("COMMAND", command)


def _script(argv: list[str]) -> str | None:
    """`python train.py --lr 1` -> 'train.py --lr 1' (what `fpdoctor trace` takes)."""
    if len(argv) >= 2 and "python" in argv[0].rsplit("/", 1)[-1] and argv[1].endswith(".py"):
        return shlex.join(argv[1:])
    return None


def fatal_signal(ctx: Context, p: Process, o: Outcome, *, first: bool) -> Finding:
    sig = o.signal or "signal"
    meaning = signal_meaning(sig)
    stack = p.stack()
    inner, user = innermost(stack), user_frame(stack)
    place = f" in {inner.function} ({inner.file}:{inner.line})" if inner else ""
    lead = f"{_who(p, ctx)} died of {sig}{place}"
    if first:
        lead += ", the first process to fail"
    if sig == "SIGKILL":
        lead = f"{_who(p, ctx)} was killed from outside (SIGKILL)" + (", the first process to fail" if first else "")
    lines = [f"{lead}."]
    evidence: dict[str, Any] = {"signal": sig, "returncode": o.exit_code if o.exit_code is not None else None}
    evidence.update(_frame_evidence(stack))
    if user is not None and user is not inner:
        lines.append(f"Innermost frame of your code: {user.text()}")
    if stack is not None and stack.frames:
        threads = len(p.threads())
        lines.append(
            f"Python stack of the thread that received it (most recent call first; {threads} thread(s) in data):"
        )
        lines += _stack_lines(stack)
    elif sig != "SIGKILL":
        lines.append(_no_stack_reason(p))
    current = _in_flight(p)
    if current:
        lines.append("Op in flight (breadcrumbs): " + op_text(current[-1]))
        if len(current) > 1:
            lines.append("  inside: " + " <- ".join(op_text(op) for op in reversed(current[:-1]))[:400])
        evidence["op_in_flight"] = op_text(current[-1])
    elif p.ops:
        lines.append("Last op recorded (breadcrumbs; it had returned): " + op_text(p.ops[-1]))
        evidence["last_op"] = op_text(p.ops[-1])
    for trace in p.native[:2]:
        lines.append(f"Native frames ({trace.kind}): {trace.title}")
        lines += [f"    {f}" for f in trace.frames[:10]]
        evidence.setdefault("native", trace.title)
        if trace.kind == "terminate":
            error = explain_text(trace.title)
            if error is not None:
                lines.append(error.meaning.text)
                evidence["error_kind"] = error.key
    if p.library_log:
        lines.append("cuBLAS/cuBLASLt log, last lines:")
        lines += [f"    {line[:300]}" for line in p.library_log[-5:]]
        evidence["cublaslt_last"] = p.library_log[-1][:300]
    evidence["explanation"] = meaning.text
    fixes = []
    if sig in ("SIGFPE", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL") and not ctx.breadcrumbs and ctx.rerun:
        fixes.append(f"{ctx.rerun}   # again, with the op ring and the cuBLASLt log: names the op in flight")
    if meaning.fix:
        fixes.append(_fix_text(meaning.fix, ctx))
    if sig in ("SIGFPE", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL"):
        fixes.append("fpdoctor env   # the environment verdicts (joined below when found)")
    oom = ctx.kernel.oom_killed.get(p.pid) if ctx.kernel is not None else None
    if sig == "SIGKILL" and oom:
        lines.append(f"The kernel's out-of-memory killer killed it: {oom}")
        evidence["oom_killer"] = oom
    elif sig == "SIGKILL":
        lines.append(
            "It may be the kernel's out-of-memory killer (host RAM): `dmesg -T | grep -i -E 'out of memory|killed "
            f"process'` names the pid it killed ({p.pid}); else a scheduler's limit or a kill -9."
        )
    return catalog.make(
        "fatal-signal",
        message="\n".join(lines),
        title=f"{short(p)} died of {sig}" if sig != "SIGKILL" else f"{short(p)} was killed (SIGKILL)",
        where=_where(p, ctx),
        evidence=evidence,
        fix="\n".join(fixes) or None,
    )


def nonzero_exit(ctx: Context, p: Process, o: Outcome, *, first: bool) -> Finding:
    """A rank that exited non-zero with no exception and no signal: os._exit(N), sys.exit(N)."""
    code = o.exit_code
    source = (
        "torchrun's failure summary"
        if p.launcher is not None and p.launcher.exitcode == code
        else "mp.spawn's ProcessExitedException"
        if p.reported
        else "its exit status"
    )
    lead = (
        f"{_who(p, ctx)} exited with status {code} without a Python exception or a signal (os._exit({code}), "
        f"sys.exit({code}) or a native exit())"
    )
    lines = [lead + (", the first process to fail" if first else "") + f"; its status is from {source}."]
    if p.end_hint is not None and p.exit_time is None:
        lines.append(f"It left no exit record: fpdoctor saw it gone at {_clock(p.end_hint)}.")
    evidence: dict[str, Any] = {"exit_code": code, "status_from": source}
    return catalog.make(
        "nonzero-exit",
        message="\n".join(lines),
        title=f"{short(p)} exited with status {code}",
        where=_where(p, ctx),
        evidence=evidence,
    )


def command_failed(ctx: Context) -> Finding:
    """The command exited non-zero and no process of it crashed, raised or was killed."""
    launched = ctx.launched
    status = launched.exit_status
    return catalog.make(
        "nonzero-exit",
        message=f"The command exited with status {status}; no process of it died of a signal, raised an uncaught "
        "exception or was stopped, so what it printed before it exited says why.",
        title=f"the command exited with status {status}",
        where={"pid": launched.pid},
        evidence={"exit_code": status},
    )


def _clock(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def short(p: Process) -> str:
    return f"rank {p.rank}" if p.is_rank else f"pid {p.pid}"


def _no_stack_reason(p: Process) -> str:
    if not p.record:
        return (
            "No Python stack: this process is not Python, or it ran with -I/-E/-S (which skip the "
            "sitecustomize fpdoctor uses)."
        )
    if p.record.get("faulthandler") == "stderr":
        return "No Python stack: faulthandler wrote to stderr (PYTHONFAULTHANDLER) and it was not found in the output."
    return "No Python stack: faulthandler was replaced in this process, or the signal came before it started."


def exception_finding(ctx: Context, p: Process, *, first: bool) -> Finding:
    exc = p.main_exception() or {}
    kind = str(exc.get("type", "Exception"))
    short_type = kind.rsplit(".", 1)[-1]
    text = str(exc.get("message", ""))
    error: ErrorText | None = explain_text(f"{kind}: {text}")
    if error is not None and error.key == "peer-gone" and not p.is_rank:
        error = None  # a lost connection is a lost peer rank only in a job with ranks (a DataLoader's is its worker's)
    name = "cuda-error" if error is not None and error.finding == "cuda-error" else "uncaught-exception"
    stack = p.stack()
    first_line = text.strip().splitlines()[0] if text.strip() else ""
    lead = f"{_who(p, ctx)} ended with an uncaught {short_type}" + (f": {first_line[:300]}" if first_line else "")
    if first:
        lead += " (the first process to fail)"
    lines = [lead]
    if error is not None:
        lines.append(error.meaning.text)
    tb = str(exc.get("traceback", "")).rstrip().splitlines()
    if exc.get("reported_by") is not None:
        launcher = exc["reported_by"]
        lines.append(
            f"As its launcher (pid {launcher}) reported it: mp.spawn catches it in the process, which exits 1."
        )
    if tb:
        lines.append("Traceback (last lines):")
        lines += [f"  {line}" for line in tb[-14:]]
    evidence: dict[str, Any] = {"exception": kind, "error": text[:1000]}
    evidence.update(_frame_evidence(stack))
    if error is not None:
        evidence["error_kind"] = error.key
        evidence["explanation"] = error.meaning.text
    if _in_flight(p):
        evidence["op_in_flight"] = op_text(_in_flight(p)[-1])
    fix = _fix_text(error.meaning.fix, ctx) if error is not None and error.meaning.fix else None
    explained = exc.get("explained")
    if isinstance(explained, dict) and explained.get("name") in ("dtype-mismatch", "device-mismatch"):
        return _mismatch_finding(ctx, p, explained, lines, evidence)
    return catalog.make(
        name,
        message="\n".join(lines),
        title=f"{short(p)}: {short_type}" + (f" ({error.key})" if error is not None else ""),
        where=_where(p, ctx),
        evidence=evidence,
        fix=fix,
    )


def _mismatch_finding(
    ctx: Context, p: Process, explained: dict[str, Any], lines: list[str], evidence: dict[str, Any]
) -> Finding:
    """A dtype or device mismatch as the process explained it from its live model (crash/live.py):
    which op, which operands from where, and the line that assigned the odd module when recorded."""
    fix = str(explained.get("fix") or "")
    found = dict(explained.get("evidence") or {})
    if "assigned_at" not in found and not ctx.breadcrumbs and ctx.rerun:
        fix += f"\n{ctx.rerun}   # again: names the line that attached a module of another dtype or device"
    where = _where(p, ctx) | {k: v for k, v in (explained.get("where") or {}).items() if k != "iteration"}
    # the child wrote the name into a file: read back as one of the two it can be
    name = "device-mismatch" if explained.get("name") == "device-mismatch" else "dtype-mismatch"
    return catalog.make(
        name,
        message="\n".join(
            [lines[0], str(explained.get("message", "")), *(x for x in lines[1:] if x != evidence.get("explanation"))]
        ),
        title=f"{short(p)}: {name}",
        where=where,
        evidence=evidence | found,
        fix=fix or None,
    )


def rank_stopped(ctx: Context, p: Process, first: Event) -> Finding:
    o = p.outcome()
    stack = p.stack()
    waiting = collective(stack)
    cause = first.outcome.signal or exception_name(first.process)
    what = f"{short(first.process)} died of {cause}" if first.outcome.signal else f"{short(first.process)} failed"
    if first.outcome.kind == "exited":
        what = f"{short(first.process)} exited with status {first.outcome.exit_code}"
    ended_before = o.kind == "exited" and o.time is not None and o.time < first.time
    if ended_before:
        doing, state = "had already finished", "finished"
    elif waiting:
        doing, state = f"was waiting in {waiting} (a collective) for the other ranks", "in-collective"
    elif stack is not None and stack.frames:
        frame = user_frame(stack) or innermost(stack)
        doing, state = f"was running at {frame.text() if frame else '?'}", "running"
    else:
        doing, state = "left no stack", "unknown"
    endings = {
        "terminated": "then it was stopped with SIGTERM (torchrun and mp.spawn stop the other ranks once one fails)",
        "killed": "then it was killed (SIGKILL)",
        "running": "it was still running when the report was written",
        "vanished": "it ended without an exit record (killed, or os._exit)",
        "exited": "it exited",
    }
    if o.kind == "exception":
        exc = p.main_exception() or {}
        message = str(exc.get("message", "")).strip().splitlines()
        ending = f"then {'its collective' if waiting else 'it'} failed: {str(exc.get('type', '')).rsplit('.', 1)[-1]}"
        ending += f": {_clip(message[0], 200)}" if message else ""
        if p.returncode == -15:
            ending += "; the launcher then stopped it (SIGTERM)"
    else:
        ending = endings.get(o.kind, o.kind)
    if ctx.launched.stopped and o.kind in ("terminated", "killed"):
        ending = f"fpdoctor stopped it {ctx.wait_s or 0:g} s after the first failure (--wait)"
    lines = [f"{_who(p, ctx)} {doing} when {what}; {ending}."]
    if stack is not None and stack.frames:
        lines.append("Its Python stack (most recent call first):")
        lines += _stack_lines(stack)
    evidence: dict[str, Any] = {"state": state, "ended": o.kind, "first_failure": short(first.process)}
    if waiting:
        evidence["collective"] = waiting
    if o.signal:
        evidence["signal"] = o.signal
    evidence.update(_frame_evidence(stack))
    return catalog.make(
        "rank-stopped",
        message="\n".join(lines),
        title=f"{short(p)} stopped after {short(first.process)} failed"
        + (f" (it was in {waiting})" if waiting else ""),
        where=_where(p, ctx),
        evidence=evidence,
    )


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: text.rfind(" ", 0, limit) if " " in text[:limit] else limit] + " ..."


def exception_name(p: Process) -> str:
    exc = p.main_exception() or {}
    return str(exc.get("type", "an exception")).rsplit(".", 1)[-1]
