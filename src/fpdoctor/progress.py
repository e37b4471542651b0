"""Progress on stderr while a long command runs: which pass, which candidate, which device, how far.

The CLI switches a display on for one command (`with display(wanted(quiet=args.quiet)):`); library
code opens `task(...)` wherever time goes, whether a display is on or not:

    with progress.task(f"compare {candidate}: pass {k}/{n}", total=n) as step:
        ...
        step.advance()

Without a display `task` returns one shared do-nothing object: rich is not imported and nothing is
allocated. With one, a transient rich display on stderr shows one line per open task and removes a
task's line when it ends, so nothing of it stays on the screen, and nothing of it reaches stdout, a
pipe, a file or a report: the display is only ever on when stderr is a terminal.

While it is on, what the program writes to `sys.stderr` (and to `sys.stdout` when that is the same
terminal) goes above the display byte for byte, a line at a time, instead of under a redraw. A
program that draws its own progress in place (a carriage return without a newline: tqdm in a script
under `fpdoctor trace`) gets the terminal back: the display ends there, as `close()` ends it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Task", "close", "display", "task", "wanted"]

# A few redraws a second: enough to see it move; a task's start and end redraw at once anyway.
REFRESH_PER_SECOND = 4


class Task:
    """What `task()` yields: `.advance(n)` counts work done, `.describe(text)` says what runs now.
    This base class is the do-nothing handle used when no display is on; a handle may be advanced
    from any thread (a worker per device), but open tasks in the thread that runs the command."""

    __slots__ = ()

    def __enter__(self) -> Task:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def advance(self, n: int = 1) -> None:
        pass

    def describe(self, text: str) -> None:
        pass


_OFF = Task()
_CURRENT: contextvars.ContextVar[_Display | None] = contextvars.ContextVar("fpdoctor_progress", default=None)


def task(
    description: str, total: int | None = None, *, unit: str = "", status: Callable[[], str] | None = None
) -> Task:
    """A line of the display for the `with` block: `description`, `done/total unit` (or `done unit`
    without a total, once something is done) and the time it has taken. `status`, where given, is
    called on each redraw from the display's own thread (a few times a second) and its text follows
    the description: a way to show a counter that changes per op without touching the display per op.
    A task's start and end redraw at once (about a millisecond on a terminal): open one per pass,
    stage or device and advance it per item (a microsecond), never one per op or per module."""
    shown = _CURRENT.get()
    if shown is None or shown.closed:
        return _OFF
    return _Shown(shown, description, total, unit, status)


def wanted(*, quiet: bool) -> bool:
    """Whether a command shows progress: stderr is a terminal that can redraw (not TERM=dumb), the
    user did not ask for --quiet, and under a launcher that starts several ranks (torchrun) this is
    the node's first rank: the others share its terminal. NO_COLOR only takes the colours away."""
    if quiet or os.environ.get("TERM") == "dumb":
        return False
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")).strip() not in ("", "0"):
        return False
    try:
        return bool(sys.stderr.isatty())
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


@contextlib.contextmanager
def display(enabled: bool) -> Iterator[None]:
    """Show the tasks opened inside the block on stderr, when `enabled` (see `wanted`); off,
    nothing is created. The display is gone, and sys.stderr/sys.stdout are what they were,
    when the block ends however it ends."""
    if not enabled or _CURRENT.get() is not None:
        yield
        return
    shown = _Display()
    token = _CURRENT.set(shown)
    try:
        yield
    finally:
        shown.close()
        _CURRENT.reset(token)


def close() -> None:
    """End the display now, before its block ends: a command that writes its report to stderr
    calls it first, so no redraw can land in the report. Later tasks are no-ops; idempotent."""
    shown = _CURRENT.get()
    if shown is not None:
        shown.close()


class _Display:
    """A transient rich Progress on stderr, and the streams that write above it while it runs."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        self.closed = False
        stderr = sys.stderr
        # The file is fixed here: sys.stderr is replaced below, and the console writes to the terminal.
        self.console = Console(file=stderr)
        self._streams: list[tuple[str, _Above]] = []
        if not self.console.is_interactive:  # a terminal rich will not redraw on (TTY_INTERACTIVE=0)
            self.closed = True
            return
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.fields[shown]:line}", markup=False),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[shown]:count}", markup=False),
            TimeElapsedColumn(),
            console=self.console,
            transient=True,
            refresh_per_second=REFRESH_PER_SECOND,
            redirect_stdout=False,  # replaced by _Above below: rich's own proxy would re-wrap the lines
            redirect_stderr=False,
        )
        self.progress.start()
        self._above("stderr", stderr)
        if _same_terminal(sys.stdout, stderr):
            self._above("stdout", sys.stdout)

    def _above(self, name: str, stream: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            stream.flush()  # what it holds was written before the display: it goes out first
        proxy = _Above(self.console, stream, self.close)
        setattr(sys, name, proxy)
        self._streams.append((name, proxy))

    def remove(self, task_id: Any) -> None:
        self.progress.remove_task(task_id)
        self.progress.refresh()  # the line goes now, not at the next redraw

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.progress.stop()
        finally:
            for name, proxy in reversed(self._streams):
                if getattr(sys, name) is proxy:
                    setattr(sys, name, proxy.target)
                proxy.detach()  # a half-written line goes out; later writes pass straight through


class _Shown(Task):
    """A task on a live display."""

    __slots__ = ("_display", "_done", "_id", "_status", "_text", "_total", "_unit")

    def __init__(
        self, shown: _Display, description: str, total: int | None, unit: str, status: Callable[[], str] | None
    ) -> None:
        self._display = shown
        self._text = description
        self._total = total
        self._unit = unit
        self._status = status
        self._done = 0
        self._id: Any = None

    def __enter__(self) -> Task:
        self._id = self._display.progress.add_task(self._text, total=self._total, shown=self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._id is not None:
            self._display.remove(self._id)
            self._id = None

    def advance(self, n: int = 1) -> None:
        self._done += n
        if self._id is not None:
            self._display.progress.advance(self._id, n)

    def describe(self, text: str) -> None:
        self._text = text
        if self._id is not None:
            self._display.progress.update(self._id, description=text)

    def __format__(self, spec: str) -> str:
        """The columns' text, read on each redraw: `line` the description and status, `count` how far."""
        if spec == "count":
            unit = f" {self._unit}" if self._unit else ""
            if self._total is not None:
                return f"{self._done}/{self._total}{unit}"
            return f"{self._done}{unit}" if self._done else ""
        if self._status is None:
            return self._text
        try:
            extra = self._status()
        except Exception:  # the display never stops the work it shows
            extra = ""
        return f"{self._text}: {extra}" if extra else self._text


class _Verbatim:
    """Text that rich writes as it is: no wrapping, no cropping, no markup, escape codes kept."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console: Any, options: Any) -> Iterator[Any]:
        from rich.segment import Segment

        yield Segment(self.text)


class _Above:
    """Stands in for sys.stderr (and a stdout on the same terminal) while the display runs: whole
    lines are written above the display through the console, so a redraw never overwrites them; a
    line without its newline yet waits for it (or for the display's end). Everything else -
    fileno, isatty, encoding, buffer - is the stream's own."""

    def __init__(self, console: Any, target: Any, step_aside: Callable[[], None]) -> None:
        self._console = console
        self.target = target
        self._step_aside = step_aside
        self._pending = ""
        self._lock = threading.RLock()  # step_aside detaches this proxy from inside its own write
        self._live = True
        _after_fork_in_child(self)

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        with self._lock:
            if self._live and "\r" in text.replace("\r\n", "\n"):
                self._step_aside()  # a line redrawn in place cannot share the terminal with the display
            if not self._live:  # after the display, or kept past it (a logging handler): straight through
                return int(self.target.write(text))
            cut = text.rfind("\n") + 1
            if not cut:
                self._pending += text
                return len(text)
            lines, self._pending = self._pending + text[:cut], text[cut:]
            self._console.print(_Verbatim(lines), end="", crop=False, soft_wrap=True)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.target.flush()

    def detach(self) -> None:
        with self._lock:
            self._live = False
            if self._pending:
                self.target.write(self._pending)
                self._pending = ""
        with contextlib.suppress(OSError, ValueError):
            self.target.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


_FORKED: list[_Above] = []  # the proxies a forked child (a DataLoader worker) must not draw through


def _after_fork_in_child(proxy: _Above) -> None:
    """In a child forked while the display runs, there is no display (its thread is not copied):
    the child's writes go straight to the stream, never a stale copy of the parent's lines."""
    _hook_fork()
    _FORKED.append(proxy)
    del _FORKED[:-8]  # ended displays' proxies pass straight through already


@functools.cache
def _hook_fork() -> None:
    if hasattr(os, "register_at_fork"):  # POSIX; once per process
        os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    for proxy in _FORKED:
        proxy._lock = threading.RLock()  # another thread may have held it at the fork
        proxy._live = False
        proxy._pending = ""  # the parent writes its own half line


def _same_terminal(stream: Any, other: Any) -> bool:
    """Whether `stream` writes to the same terminal as `other`: then its lines must go above the
    display too. A stdout that is a pipe or a file is never touched."""
    try:
        if not stream.isatty():
            return False
        return os.path.samestat(os.fstat(stream.fileno()), os.fstat(other.fileno()))
    except (AttributeError, OSError, ValueError):
        return False
