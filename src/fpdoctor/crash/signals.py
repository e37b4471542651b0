"""Signals fpdoctor receives reach the command exactly once.

The command runs in fpdoctor's own process group, as it would from the shell. A signal sent to
that whole group (Ctrl-C or Ctrl-\\ in a terminal, a shell's job kill, a closing terminal's
SIGHUP) or to every process of a cgroup (systemd, Slurm) reaches the command by itself: passing
it on would deliver it twice and run its handlers twice. A signal sent to fpdoctor alone (`kill
PID`, a container's PID 1 being stopped) must be passed on, or the command never hears of it.

Which of the two it was is not in the signal itself, so a sentinel tells: a small process in
the same group that only reports the signals it receives. When it received the signal too, so
did the command; when it did not, fpdoctor passes the signal on.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGINT")
SENTINEL_S = 1.0  # how long the sentinel may take to report a group's signal (a loaded machine)
READY_S = 10.0  # for the sentinel to start

_SENTINEL = (
    "import os, signal, threading\n"
    "sigs = {%s}\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, sigs)\n"
    "def gone():\n"
    "    while os.read(0, 1):\n"
    "        pass\n"
    "    os._exit(0)\n"
    "threading.Thread(target=gone, daemon=True).start()\n"
    "os.write(1, b'r')\n"
    "while True:\n"
    "    os.write(1, bytes([signal.sigwait(sigs)]))\n"
)


class Sentinel:
    """A process in fpdoctor's process group that reports each signal it receives."""

    def __init__(self, signums: list[int]) -> None:
        code = _SENTINEL % ", ".join(str(s) for s in signums)
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        assert self.proc.stdout is not None
        self._out = self.proc.stdout.fileno()
        self._counts: dict[int, int] = {}
        if not self._read(READY_S, until=lambda got: b"r" in got):
            self.close()
            raise OSError("the signal sentinel did not start")

    def _read(self, timeout: float, until: Callable[[bytes], bool]) -> bool:
        got = b""
        end = time.monotonic() + timeout
        while not until(got):
            left = end - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(InterruptedError):
                ready, _, _ = select.select([self._out], [], [], left)
                if ready:
                    chunk = os.read(self._out, 64)
                    if not chunk:
                        return False
                    for byte in chunk.replace(b"r", b""):
                        self._counts[byte] = self._counts.get(byte, 0) + 1
                    got += chunk
        return True

    def received(self, signum: int) -> bool:
        """Whether the sentinel received signum too (each of its receipts answers once)."""
        if not self._counts.get(signum):
            self._read(SENTINEL_S, until=lambda got: bool(self._counts.get(signum)))
        if self._counts.get(signum):
            self._counts[signum] -= 1
            return True
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # it exits when its stdin closes
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def _in_terminal_foreground() -> bool:
    """Without a sentinel: whether a Ctrl-C typed in the terminal reaches our whole process group."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
    return False


@contextlib.contextmanager
def forwarding(seen: list[str], on_resize: Callable[[], None] | None = None) -> Iterator[Callable[[Any], None]]:
    """Pass the signals fpdoctor receives on to the command, once (only the main thread can install
    handlers). Installed before the command starts: a signal that comes before it exists is
    delivered as soon as it does, through the function this yields. on_resize: called on SIGWINCH
    (the command's pseudo-terminal takes the real one's new size)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda proc: None
        return
    target: list[Any] = []
    pending: list[int] = []
    previous: dict[int, Any] = {}
    signums = [int(getattr(signal, name)) for name in FORWARDED if hasattr(signal, name)]
    try:
        sentinel: Sentinel | None = Sentinel(signums)
    except (OSError, ValueError):
        sentinel = None

    def forward(signum: int, frame: Any) -> None:
        seen.append(signal.Signals(signum).name)
        if sentinel is not None:
            if sentinel.received(signum):
                return  # sent to the whole group: the command has it already
        elif signum == signal.SIGINT and _in_terminal_foreground():
            return  # the terminal sent it to the command as well
        if not target:
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            target[0].send_signal(signum)

    def bind(proc: Any) -> None:
        target.append(proc)
        for signum in pending:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

    try:
        for signum in signums:
            with contextlib.suppress(OSError, ValueError):
                previous[signum] = signal.signal(signum, forward)
        if on_resize is not None and hasattr(signal, "SIGWINCH"):
            resize = on_resize
            with contextlib.suppress(OSError, ValueError):
                previous[signal.SIGWINCH] = signal.signal(signal.SIGWINCH, lambda s, f: resize())
        yield bind
    finally:
        for signum, handler in previous.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)
        if sentinel is not None:
            sentinel.close()
