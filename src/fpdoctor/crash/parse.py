"""Read what dying processes print: faulthandler dumps, native backtraces, torchrun's summary.

Every parser takes text and returns data; nothing here reads files or decides what a crash
means. The shapes are the ones these tools print today (examples in tests/fixtures/crash):

    Fatal Python error: Floating point exception          faulthandler (CPython 3.8-3.14)
    Current thread 0x00007f... (most recent call first):
      File "/x/model.py", line 12 in forward

    SIGFPE(8), PID: 13710, Thread 13710:                  PyTorch's fatal-signal handler
     frame #0: c10::FatalSignalHandler::... (0x7ff3... in .../libc10.so)

    [a9970a74a52a:279  :0:279] Caught signal 8 (Floating point exception: integer divide by zero)
    ==== backtrace (tid:    279) ====                     UCX's handler (many container images)
     0 0x0000000000042520 __sigaction()  ???:0

    Root Cause (first observed failure):                   torchrun's ChildFailedError summary
    [0]:
      rank      : 1 (local_rank: 1)
      exitcode  : -8 (pid: 13458)  (SIGFPE)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fpdoctor.signals import signal_name

# faulthandler's header names the signal with strsignal-like words (Modules/faulthandler.c).
FAULT_HEADERS = {
    "Segmentation fault": "SIGSEGV",
    "Floating point exception": "SIGFPE",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
    "Illegal instruction": "SIGILL",
}

# A launcher's per-line prefix ("[rank1]: " from torch.distributed's excepthook, "[default0]:"
# from torchrun --tee): stripped before parsing, kept as the line's origin.
_PREFIX = re.compile(r"^\[(?:rank|default|[A-Za-z_]+)(\d+)\]:\s?")
_FATAL = re.compile(r"^Fatal Python error: (?P<what>[^\n]+?)\s*$")
_THREAD = re.compile(
    r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+)(?: \[(?P<name>[^\]]*)\])? \(most recent call first\):"
)
_STACK = re.compile(r"^Stack \(most recent call first\):")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<func>.*?)\s*$')
_C_STACK = re.compile(r"^Current thread's C stack trace \(most recent call first\):")
_C10_HEAD = re.compile(r"^(?P<sig>SIG[A-Z]+)\((?P<num>\d+)\), PID: (?P<pid>\d+), Thread (?P<tid>\d+):\s*$")
_CPP_FRAME = re.compile(r"^\s*frame #(?P<n>\d+): (?P<text>.*)$")
_UCX_CAUGHT = re.compile(
    r"^\[(?P<host>[^:\]]+):(?P<pid>\d+)\s*:\d+:\d+\] Caught signal (?P<num>\d+) \((?P<what>[^)]*\)?)\)"
)
_UCX_BT = re.compile(r"^==== backtrace \(tid:\s*(?P<tid>\d+)\) ====")
_UCX_FRAME = re.compile(r"^\s*(?P<n>\d+)\s+0x[0-9a-fA-F]+\s+(?P<text>.+?)\s*$")
_TERMINATE = re.compile(r"terminate called after throwing an instance of '(?P<type>[^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s+(?P<what>.*)$")
_GLIBC = re.compile(
    r"(\*\*\* (?:stack smashing|buffer overflow) detected \*\*\*|double free or corruption[^\n]*|"
    r"free\(\): invalid [^\n]*|malloc\(\): [^\n]*|corrupted size vs\. prev_size[^\n]*|munmap_chunk\(\): [^\n]*)"
)
_TORCHRUN_FAILED = re.compile(
    r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<local>\d+) \(pid: (?P<pid>\d+)\) of binary: (?P<binary>.+)$",
    re.MULTILINE,  # one per failed worker, wherever it is in the stream
)
_TR_FIELD = re.compile(r"^\s+(?P<key>time|host|rank|exitcode|error_file|traceback)\s*:\s*(?P<value>.*)$")
_TR_RANK = re.compile(r"(?P<rank>-?\d+) \(local_rank: (?P<local>-?\d+)\)")
_TR_CODE = re.compile(r"(?P<code>-?\d+) \(pid: (?P<pid>\d+)\)")


@dataclass
class Frame:
    file: str
    line: int | None
    function: str

    def text(self) -> str:
        return f"{self.file}:{self.line if self.line is not None else '?'} in {self.function}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function}


@dataclass
class ThreadStack:
    thread: str  # "0x00007f..." as faulthandler prints it, or "main" / a thread's name
    current: bool  # the thread that received the signal
    frames: list[Frame] = field(default_factory=list)  # most recent call first
    truncated: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "thread": self.thread,
            "current": self.current,
            "frames": [f.to_dict() for f in self.frames],
            **({"truncated": True} if self.truncated else {}),
        }


@dataclass
class Dump:
    """One faulthandler dump: the signal (None for a dump on request) and every thread's stack."""

    signal: str | None
    header: str | None
    threads: list[ThreadStack] = field(default_factory=list)
    native: list[str] = field(default_factory=list)  # Python >= 3.14's C stack, when printed
    origin: str | None = None  # the launcher prefix's rank, when read from a shared stream

    def current(self) -> ThreadStack | None:
        return next((t for t in self.threads if t.current), self.threads[0] if self.threads else None)


@dataclass
class NativeTrace:
    """Native frames a handler printed (PyTorch's, UCX's) or a C++/glibc abort message."""

    kind: str  # "c10" | "ucx" | "terminate" | "glibc"
    signal: str | None = None
    pid: int | None = None
    title: str = ""
    frames: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "title": self.title, "frames": self.frames}
        if self.signal:
            out["signal"] = self.signal
        if self.pid is not None:
            out["pid"] = self.pid
        return out


@dataclass
class LauncherFailure:
    """One entry of torchrun's failure summary, or of its 'failed (exitcode: N)' log line."""

    pid: int | None
    exitcode: int | None
    rank: int | None = None
    local_rank: int | None = None
    host: str | None = None
    time: str | None = None
    error_file: str | None = None
    traceback: str | None = None
    root_cause: bool = False

    @property
    def signal(self) -> str | None:
        return signal_name(-self.exitcode) if self.exitcode is not None and self.exitcode < 0 else None


def strip_prefix(line: str) -> tuple[str, str | None]:
    m = _PREFIX.match(line)
    return (line[m.end() :], m.group(1)) if m else (line, None)


def faulthandler_dumps(text: str) -> list[Dump]:
    """Every faulthandler dump in `text` (a dump file, or a stream that holds several)."""
    dumps: list[Dump] = []
    dump: Dump | None = None
    stack: ThreadStack | None = None
    in_c_stack = False
    for raw in text.splitlines():
        line, origin = strip_prefix(raw)
        m = _FATAL.match(line)
        if m:
            what = m["what"]
            dump = Dump(signal=FAULT_HEADERS.get(what), header=what, origin=origin)
            dumps.append(dump)
            stack, in_c_stack = None, False
            continue
        m = _THREAD.match(line) or _STACK.match(line)
        if m:
            if dump is None or any(t.current for t in dump.threads):
                # a dump without header (on request: SIGTERM) starts at its first thread; after
                # a dump's current thread, a new thread line belongs to another dump
                dump = Dump(signal=None, header=None, origin=origin)
                dumps.append(dump)
            groups = m.groupdict()
            stack = ThreadStack(
                thread=groups.get("id") or "0x?",
                current=groups.get("current", "Current thread") == "Current thread",
            )
            if groups.get("name"):
                stack.thread += f" [{groups['name']}]"
            dump.threads.append(stack)
            in_c_stack = False
            continue
        if dump is None:
            continue
        if _C_STACK.match(line):
            in_c_stack, stack = True, None
            continue
        if in_c_stack:
            if line.startswith("  ") and line.strip():
                dump.native.append(line.strip())
                continue
            in_c_stack = False
        if stack is None:
            continue
        m = _FRAME.match(line)
        if m:
            lineno = m["line"]
            stack.frames.append(Frame(m["file"], int(lineno) if lineno.isdigit() else None, m["func"]))
        elif line.strip() == "...":
            stack.truncated = True
        elif line.strip() == "<no Python frame>":
            continue
        elif not line.strip():
            stack = None
        else:
            stack = None  # "Extension modules: ...", or another program's output
    return [d for d in dumps if d.threads or d.header]


def native_traces(text: str) -> list[NativeTrace]:
    """Native backtraces and abort messages, in the order printed."""
    traces: list[NativeTrace] = []
    current: NativeTrace | None = None
    for raw in text.splitlines():
        line, _ = strip_prefix(raw)
        m = _C10_HEAD.match(line)
        if m:
            current = NativeTrace("c10", signal=m["sig"], pid=int(m["pid"]), title=line.strip())
            traces.append(current)
            continue
        m = _UCX_CAUGHT.search(line)
        if m:
            current = NativeTrace(
                "ucx", signal=signal_name(int(m["num"])), pid=int(m["pid"]), title=line[m.start() :].strip()
            )
            traces.append(current)
            continue
        if _UCX_BT.match(line):
            if current is None or current.kind != "ucx" or current.frames:
                current = NativeTrace("ucx", title=line.strip())
                traces.append(current)
            continue
        m = _TERMINATE.search(line)
        if m:
            current = NativeTrace("terminate", signal="SIGABRT", title=line[m.start() :].strip())
            traces.append(current)
            continue
        m = _GLIBC.search(line)
        if m:
            traces.append(NativeTrace("glibc", signal="SIGABRT", title=m.group(0).strip()))
            current = None
            continue
        if current is None:
            continue
        if current.kind == "terminate":
            w = _WHAT.match(line)
            if w and not current.frames:
                current.title += f"; what(): {w['what'].strip()}"
                continue
            f = _CPP_FRAME.match(line)
            if f:
                current.frames.append(f["text"].strip())
                continue
            if line.startswith(("Exception raised from", "<omitting python frames>")) or not line.strip():
                continue
            if current.frames or len(current.title) > 2000:
                current = None
            else:
                current.title += " " + line.strip()  # what() texts that span lines
            continue
        if current.kind == "c10":
            f = _CPP_FRAME.match(line)
            if f:
                current.frames.append(f["text"].strip())
            elif line.strip() not in ("", "<omitting python frames>"):
                current = None
            continue
        if current.kind == "ucx":
            if line.startswith("===="):
                if current.frames:
                    current = None
                continue
            f = _UCX_FRAME.match(line)
            if f:
                current.frames.append(f["text"])
            else:
                current = None
    return traces


def launcher_failures(text: str) -> list[LauncherFailure]:
    """torchrun's view of its workers: the ChildFailedError summary (root cause first), else
    its 'failed (exitcode: N) local_rank: R (pid: P)' log lines."""
    summary: list[LauncherFailure] = []
    entry: LauncherFailure | None = None
    root = False
    for raw in text.splitlines():
        line, _ = strip_prefix(raw)
        if line.startswith("Root Cause (first observed failure)"):
            root = True
            continue
        if line.startswith("Failures:"):
            root = False
            continue
        if re.match(r"^\[\d+\]:\s*$", line):
            entry = LauncherFailure(pid=None, exitcode=None, root_cause=root)
            summary.append(entry)
            continue
        if entry is None:
            continue
        m = _TR_FIELD.match(line)
        if not m:
            if line.startswith(("---", "===")):
                entry = None
            continue
        key, value = m["key"], m["value"].strip()
        if key == "rank":
            r = _TR_RANK.search(value)
            if r:
                entry.rank, entry.local_rank = int(r["rank"]), int(r["local"])
        elif key == "exitcode":
            c = _TR_CODE.search(value)
            if c:
                entry.exitcode, entry.pid = int(c["code"]), int(c["pid"])
        elif key == "host":
            entry.host = value
        elif key == "time":
            entry.time = value
        elif key == "error_file":
            entry.error_file = None if value == "<N/A>" else value
        elif key == "traceback":
            entry.traceback = value
    if summary:
        return sorted(summary, key=lambda e: not e.root_cause)
    found = []
    for m in _TORCHRUN_FAILED.finditer(text):
        found.append(LauncherFailure(pid=int(m["pid"]), exitcode=int(m["code"]), local_rank=int(m["local"])))
    return found
