"""Start the command, pass its output through unchanged, forward signals, and never hang.

The command runs in fpdoctor's own process group, as it would from the shell: Ctrl-C in a
terminal reaches it directly, it keeps the terminal for reading (pdb works), and it sees the
same stdin. Its stderr goes through a pipe so that the report can read what it printed last
(native backtraces, torchrun's failure summary); every byte is written on as soon as it is
read, in order. Its stdout is handed over as is when it is a terminal (the command then
line-buffers and colours exactly as without fpdoctor), and otherwise piped the same way.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

TAIL_BYTES = 256 * 1024  # what the report reads from each stream: backtraces and launcher summaries
POLL_S = 0.2  # how often the run directory is looked at for a rank's death (well inside the 5 s budget)
SETTLE_S = 10.0  # for a launcher to exit once every rank has ended (a loaded machine: seconds)
GRACE_S = 1.0  # after SIGTERM, before SIGKILL, once the bounded wait is over
KILL_WAIT_S = 2.0  # after SIGKILL: a process in an uninterruptible call (a hung GPU driver) stays
FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGINT")


class CommandError(Exception):
    """The command cannot be started (not found, not executable): one line, exit status 2."""


@dataclass
class Launched:
    """What the launcher saw; times are time.time() so they compare with the processes' records."""

    argv: list[str]
    pid: int
    returncode: int  # as Popen gives it: -N for a death by signal N
    started: float
    ended: float
    stdout_tail: bytes | None  # None: handed to a terminal or discarded, not read
    stderr_tail: bytes
    first_failure: float | None = None  # when a failure inside the command was first seen
    stopped: bool = False  # fpdoctor terminated the command after the bounded wait
    unended: bool = False  # it had not ended even after SIGKILL when the report was written
    signals: list[str] = field(default_factory=list)  # signals fpdoctor received and passed on

    @property
    def exit_status(self) -> int:
        """As a shell reports it: 128+N for a death by signal N."""
        return 128 - self.returncode if self.returncode < 0 else self.returncode


def resolve(argv: list[str], env: dict[str, str]) -> str:
    """The executable that argv[0] names, or CommandError with a one-line reason."""
    if not argv:
        raise CommandError("no command given; usage: fpdoctor run [OPTIONS] -- COMMAND [ARGS...]")
    name = argv[0]
    if os.sep in name or (os.altsep and os.altsep in name):
        if not os.path.exists(name):
            raise CommandError(f"{name}: no such file")
        if os.path.isdir(name) or not os.access(name, os.X_OK):
            raise CommandError(f"{name} is not executable (chmod +x {name}, or run it through its interpreter)")
        return name
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise CommandError(f"{name} not found on PATH; check the spelling or activate the environment that has it")
    return found


class _Sink:
    """Where one of the command's streams goes: a file descriptor, a writable object, or nowhere."""

    def __init__(self, target: Any) -> None:
        self.fd: int | None = None
        self.obj: Any = None
        self.text = False
        self.broken = False  # the reader went away: stop reading, the command gets EPIPE/SIGPIPE
        self.failed = False  # any other write error: keep draining (the command must never block)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # chunks split characters
        if target is None:
            return
        if isinstance(target, int):
            self.fd = target
            return
        with contextlib.suppress(AttributeError, OSError, ValueError, io.UnsupportedOperation):
            target.flush()
            self.fd = target.fileno()
            return
        buffer = getattr(target, "buffer", None)
        self.obj = buffer if buffer is not None else target
        self.text = buffer is None and isinstance(target, io.TextIOBase)

    @property
    def terminal(self) -> bool:
        return self.fd is not None and os.isatty(self.fd)

    def write(self, data: bytes) -> None:
        if self.broken or self.failed:
            return
        try:
            if self.fd is not None:
                _write_all(self.fd, data)
            elif self.obj is not None:
                self.obj.write(self._decoder.decode(data) if self.text else data)
                self.obj.flush()
        except BrokenPipeError:
            self.broken = True  # `| head` has exited; the command learns it below
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                self.broken = True
            else:
                self.failed = True  # a terminal that went away (EIO), a full disk
        except Exception:  # a caller's writer object that raises
            self.failed = True


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [], 1.0)  # a non-blocking terminal or pipe that is full
            continue
        view = view[n:]


class _Pump(threading.Thread):
    """Copy one pipe to its sink as bytes arrive, keeping a bounded tail for the report."""

    def __init__(self, fd: int, sink: _Sink, name: str) -> None:
        super().__init__(name=f"fpdoctor-{name}", daemon=True)
        self.fd, self.sink = fd, sink
        self._tail = bytearray()
        self._lock = threading.Lock()

    def run(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self.fd, 65536)
                except InterruptedError:
                    continue
                except OSError:
                    break
                if not chunk:
                    break
                self.sink.write(chunk)
                with self._lock:
                    self._tail += chunk
                    if len(self._tail) > 2 * TAIL_BYTES:
                        del self._tail[: len(self._tail) - TAIL_BYTES]
                if self.sink.broken:
                    break  # close our end: the command gets EPIPE/SIGPIPE as it would have
        finally:
            with contextlib.suppress(OSError):
                os.close(self.fd)

    def tail(self) -> bytes:
        with self._lock:
            return bytes(self._tail[-TAIL_BYTES:])


def _in_terminal_foreground() -> bool:
    """Whether a Ctrl-C typed in the terminal reaches our whole process group (then the command
    has it already and forwarding would deliver it twice)."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
    return False


@contextlib.contextmanager
def _forwarding(seen: list[str]) -> Iterator[Callable[[subprocess.Popen[bytes]], None]]:
    """Pass the signals fpdoctor receives on to the command (only the main thread can install
    handlers). Installed before the command starts: a signal that comes before it exists is
    delivered as soon as it does, through the function this yields."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda proc: None
        return
    target: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []
    previous: dict[int, Any] = {}

    def forward(signum: int, frame: Any) -> None:
        seen.append(signal.Signals(signum).name)
        if signum == signal.SIGINT and _in_terminal_foreground():
            return  # the terminal sent it to the command as well
        if not target:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            target[0].send_signal(signum)

    def bind(proc: subprocess.Popen[bytes]) -> None:
        target.append(proc)
        for signum in pending:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    for name in FORWARDED:
        signum = getattr(signal, name, None)
        if signum is None:
            continue
        with contextlib.suppress(OSError, ValueError):
            previous[signum] = signal.signal(signum, forward)
    try:
        yield bind
    finally:
        for signum, handler in previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc); empty where /proc is not available."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # the command name is in parentheses and may itself hold spaces or parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Still running (a zombie that nobody reaped yet counts as ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as fh:
        stat = fh.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
    return True


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _stop(proc: subprocess.Popen[bytes], extra: Callable[[], list[int]], ended: threading.Event) -> None:
    """Terminate the command and everything below it: SIGTERM (each Python process dumps its
    stacks on the way out), then SIGKILL what is left after a grace period. Bounded: a process
    stuck in the kernel (D state) ignores even SIGKILL until the call returns, and the report
    is not held back for it."""
    tree = [proc.pid, *descendants(proc.pid), *extra()]
    _signal_all(tree, signal.SIGTERM)
    if not ended.wait(GRACE_S):
        _signal_all([pid for pid in [proc.pid, *descendants(proc.pid), *extra()] if running(pid)], signal.SIGKILL)
        ended.wait(KILL_WAIT_S)


def launch(
    argv: list[str],
    *,
    env: dict[str, str],
    cwd: str | None = None,
    stdout: Any = None,
    stderr: Any = None,
    wait_s: float = 3.0,
    watch: Callable[[], float | None] = lambda: None,
    on_failure: Callable[[], None] = lambda: None,
    alive: Callable[[], list[int]] = list,
) -> Launched:
    """Run argv to its end and return what happened.

    `watch()` returns the time of a failure inside the command that should end it (a rank's
    death), or None; once it has, the command gets `wait_s` seconds to end by itself before it
    is terminated, so a job whose other ranks hang in a collective still gets its report.
    `on_failure()` is called once, when that failure is first seen. `alive()` names the
    processes of the job (the ranks; they left a record of themselves): once none of them runs,
    the command gets up to SETTLE_S more to end, since nothing can hang in a collective any more.
    """
    executable = resolve(argv, env)
    out_sink, err_sink = _Sink(stdout), _Sink(stderr)
    pass_stdout = out_sink.terminal
    if stdout is None:
        stdout_arg: Any = subprocess.DEVNULL
    elif pass_stdout:
        stdout_arg = out_sink.fd
    else:
        stdout_arg = subprocess.PIPE
    seen: list[str] = []
    with _forwarding(seen) as bind:
        started = time.time()
        try:
            proc = subprocess.Popen(
                argv, executable=executable, env=env, cwd=cwd, stdout=stdout_arg, stderr=subprocess.PIPE, bufsize=0
            )
        except OSError as exc:
            raise CommandError(f"{argv[0]} cannot be executed ({exc.strerror or exc})") from exc
        bind(proc)
        pumps = []
        out_pump = None
        if stdout_arg is subprocess.PIPE:
            assert proc.stdout is not None
            out_pump = _Pump(_take_fd(proc.stdout), out_sink, "stdout")
            pumps.append(out_pump)
        assert proc.stderr is not None
        err_pump = _Pump(_take_fd(proc.stderr), err_sink, "stderr")
        pumps.append(err_pump)
        for pump in pumps:
            pump.start()
        first: float | None = None
        deadline = float("inf")
        stopped = settled = False
        # A thread blocks in waitpid, so the command's end is seen at once and costs no polling;
        # this thread looks at the run directory a few times a second for a rank's death.
        ended_event = threading.Event()

        def wait_for_the_command() -> None:
            proc.wait()
            ended_event.set()

        waiter = threading.Thread(target=wait_for_the_command, name="fpdoctor-wait", daemon=True)
        waiter.start()
        while True:
            if ended_event.wait(POLL_S):
                break
            if first is None:
                first = watch()
                if first is not None:
                    deadline = time.monotonic() + wait_s
                    on_failure()
            elif not settled and not any(running(pid) for pid in alive()):
                # every rank has ended: no collective can hang any more, and the launcher's own
                # shutdown (torchrun printing its summary) gets its time, so its exit status stays
                settled = True
                deadline = max(deadline, time.monotonic() + max(wait_s, SETTLE_S))
            elif time.monotonic() >= deadline:
                stopped = True
                _stop(proc, alive, ended_event)
                break
        ended = time.time()
        # Output still in the pipes comes first; a process that outlived the command and keeps
        # them open (a daemon) does not hold the report back for long.
        drain_until = time.monotonic() + max(1.0, min(wait_s, 5.0))
        for pump in pumps:
            pump.join(timeout=max(0.0, drain_until - time.monotonic()))
    code = proc.returncode  # None: SIGKILL is on its way, its status is the one the shell will see
    return Launched(
        argv=list(argv),
        pid=proc.pid,
        returncode=-signal.SIGKILL if code is None else code,
        started=started,
        ended=ended,
        stdout_tail=out_pump.tail() if out_pump is not None else None,
        stderr_tail=err_pump.tail(),
        first_failure=first,
        stopped=stopped,
        unended=code is None,
        signals=seen,
    )


def _take_fd(stream: IO[bytes]) -> int:
    """The pipe's descriptor, owned by the pump from now on (Popen must not close it too)."""
    fd = os.dup(stream.fileno())
    stream.close()
    return fd
