"""Start the command, leave it alone, and say how it ended.

What fpdoctor does to the job is nothing: the command runs in fpdoctor's own process group, as
it would from the shell, with the same stdin; its output passes through unchanged and as it
comes (crash/streams.py); a signal fpdoctor receives reaches it once (crash/signals.py); and it
ends when it ends. When a rank fails, the launcher in charge (torchrun, mp.spawn, the user's
own) decides how the job shuts down and how long that takes; fpdoctor only watches. Only with
an explicit `wait_s` (`--wait S`) does it stop a command that is still running S seconds after
a rank's failure (a hand-written launcher that never notices a dead rank).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from fpdoctor.crash.signals import forwarding
from fpdoctor.crash.streams import Pump, Sink, copy_window_size, keep_closed_for_the_command, open_terminal

POLL_S = 0.2  # how often the run directory is looked at for a rank's death (well inside the 5 s budget)
SETTLE_S = 10.0  # with --wait: for a launcher to exit once every rank has ended (a loaded machine: seconds)
GRACE_S = 1.0  # with --wait: after SIGTERM, before SIGKILL
KILL_WAIT_S = 2.0  # after SIGKILL: a process in an uninterruptible call (a hung GPU driver) stays
DRAIN_S = 1.0  # after the command ended: at most this for what is in the pipes, before the rest is handed on


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
    stopped: bool = False  # fpdoctor terminated the command after the wait asked for (--wait)
    unended: bool = False  # it had not ended even after SIGKILL when the report was written
    signals: list[str] = field(default_factory=list)  # signals fpdoctor received (passed on unless the group had them)

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
    wait_s: float | None = None,
    watch: Callable[[], float | None] = lambda: None,
    on_failure: Callable[[], None] = lambda: None,
    alive: Callable[[], list[int]] = list,
) -> Launched:
    """Run argv to its end and return what happened.

    `watch()` returns the time of a failure inside the command (a rank's death), or None;
    `on_failure()` is called once, when that failure is first seen. By default nothing else
    happens: the command ends when its launcher ends it. With `wait_s`, a command still running
    `wait_s` seconds after that failure is stopped (SIGTERM to its tree, then SIGKILL); `alive()`
    names the ranks: once none of them runs, the launcher gets up to SETTLE_S more to end.
    """
    executable = resolve(argv, env)
    out_sink, err_sink = Sink(stdout), Sink(stderr)
    seen: list[str] = []
    terminal: int | None = None  # the real terminal the pseudo-terminal copies
    with contextlib.ExitStack() as cleanup:
        master = slave = None
        if err_sink.terminal:
            terminal = err_sink.fd
            assert terminal is not None
            master, slave = open_terminal(terminal)
            cleanup.callback(_close, slave)
        stderr_arg: Any = slave if slave is not None else subprocess.PIPE
        if out_sink.closed:
            keep_closed_for_the_command(1)
            stdout_arg: Any = None  # inherited: closed at exec
        elif stdout is None:
            stdout_arg = subprocess.DEVNULL
        elif slave is not None and out_sink.same_terminal(err_sink):
            stdout_arg = slave  # one terminal, one channel: stdout and stderr lines keep their order
        elif out_sink.terminal:
            stdout_arg = out_sink.fd  # a terminal of its own: handed over as is
        else:
            stdout_arg = subprocess.PIPE

        def resize() -> None:
            if terminal is not None and slave is not None:
                copy_window_size(terminal, slave)

        with forwarding(seen, resize if slave is not None else None) as bind:
            started = time.time()
            try:
                proc = subprocess.Popen(
                    argv, executable=executable, env=env, cwd=cwd, stdout=stdout_arg, stderr=stderr_arg, bufsize=0
                )
            except OSError as exc:
                if master is not None:
                    _close(master)
                raise CommandError(f"{argv[0]} cannot be executed ({exc.strerror or exc})") from exc
            bind(proc)
            pumps = []
            out_pump = None
            if stdout_arg is subprocess.PIPE:
                assert proc.stdout is not None
                out_pump = Pump(_take_fd(proc.stdout), out_sink, "stdout")
                pumps.append(out_pump)
            if master is not None:
                err_pump = Pump(master, err_sink, "terminal")
            else:
                assert proc.stderr is not None
                err_pump = Pump(_take_fd(proc.stderr), err_sink, "stderr")
            pumps.append(err_pump)
            cleanup.close()  # the command holds its own end of the terminal; ours would keep it open
            for pump in pumps:
                pump.start()
            first, stopped = _watch(proc, wait_s, watch, on_failure, alive)
            ended = time.time()
        # Output still in the pipes comes first; whatever the command left running that still
        # writes to them (a background upload) keeps writing through a forwarding process.
        drain_until = time.monotonic() + DRAIN_S
        for pump in pumps:
            while pump.is_alive() and pump.unread() and time.monotonic() < drain_until:
                time.sleep(0.01)
        for pump in pumps:
            pump.hand_over()
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


def _watch(
    proc: subprocess.Popen[bytes],
    wait_s: float | None,
    watch: Callable[[], float | None],
    on_failure: Callable[[], None],
    alive: Callable[[], list[int]],
) -> tuple[float | None, bool]:
    """Until the command ends: the first failure inside it, and whether fpdoctor stopped it."""
    first: float | None = None
    deadline = float("inf")
    settled = False
    # A thread blocks in waitpid, so the command's end is seen at once and costs no polling;
    # this thread looks at the run directory a few times a second for a rank's death.
    ended_event = threading.Event()

    def wait_for_the_command() -> None:
        proc.wait()
        ended_event.set()

    threading.Thread(target=wait_for_the_command, name="fpdoctor-wait", daemon=True).start()
    while not ended_event.wait(POLL_S):
        if first is None:
            first = watch()
            if first is not None:
                on_failure()
                if wait_s is not None:
                    deadline = time.monotonic() + wait_s
            elif wait_s is None:
                continue
        elif wait_s is None:
            # the launcher in charge decides how the job ends; watch() goes on only to note when
            # the other ranks end (the order of deaths names the first failure)
            watch()
        elif not settled and not any(running(pid) for pid in alive()):
            # every rank has ended: no collective can hang any more, and the launcher's own
            # shutdown (torchrun printing its summary) gets its time, so its exit status stays
            settled = True
            deadline = max(deadline, time.monotonic() + max(wait_s, SETTLE_S))
        elif time.monotonic() >= deadline:
            _stop(proc, alive, ended_event)
            return first, True
    return first, False


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _take_fd(stream: IO[bytes]) -> int:
    """The pipe's descriptor, owned by the pump from now on (Popen must not close it too)."""
    fd = os.dup(stream.fileno())
    stream.close()
    return fd
