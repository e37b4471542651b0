"""The command's output on its way through fpdoctor: unchanged, as it comes, and never cut off.

Each stream the report reads goes through a pipe, or a pseudo-terminal where fpdoctor's own
stream is a terminal (the command then sees a terminal, line-buffers and colours as without
fpdoctor, and its stdout and stderr, when they share that terminal, share one channel so that
their lines keep their order). A pump copies every byte to where fpdoctor's stream goes as soon
as it is read. When the command has ended but something it left behind still holds the stream
(a background upload that logs), the rest is handed to a small forwarding process that copies
until that writer closes it: fpdoctor exits on time and the writer never meets a closed pipe. That
process is started with the command and takes over by itself when fpdoctor is killed (SIGKILL,
the out-of-memory killer), so the command's next line never meets a pipe nobody reads.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import select
import subprocess
import sys
import threading
from typing import Any

TAIL_BYTES = 256 * 1024  # what the report reads from each stream: backtraces and launcher summaries

# The forwarding process, started beside each pump as the command starts: stdin is the pipe or the
# terminal's master side, stdout where the bytes go, argv[1] a lifeline from fpdoctor. It waits on
# the lifeline: 'q' (the pump read to the end) ends it; 'g' (handed over after the command ended)
# or the lifeline's end without a word (fpdoctor itself was killed, SIGKILL included) starts it
# copying until the last writer closes the stream, so the command never writes into a pipe that
# nobody reads. It ignores the signals a process group gets: it ends when its stream ends. EIO is
# how a pseudo-terminal says its last writer closed it.
_FORWARD = (
    "import os, signal, sys\n"
    "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):\n"
    "    signal.signal(s, signal.SIG_IGN)\n"
    "try:\n"
    "    word = os.read(int(sys.argv[1]), 1)\n"
    "except OSError:\n"
    "    word = b''\n"
    "if word == b'q':\n"
    "    raise SystemExit(0)\n"
    "while True:\n"
    "    try:\n"
    "        b = os.read(0, 65536)\n"
    "    except OSError:\n"
    "        break\n"
    "    if not b:\n"
    "        break\n"
    "    while b:\n"
    "        b = b[os.write(1, b):]\n"
)


# A stream the caller has closed (`>&-`): the command gets it closed too, as from a shell, and its
# writes there fail as they would have (not /dev/null, where they would succeed).
CLOSED = "closed"


def keep_closed_for_the_command(fd: int) -> None:
    """Hold the closed descriptor `fd` with a placeholder that is closed at exec (no pipe or file
    fpdoctor opens may take its number and reach the command through it), so that the command,
    which inherits it, starts with `fd` closed."""
    try:
        os.fstat(fd)
    except OSError:
        placeholder = os.open(os.devnull, os.O_RDONLY)
        if placeholder != fd:
            os.dup2(placeholder, fd, inheritable=False)
            os.close(placeholder)
    os.set_inheritable(fd, False)


class Sink:
    """Where one of the command's streams goes: a file descriptor, a writable object, nowhere (None),
    or CLOSED: the caller's own stream is closed, and so is the command's."""

    def __init__(self, target: Any) -> None:
        self.fd: int | None = None
        self.obj: Any = None
        self.text = False
        self.closed = target is CLOSED
        self.broken = False  # the reader went away: stop reading, the command gets EPIPE/SIGPIPE
        self.failed = False  # any other write error: keep draining (the command must never block)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # chunks split characters
        if target is None or self.closed:
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

    def same_terminal(self, other: Sink) -> bool:
        if not (self.terminal and other.terminal):
            return False
        assert self.fd is not None and other.fd is not None
        return os.path.samestat(os.fstat(self.fd), os.fstat(other.fd))

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


class Pump(threading.Thread):
    """Copy one pipe (or a terminal's master side) to its sink as bytes arrive, keeping a bounded
    tail for the report, until every writer has closed it or it is handed over."""

    def __init__(self, fd: int, sink: Sink, name: str) -> None:
        super().__init__(name=f"fpdoctor-{name}", daemon=True)
        self.fd, self.sink = fd, sink
        self._tail = bytearray()
        self._lock = threading.Lock()
        # hand_over() writes here to wake the pump from poll(): no polling while output flows
        self._wake_r, self._wake_w = os.pipe()
        self.ended = False  # every writer closed it, or its reader went away: nothing to hand over
        self._lifeline = self._standby()  # the forwarding process's lifeline, or None

    def run(self) -> None:
        poller = select.poll()  # not select(): descriptors above 1023 in a process with many files
        poller.register(self.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while True:
            try:
                events = dict(poller.poll())
            except InterruptedError:
                continue
            woken = self._wake_r in events
            if self.fd not in events:
                if woken:
                    return  # handed over: what comes next goes through the forwarding process
                continue
            try:
                chunk = os.read(self.fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                chunk = b""  # EIO: the terminal's last writer closed it
            if not chunk:
                self.ended = True
                return
            self.sink.write(chunk)
            with self._lock:
                self._tail += chunk
                if len(self._tail) > 2 * TAIL_BYTES:
                    del self._tail[: len(self._tail) - TAIL_BYTES]
            if self.sink.broken:
                # close our end, and the forwarding process's: the command gets EPIPE/SIGPIPE as it would have
                self._tell(b"q")
                self.ended = True
                fd, self.fd = self.fd, -1
                with contextlib.suppress(OSError):
                    os.close(fd)
                return
            if woken:
                return

    def unread(self) -> int:
        """Bytes waiting in the pipe (0 once it is closed or where the platform cannot tell)."""
        import fcntl
        import termios

        try:
            got = fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return 0
        return int.from_bytes(got, sys.byteorder)

    def writers_gone(self) -> bool:
        """Every writer has closed the pipe (the terminal): the pump is about to read its end."""
        poller = select.poll()
        try:
            poller.register(self.fd, select.POLLIN)
            return any(ev & (select.POLLHUP | select.POLLERR | select.POLLNVAL) for _, ev in poller.poll(0))
        except (OSError, ValueError):
            return True

    def tail(self) -> bytes:
        with self._lock:
            return bytes(self._tail[-TAIL_BYTES:])

    def _standby(self) -> int | None:
        """Start the forwarding process that takes over the stream when the pump hands it over or
        fpdoctor dies; its lifeline's write end, or None where there is none (a Python object as
        the sink cannot be handed to another process)."""
        if self.sink.fd is None:
            return None
        life_r, life_w = os.pipe()
        try:
            subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _FORWARD, str(life_r)],
                stdin=self.fd,
                stdout=self.sink.fd,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(life_r,),
            )
        except OSError:
            os.close(life_w)
            return None  # as before it: a stream nobody reads once fpdoctor is gone
        finally:
            os.close(life_r)
        return life_w

    def _tell(self, word: bytes) -> None:
        life, self._lifeline = self._lifeline, None
        if life is not None:
            with contextlib.suppress(OSError):
                os.write(life, word)
            with contextlib.suppress(OSError):
                os.close(life)

    def hand_over(self) -> None:
        """After the command ended: whatever still writes here (a background process the command
        left) keeps its stream; the forwarding process copies the rest to the same place."""
        if self.is_alive() and self.writers_gone():
            self.join()  # nothing left to hand over: the pump reads to the end by itself
        if self.is_alive():
            if self._lifeline is None:
                return  # a Python object cannot be handed to another process: keep pumping (daemon)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self.join()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._tell(b"q" if self.ended else b"g")
        if self.fd != -1:
            with contextlib.suppress(OSError):
                os.close(self.fd)


def open_terminal(like: int) -> tuple[int, int]:
    """A pseudo-terminal (master, slave) set up like the terminal `like`: the same modes and
    window size, with output processing left to the real terminal, so the bytes the command
    writes reach it exactly once processed."""
    import pty
    import termios

    master, slave = pty.openpty()
    with contextlib.suppress(OSError, termios.error):
        attrs = termios.tcgetattr(like)
        attrs[1] &= ~termios.OPOST
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
    copy_window_size(like, slave)
    return master, slave


def copy_window_size(src: int, dest: int) -> None:
    import fcntl
    import termios

    with contextlib.suppress(OSError):
        size = fcntl.ioctl(src, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(dest, termios.TIOCSWINSZ, size)
