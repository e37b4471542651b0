"""Read a run directory after the command ended: one `Process` per Python process it started.

The files are the ones `crash/site/sitecustomize.py` writes (proc, fault, term, exc, exit per
pid). What a process left is joined with what others saw of it: the wait status of the direct
child, torchrun's failure summary, dumps and native frames printed on the shared stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fpdoctor.crash import parse
from fpdoctor.crash.launcher import running
from fpdoctor.crash.parse import Dump, Frame, LauncherFailure, NativeTrace, ThreadStack
from fpdoctor.signals import signal_name

# torch.distributed collectives: a stack whose frames pass through one of these in
# distributed_c10d.py was waiting for the other ranks.
COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "_all_gather_base",
        "_reduce_scatter_base",
    }
)
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_FPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIBRARY_PATH = re.compile(r"([/\\](site|dist)-packages[/\\])|([/\\]lib[/\\]python\d+\.\d+[/\\])|^<frozen ")


@dataclass
class Outcome:
    """How a process ended, as far as anything recorded it."""

    kind: str  # signal | terminated | killed | exception | interrupted | exited | running | vanished
    time: float | None = None
    signal: str | None = None
    exit_code: int | None = None  # the process's own status when known (-N for signal N)

    @property
    def failed(self) -> bool:
        return self.kind in ("signal", "terminated", "killed", "exception") or bool(self.exit_code)


@dataclass
class Process:
    pid: int
    record: dict[str, Any] = field(default_factory=dict)
    fault: Dump | None = None
    fault_time: float | None = None
    term: Dump | None = None
    term_time: float | None = None
    exceptions: list[dict[str, Any]] = field(default_factory=list)
    exit_time: float | None = None
    returncode: int | None = None  # the direct child's wait status, or the launcher's exitcode
    launcher: LauncherFailure | None = None
    direct: bool = False
    alive: bool = False
    native: list[NativeTrace] = field(default_factory=list)
    ops: list[dict[str, Any]] = field(default_factory=list)
    library_log: list[str] = field(default_factory=list)
    fault_from_stream: bool = False
    end_hint: float | None = None  # when another process reported its death (no trace of its own)
    helper: bool = False  # a rank's own child (a DataLoader worker, a fork): its RANK is inherited
    index: int | None = None  # its place among the processes mp.spawn started (its rank), from the launcher
    reported: bool = False  # the child its launcher reported as the one that failed

    # -- who ------------------------------------------------------------------------------
    def _int(self, key: str) -> int | None:
        value = self.record.get(key)
        try:
            return int(value) if value is not None else None
        except (TypeError, ValueError):
            return None

    @property
    def rank(self) -> int | None:
        rank = self._int("rank")
        if rank is None and self.launcher is not None:
            rank = self.launcher.rank
        return self.index if rank is None else rank

    @property
    def local_rank(self) -> int | None:
        local = self._int("local_rank")
        if local is None and self.launcher is not None:
            local = self.launcher.local_rank
        return local

    @property
    def world_size(self) -> int | None:
        return self._int("world_size")

    @property
    def ppid(self) -> int | None:
        return self._int("ppid")

    @property
    def host(self) -> str | None:
        return self.record.get("host") or (self.launcher.host if self.launcher else None)

    @property
    def start(self) -> float | None:
        value = self.record.get("start")
        return float(value) if isinstance(value, (int, float)) else None

    @property
    def argv(self) -> list[str]:
        argv = self.record.get("argv")
        return [str(a) for a in argv] if isinstance(argv, list) else []

    @property
    def is_rank(self) -> bool:
        return not self.helper and self.rank is not None and (self.world_size or 2) > 1

    # -- how it ended ---------------------------------------------------------------------
    def main_exception(self) -> dict[str, Any] | None:
        return next((e for e in reversed(self.exceptions) if e.get("thread") is None), None)

    def outcome(self) -> Outcome:
        code = self.returncode
        exc = self.main_exception()
        raised = _float(exc.get("time")) if exc is not None and not _interrupt(exc) else None
        # the dump's time is its file's mtime, from the kernel's coarse clock: up to a tick (1-10 ms)
        # behind time.time(), so an exception raised just before a crash at exit can read as later
        fault_time = (self.fault_time or 0.0) + MTIME_SLACK_S
        if self.fault is not None and self.fault.signal and not (raised and raised < fault_time):
            return Outcome("signal", self.fault_time, self.fault.signal, code)
        # an exception first, then a fatal signal while the interpreter shut down (a CUDA error's
        # abort at exit): the exception is the story, the dump stays in the data
        if exc is not None and not _interrupt(exc):
            return Outcome("exception", _float(exc.get("time")), None, code)
        if code is not None and code < 0:
            name = signal_name(-code)
            kind = {"SIGTERM": "terminated", "SIGKILL": "killed"}.get(name, "signal")
            when = self.term_time if kind == "terminated" else None
            return Outcome(kind, when or self.exit_time or self.end_hint, name, code)
        if self.term is not None:
            return Outcome("terminated", self.term_time, "SIGTERM", code)
        if exc is not None:
            return Outcome("interrupted", _float(exc.get("time")), None, code)  # KeyboardInterrupt
        if self.exit_time is not None or code is not None:
            return Outcome("exited", self.exit_time, None, code)
        if self.alive:
            return Outcome("running")
        return Outcome("vanished")

    def stack(self) -> ThreadStack | None:
        """The stack that tells where this process was when it failed: the thread that received
        the fatal signal, else the traceback of its uncaught exception (a SIGTERM that came after
        it caught the interpreter shutting down), else the thread SIGTERM interrupted."""
        if self.fault is not None and _frames(self.fault.current()) and self.outcome().kind == "signal":
            return self.fault.current()
        exc = self.main_exception()
        if exc is not None and exc.get("frames"):
            frames = [Frame(f["file"], f.get("line"), f["function"]) for f in reversed(exc["frames"])]
            return ThreadStack(thread="main (traceback)", current=True, frames=frames)
        if self.term is not None and _frames(self.term.current()):
            return self.term.current()
        return None

    def threads(self) -> list[ThreadStack]:
        """Every thread's stack from the dump that tells most (see stack())."""
        for dump in (self.fault, self.term):
            if dump is not None and dump.threads and dump.current() is self.stack():
                return dump.threads
        stack = self.stack()
        return [stack] if stack is not None else []


def _frames(stack: ThreadStack | None) -> bool:
    return stack is not None and bool(stack.frames)


def _interrupt(exc: dict[str, Any]) -> bool:
    return str(exc.get("type", "")).endswith("KeyboardInterrupt")


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def innermost(stack: ThreadStack | None) -> Frame | None:
    return stack.frames[0] if stack is not None and stack.frames else None


def is_library(frame: Frame) -> bool:
    """A frame of installed packages, the standard library or fpdoctor itself, not the user's code."""
    return bool(_LIBRARY_PATH.search(frame.file)) or frame.file.startswith(_FPDOCTOR_DIR)


def user_frame(stack: ThreadStack | None) -> Frame | None:
    """The innermost frame of the user's own code (not site-packages, not the standard library)."""
    if stack is None:
        return None
    return next((f for f in stack.frames if not is_library(f)), None)


def collective(stack: ThreadStack | None) -> str | None:
    """The torch.distributed collective this stack is waiting in, if any."""
    if stack is None:
        return None
    for frame in stack.frames:
        if frame.file.endswith(_C10D_FILES) and frame.function in COLLECTIVES:
            return frame.function
    return None


# -- the run directory ------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


MTIME_SLACK_S = 0.05


def _read_dump(path: Path) -> tuple[Dump | None, float | None]:
    try:
        stat = path.stat()
        if stat.st_size == 0:
            return None, None
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, None
    dumps = parse.faulthandler_dumps(text)
    return (dumps[-1] if dumps else None), stat.st_mtime


def _pid_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None


_KINDS = ("proc", "fault", "term", "exc", "exit")  # the files sitecustomize.py writes


def read_processes(run_dir: str) -> dict[int, Process]:
    """Every process that left a file in run_dir, by pid."""
    procs: dict[int, Process] = {}
    try:
        names = sorted(os.listdir(run_dir))
    except OSError:
        return procs
    root = Path(run_dir)
    for name in names:
        pid = _pid_of(name)
        kind = name.split(".")[0]
        if pid is None or name.endswith(".tmp") or kind not in _KINDS:
            continue
        proc = procs.setdefault(pid, Process(pid=pid))
        path = root / name
        if kind == "proc":
            proc.record = _read_json(path) or {}
        elif kind == "fault":
            proc.fault, proc.fault_time = _read_dump(path)
        elif kind == "term":
            proc.term, proc.term_time = _read_dump(path)
        elif kind == "exc":
            doc = _read_json(path) or {}
            proc.exceptions = [e for e in doc.get("exceptions") or [] if isinstance(e, dict)]
        elif kind == "exit":
            proc.exit_time = _float((_read_json(path) or {}).get("time"))
    for pid, proc in procs.items():
        proc.alive = proc.exit_time is None and proc.fault is None and running(pid)
    return procs


class Watch:
    """Cheap polling of a run directory for the first failure of a rank (see launcher.launch)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self._ranks: dict[int, bool] = {}  # pid -> restarts remain (torchelastic will relaunch)
        self._seen: dict[int, dict[str, Any]] = {}  # records, read once
        # pid -> when a rank was first seen gone without an exit record: SIGKILL and os._exit leave
        # nothing behind, and this is the order of their deaths (within a poll) for the report
        self.gone: dict[int, float] = {}

    def __call__(self) -> float | None:
        try:
            entries = list(os.scandir(self.run_dir))
        except OSError:
            return None
        for entry in entries:
            name = entry.name
            if name.startswith("proc.") and name.endswith(".json"):
                pid = _pid_of(name)
                if pid is not None and pid not in self._seen:
                    record = self._seen[pid] = _read_json(Path(entry.path)) or {}
                    if _is_rank(record) and not _inherits_rank(record, self._seen.get(_ppid(record))):
                        self._ranks[pid] = _restarts_remain(record)
        self._look_for_the_gone(entries)
        for entry in entries:
            name = entry.name
            pid = _pid_of(name)
            if pid is None or pid not in self._ranks or self._ranks[pid]:
                continue
            with contextlib.suppress(OSError):
                if name.startswith("fault.") and entry.stat().st_size > 0:
                    return entry.stat().st_mtime
                if name.startswith("exc.") and name.endswith(".json"):
                    doc = _read_json(Path(entry.path)) or {}
                    for exc in doc.get("exceptions") or []:
                        if exc.get("thread") is None and not _interrupt(exc):
                            return _float(exc.get("time")) or entry.stat().st_mtime
        return None

    def pids(self) -> list[int]:
        return list(self._ranks)

    def _look_for_the_gone(self, entries: list[os.DirEntry[str]]) -> None:
        """Ranks that ended without an exit record (killed, os._exit): when they were first seen gone."""
        recorded = {_pid_of(e.name) for e in entries if e.name.startswith(("exit.", "fault."))}
        now = time.time()
        for pid in self._ranks:
            if pid not in self.gone and pid not in recorded and not running(pid):
                self.gone[pid] = now


def _ppid(record: dict[str, Any]) -> int:
    return int(record.get("ppid") or 0)


def _inherits_rank(record: dict[str, Any], parent: dict[str, Any] | None) -> bool:
    """A fork of a rank, or a process a rank started (a spawned DataLoader worker), inherits its
    RANK: it is the rank's helper, not a rank of the job."""
    if record.get("forked") or record.get("rank_of") is not None:
        return True  # a fork, or started below a rank of the same job (through a shell, say)
    return parent is not None and all(parent.get(k) == record.get(k) for k in ("rank", "world_size", "master_port"))


def _is_rank(record: dict[str, Any]) -> bool:
    try:
        return record.get("rank") is not None and int(record.get("world_size") or 0) > 1
    except ValueError:
        return False


def _restarts_remain(record: dict[str, Any]) -> bool:
    try:
        return int(record.get("torchelastic_max_restarts") or 0) > int(record.get("torchelastic_restart_count") or 0)
    except ValueError:
        return False


# -- joining what others saw ------------------------------------------------------------------


@dataclass
class Collected:
    processes: list[Process]  # by start time
    direct: Process
    launcher_failures: list[LauncherFailure]
    stream_dumps: list[Dump]  # faulthandler dumps on stderr that no process file holds
    native: list[NativeTrace]  # native traces on stderr not tied to a process
    stderr_text: str


def collect(
    run_dir: str, *, child_pid: int, returncode: int, stderr_tail: bytes, gone: dict[int, float] | None = None
) -> Collected:
    """`gone`: when fpdoctor saw a rank gone without an exit record (Watch.gone), its end."""
    procs = read_processes(run_dir)
    for pid, when in (gone or {}).items():
        if pid in procs and procs[pid].exit_time is None:
            procs[pid].end_hint = when
    for proc in procs.values():
        parent = procs.get(proc.ppid or 0)
        proc.helper = bool(proc.record) and _inherits_rank(proc.record, parent.record if parent else None)
    _spawned(procs)
    direct = procs.setdefault(child_pid, Process(pid=child_pid))
    direct.direct = True
    direct.returncode = returncode
    direct.alive = False
    text = stderr_tail.decode("utf-8", errors="replace")
    failures = parse.launcher_failures(text)
    for failure in failures:
        if failure.pid is not None and failure.pid in procs:
            proc = procs[failure.pid]
            proc.launcher = proc.launcher or failure
            if proc.returncode is None:
                proc.returncode = failure.exitcode
    native = parse.native_traces(text)
    loose = []
    for trace in native:
        if trace.pid is not None and trace.pid in procs:
            procs[trace.pid].native.append(trace)
        else:
            loose.append(trace)
    _children_reported_dead(procs, text)
    dumps = _attribute_stream_dumps(parse.faulthandler_dumps(text), procs)
    ordered = sorted(procs.values(), key=lambda p: (p.start is None, p.start or 0.0, p.pid))
    return Collected(
        processes=ordered,
        direct=direct,
        launcher_failures=failures,
        stream_dumps=dumps,
        native=_attribute_loose_native(loose, ordered),
        stderr_text=text,
    )


def _spawned(procs: dict[int, Process]) -> None:
    """The processes a torch.multiprocessing launcher (mp.spawn) started, by their index, and the
    one it reported as failed (sitecustomize records the report with the launcher's exception).
    mp.spawn catches the child's exception itself, prints it into a file and exits 1: the
    traceback is in the launcher's ProcessRaisedException, and the child gets it back from there."""
    for parent in list(procs.values()):
        exc = parent.main_exception() or {}
        child = exc.get("child") or {}
        index, pid = child.get("index"), child.get("pid")
        if not isinstance(index, int) or not isinstance(pid, int):
            continue
        pids = [p for p in child.get("pids") or [] if isinstance(p, int)]
        started = dict(enumerate(pids)) if pids[index : index + 1] == [pid] else {index: pid}
        for i, child_pid in started.items():
            p = procs.get(child_pid)
            if p is not None and p.ppid == parent.pid and p._int("rank") is None:
                p.index, p.helper = i, False
        failed = procs.get(pid)
        if failed is None or failed.ppid != parent.pid:
            continue
        failed.reported = True
        if failed.main_exception() is None and failed.fault is None:
            record = _reported_exception(exc, index, failed.exit_time)
            if record is not None:
                failed.exceptions.append(record | {"reported_by": parent.pid})
        code = _reported_exit(exc, index)
        if code is not None and failed.returncode is None and failed.main_exception() is None:
            # died without a trace of its own (SIGKILL, os._exit): ProcessExitedException says how;
            # mp.spawn saw it before it raised, so its end is no later than that
            failed.returncode = code
            if failed.end_hint is None:
                failed.end_hint = _float(exc.get("time"))


_PROCESS_EXITED = re.compile(r"process (\d+) terminated with (?:signal (SIG[A-Z0-9]+)|exit code (-?\d+))")


def _reported_exit(exc: dict[str, Any], index: int) -> int | None:
    """How mp.spawn's ProcessExitedException says its child ended: -N for signal N, else its exit code."""
    child = exc.get("child") or {}
    if isinstance(child.get("signal"), str) and _signum(child["signal"]):
        return -_signum(child["signal"])
    if isinstance(child.get("exit_code"), int):
        return int(child["exit_code"])
    m = _PROCESS_EXITED.search(str(exc.get("message") or ""))
    if m is None or int(m[1]) != index:
        return None
    if m[2]:
        return -_signum(m[2]) or None
    return int(m[3])


_PROCESS_RAISED = re.compile(r"^-- Process (\d+) terminated with the following error:\n", re.MULTILINE)
_TB_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')


def _reported_exception(exc: dict[str, Any], index: int, when: float | None) -> dict[str, Any] | None:
    """A child's uncaught exception as its launcher's ProcessRaisedException quotes it."""
    text = str(exc.get("traceback") or exc.get("message") or "")
    quoted = [m for m in _PROCESS_RAISED.finditer(text) if int(m[1]) == index]
    if not quoted:
        return None
    lines = text[quoted[-1].end() :].rstrip("\n").splitlines()
    # the last exception of the chain: after its own header, its frames, then `Type: message`
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    frames, rest = [], lines[headers[-1] + 1 if headers else 0 :]
    for i, line in enumerate(rest):
        if not line.startswith(" "):
            rest = rest[i:]
            break
        m = _TB_FRAME.match(line)
        if m:
            frames.append({"file": m["file"], "line": int(m["line"]), "function": m["function"]})
    if not rest or rest[0].startswith(" "):
        return None
    kind, _, first = rest[0].partition(": ")
    return {
        "time": when if when is not None else _float(exc.get("time")),
        "type": kind,
        "message": "\n".join([first, *rest[1:]]),
        "traceback": "\n".join(lines),
        "frames": frames,
        "thread": None,
    }


# torch.utils.data's messages when a worker dies: the one place a worker is named with its pid
# and signal (its own SIGSEGV/SIGBUS/SIGFPE handler replaces faulthandler's, so it leaves no dump,
# and the out-of-memory killer's SIGKILL leaves nothing at all). The signal is often only in the
# cause of the exception that ends the main process (a ConnectionResetError, "exited
# unexpectedly"), or only in what the worker printed on stderr as it died.
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid (?P<pid>\d+)\) is killed by signal: (?P<what>[^.\n]+)")
_WORKERS_EXITED = re.compile(r"DataLoader worker \(pid\(s\) (?P<pids>[\d, ]+)\) exited unexpectedly")
_WORKER_SAID = {
    "ERROR: Unexpected segmentation fault encountered in worker.": "SIGSEGV",
    "ERROR: Unexpected bus error encountered in worker.": "SIGBUS",
    "ERROR: Unexpected floating-point exception encountered in worker.": "SIGFPE",
}


def _children_reported_dead(procs: dict[int, Process], stderr_text: str) -> None:
    said = {sig for line, sig in _WORKER_SAID.items() if line in stderr_text}
    for parent in list(procs.values()):
        for exc in parent.exceptions:
            text = f"{exc.get('message', '')}\n{exc.get('traceback', '')}"  # the causes as well
            when = (_float(exc.get("time")) or 0.0) - 1e-3  # before its report
            for m in _WORKER_KILLED.finditer(text):
                _died_of(procs.get(int(m["pid"])), _STRSIGNAL.get(m["what"].strip()), when)
            if len(said) == 1:
                for m in _WORKERS_EXITED.finditer(text):
                    for pid in re.findall(r"\d+", m["pids"]):
                        _died_of(procs.get(int(pid)), next(iter(said)), when)
    if len(said) == 1 and not any(p.exceptions for p in procs.values()):
        # the main process died without a traceback of its own: torch's line names the pid
        for m in _WORKER_KILLED.finditer(stderr_text):
            _died_of(procs.get(int(m["pid"])), _STRSIGNAL.get(m["what"].strip()), None)


def _died_of(child: Process | None, signame: str | None, when: float | None) -> None:
    if child is not None and signame and child.returncode is None and child.fault is None:
        child.returncode = -_signum(signame)
        child.end_hint = when


# strsignal() texts, as Python's signal.strsignal gives them on Linux
_STRSIGNAL = {
    "Killed": "SIGKILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
    "Terminated": "SIGTERM",
}


def _attribute_stream_dumps(dumps: list[Dump], procs: dict[int, Process]) -> list[Dump]:
    """A fatal dump printed on stderr (faulthandler enabled by the program itself: torchelastic's
    @record does this) belongs to the one process that died of that signal without a dump file."""
    left = []
    for dump in dumps:
        if dump.signal is None:
            left.append(dump)
            continue
        candidates = [
            p
            for p in procs.values()
            if p.fault is None
            and (p.returncode == -_signum(dump.signal) or (p.launcher and p.launcher.signal == dump.signal))
        ]
        if dump.origin is not None:
            candidates = [p for p in candidates if str(p.rank) == dump.origin] or candidates
        if len(candidates) == 1:
            candidates[0].fault = dump
            candidates[0].fault_from_stream = True
        else:
            left.append(dump)
    return left


def _attribute_loose_native(traces: list[NativeTrace], procs: list[Process]) -> list[NativeTrace]:
    """Native frames without a pid (a C++ abort message) go to the one process that died of
    SIGABRT; kept loose otherwise."""
    left = []
    for trace in traces:
        dead = [p for p in procs if p.outcome().signal == trace.signal and trace.signal]
        if len(dead) == 1:
            dead[0].native.append(trace)
        else:
            left.append(trace)
    return left


def _signum(name: str) -> int:
    import signal

    try:
        return int(signal.Signals[name])
    except KeyError:
        return 0
