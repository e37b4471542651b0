"""Progress on stderr (fpdoctor.progress): off without a terminal or with --quiet, transient on one,
never in stdout or a report."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from fpdoctor import progress
from tests.conftest import ROOT, Result, run_fpdoctor

MODEL = (
    "import torch\n"
    "def make():\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))\n"
    "    return model, torch.randn(16, 64)\n"
)

SCRIPT = textwrap.dedent("""
    import sys
    import torch

    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(20):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("script stdout", step)
    print("script stderr", step, file=sys.stderr)
""")

# the environment of a user at a terminal; a rank other than 0 or NO_COLOR must not leak in from outside
_TERMINAL_ENV = {"TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
_DROPPED = ("NO_COLOR", "FORCE_COLOR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "TTY_COMPATIBLE", "TTY_INTERACTIVE")
# rich's cursor: hidden while the display is live, shown again when it ends
_SHOW_CURSOR = b"\x1b[?25h"


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("spec") / "mlp.py"
    path.write_text(MODEL)
    return f"{path}:make"


@pytest.fixture(scope="module")
def quiet_plan(spec: str) -> Result:
    """`plan --candidate fp16 --quiet` with no terminal: the report the other runs of it must print
    (one run for the module's tests; each run is a fresh interpreter that imports torch)."""
    return run_fpdoctor("plan", spec, "--candidate", "fp16", "--quiet")


def _terminal_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    return {**env, **_TERMINAL_ENV}


def _open_pty() -> tuple[int, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def _drain(master: int, into: bytearray, until: threading.Event) -> None:
    """Read the terminal's side until it closes (EIO once the last writer is gone) or `until` is set."""
    while True:
        ready, _, _ = select.select([master], [], [], 0.05)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            into += chunk
        elif until.is_set():
            return


@dataclass
class PtyRun:
    code: int
    out: bytes  # stdout: a pipe
    terminal: bytes  # what reached stderr, a terminal


def run_on_terminal(*args: str, cwd: object = ROOT, timeout: float = 240) -> PtyRun:
    """`python -m fpdoctor ARGS` with stderr on a pseudo-terminal and stdout a pipe."""
    master, slave = _open_pty()
    seen = bytearray()
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, seen, stop), daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fpdoctor", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=_terminal_env(),
            cwd=cwd,
        )
        os.close(slave)
        slave = -1
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    finally:
        if slave >= 0:
            os.close(slave)
        stop.set()
        reader.join(timeout=10)
        os.close(master)
    return PtyRun(proc.returncode, out, bytes(seen))


# --- the library: off, on, nested, errors -------------------------------------------------------


def test_off_is_one_shared_no_op_and_imports_nothing():
    code = textwrap.dedent("""
        import sys
        import fpdoctor
        from fpdoctor import progress
        with progress.display(False):
            with progress.task("outer", total=2, unit="runs") as outer:
                outer.advance()
                outer.describe("still outer")
                with progress.task("inner", status=lambda: 1 / 0) as inner:
                    inner.advance(3)
            assert outer is inner is progress.task("another"), "the no-op handle is one shared object"
        assert "rich" not in sys.modules and "torch" not in sys.modules, sorted(sys.modules)
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and proc.stdout == "ok\n" and proc.stderr == "", proc.stderr


def test_wanted_only_on_a_terminal_not_quiet_not_dumb_first_rank(monkeypatch):
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    for name in (*_DROPPED, "TERM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.wanted(quiet=False)  # a pipe, a file, pytest's capture
    monkeypatch.setattr(sys, "stderr", Tty())
    assert progress.wanted(quiet=False)
    assert not progress.wanted(quiet=True)
    monkeypatch.setenv("NO_COLOR", "1")  # colours only
    assert progress.wanted(quiet=False)
    monkeypatch.setenv("TERM", "dumb")
    assert not progress.wanted(quiet=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("RANK", "3")
    assert not progress.wanted(quiet=False)
    monkeypatch.setenv("LOCAL_RANK", "0")  # the first rank of its node: its own terminal
    assert progress.wanted(quiet=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not progress.wanted(quiet=False)


@pytest.fixture
def terminal(monkeypatch):
    """A function that puts sys.stderr on a pseudo-terminal (stdout a StringIO, not the terminal)
    and returns (the terminal's stream, a function returning what it received). Called in the
    test itself: pytest's capture puts its own sys.stderr back between a fixture and the test."""
    master, slave = _open_pty()
    stream = os.fdopen(slave, "w", buffering=1, encoding="utf-8")
    seen = bytearray()
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, seen, stop), daemon=True)
    reader.start()
    for name in _DROPPED:
        monkeypatch.delenv(name, raising=False)
    for name, value in _TERMINAL_ENV.items():
        monkeypatch.setenv(name, value)

    def attach() -> tuple[io.TextIOWrapper, Callable[[], bytes]]:
        monkeypatch.setattr(sys, "stderr", stream)
        monkeypatch.setattr(sys, "stdout", io.StringIO())
        return stream, received

    def received() -> bytes:
        stream.flush()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the reader catches up
            size = len(seen)
            time.sleep(0.1)
            if len(seen) == size:
                break
        return bytes(seen)

    yield attach
    stop.set()
    reader.join(timeout=10)
    stream.close()
    os.close(master)


def _shown() -> list[str]:
    shown = progress._CURRENT.get()
    assert shown is not None
    return [t.description for t in shown.progress.tasks]


def test_nested_tasks_are_lines_of_their_own_and_go_when_they_end(terminal):
    stream, received = terminal()
    with progress.display(progress.wanted(quiet=False)):
        assert sys.stderr is not stream  # what is written goes above the display
        with progress.task("outer pass", total=3, unit="runs") as outer:
            with progress.task("inner candidate", status=lambda: "12 ops"):
                outer.advance()
                assert _shown() == ["outer pass", "inner candidate"]
            assert _shown() == ["outer pass"]
            outer.describe("outer pass, renamed")
            assert _shown() == ["outer pass, renamed"]
        assert _shown() == []
    assert sys.stderr is stream and progress._CURRENT.get() is None
    text = received().decode()
    assert "outer pass" in text and "inner candidate: 12 ops" in text and "1/3 runs" in text
    assert text.rstrip().endswith(_SHOW_CURSOR.decode())  # the display is gone at the end


def test_an_exception_inside_a_task_ends_the_display(terminal):
    stream, received = terminal()
    with pytest.raises(ValueError, match="boom"), progress.display(True):
        shown = progress._CURRENT.get()
        with progress.task("a pass that fails"):
            raise ValueError("boom")
    assert sys.stderr is stream and progress._CURRENT.get() is None
    assert shown is not None and shown.closed and not shown.progress.live.is_started
    assert progress.task("after") is progress.task("again")  # no display: the no-op handle
    assert received().rstrip().endswith(_SHOW_CURSOR)


def test_what_the_program_writes_goes_above_the_display_as_written(terminal):
    _stream, received = terminal()
    line = "\tlong line " + "x" * 300 + " \x1b[31mred\x1b[0m [bold]not markup[/]"
    with progress.display(True), progress.task("working"):
        held = sys.stderr  # a logging handler keeps the stream it was given
        print(line, file=sys.stderr)
        sys.stderr.write("half a line")
    held.write(" and after the display\n")  # passes straight through now
    text = received().decode()
    assert line in text  # not wrapped at 120 columns, not cropped, escapes and brackets kept
    assert text.index(line) < text.index("half a line and after the display")


def test_a_line_redrawn_in_place_gets_the_terminal_back(terminal):
    stream, received = terminal()
    with progress.display(True), progress.task("working"):
        for i in range(3):
            sys.stderr.write(f"\r{i * 10}%")  # tqdm's way
        assert sys.stderr is stream and progress.task("later") is progress.task("again")
    assert b"\r0%\r10%\r20%" in received()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_writes_straight_through(terminal):
    _, received = terminal()
    with progress.display(True), progress.task("parent"):
        pid = os.fork()  # as a DataLoader worker is started
        if pid == 0:
            through = not sys.stderr._live  # no display thread here: no stale copy of the parent's lines
            sys.stderr.write("child line\n")
            sys.stderr.flush()
            os._exit(0 if through else 3)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert b"child line" in received()


def test_close_ends_the_display_before_its_block_does(terminal):
    stream, received = terminal()
    with progress.display(True):
        with progress.task("the script runs"):
            pass
        progress.close()
        assert sys.stderr is stream
        stream.write("the report\n")
        assert progress.task("later") is progress.task("again")
    text = received()
    assert text.index(_SHOW_CURSOR) < text.index(b"the report")


def test_a_stdout_that_is_not_the_terminal_is_never_touched(terminal):
    terminal()
    out = sys.stdout
    with progress.display(True):
        assert sys.stdout is out
        print("stdout stays a pipe")
    assert out.getvalue() == "stdout stays a pipe\n"


# --- the commands: no terminal, --quiet, a terminal ---------------------------------------------


def test_no_terminal_no_progress_and_the_same_bytes_as_quiet(spec, quiet_plan):
    compare = ("compare", spec, "--candidate", "fp16")
    compared = run_fpdoctor(*compare), run_fpdoctor(*compare, "--quiet")
    planned = run_fpdoctor("plan", spec, "--candidate", "fp16"), quiet_plan
    for plain, quiet in (compared, planned):
        assert plain.code == quiet.code and plain.out == quiet.out and plain.err == quiet.err == ""
        assert plain.out.strip()
    health = run_fpdoctor("health", "--duration", "0")
    assert health.err == "" and "health:" not in health.out, health.err


def test_a_terminal_shows_progress_on_stderr_and_stdout_holds_only_the_report(spec, quiet_plan):
    expected = quiet_plan
    shown = run_on_terminal("plan", spec, "--candidate", "fp16")
    assert shown.code == expected.code and shown.out.decode() == expected.out
    assert b"plan fp16: compare against fp64" in shown.terminal
    assert shown.terminal.rstrip().endswith(_SHOW_CURSOR)  # nothing of it stays

    quiet = run_on_terminal("plan", spec, "--candidate", "fp16", "-q")
    assert quiet.code == expected.code and quiet.out.decode() == expected.out and quiet.terminal == b""


def test_health_on_a_terminal(tmp_path):
    shown = run_on_terminal("health", "--duration", "0", "--format", "json")
    assert b"health: NVML facts per GPU" in shown.terminal
    assert shown.out.startswith(b"{") and b"health:" not in shown.out


def test_errors_still_reach_the_terminal_with_and_without_quiet(tmp_path):
    for quiet in ((), ("--quiet",)):
        shown = run_on_terminal("plan", f"{tmp_path}/missing.py:make", "--candidate", "fp16", *quiet)
        assert shown.code == 2 and shown.out == b""
        error = shown.terminal.index(b"fpdoctor: error:")
        assert _SHOW_CURSOR not in shown.terminal[error:]  # written once the display had gone


def test_trace_on_a_terminal_the_display_ends_before_the_report(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    shown = run_on_terminal("trace", "train.py", cwd=tmp_path)  # a short path: the line is not cut
    assert shown.code == 0 and shown.out == b"script stdout 19\n"  # stdout is the script's alone
    text = shown.terminal
    assert b"trace train.py: 0 ops traced" in text  # drawn as the script starts
    report = text.index(b"fpdoctor trace")
    assert text.rindex(_SHOW_CURSOR) < report and b"script stderr 19" in text[:report]
    assert b"ops traced" in text[report:]  # the report's own summary, after the display
