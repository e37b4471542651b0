"""`fpdoctor run` does nothing to the job it watches: each case runs the same command with and
without fpdoctor and compares what the job did (exit status, output, files, handlers run)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

FPDOCTOR = [sys.executable, "-m", "fpdoctor", "run"]


def script(tmp_path: Path, body: str, name: str = "prog.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def in_terminal(argv: list[str], *, env: dict[str, str] | None = None, keys: bytes = b"", after: bytes = b"ready"):
    """Run argv with a terminal as its stdin, stdout and stderr (its controlling terminal, in the
    foreground, as from an interactive shell); type `keys` once `after` was printed. Returns the
    exit status as os.waitstatus_to_exitcode gives it and everything the terminal showed."""
    pid, fd = pty.fork()
    if pid == 0:  # pragma: no cover - the child execs at once
        os.execve(argv[0], argv, {**os.environ, **(env or {})})
    shown, typed = b"", not keys
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal has ended
                    break
                if not chunk:
                    break
                shown += chunk
            if not typed and after in shown:
                time.sleep(0.5)
                os.write(fd, keys)
                typed = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown


# -- Ctrl-C -----------------------------------------------------------------------------------


def test_ctrl_c_in_a_terminal_exits_130_as_without_fpdoctor(tmp_path):
    """CPython dies by SIGINT after an uncaught KeyboardInterrupt (the shell's 130), unless an
    exception hook imports something while it is handled: then it exits 1."""
    prog = script(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    plain, plain_shown = in_terminal([sys.executable, prog], keys=b"\x03")
    code, shown = in_terminal([*FPDOCTOR, "--", sys.executable, prog], keys=b"\x03")
    assert plain == -signal.SIGINT
    assert code == 128 + signal.SIGINT, shown
    assert shown.count(b"KeyboardInterrupt") == plain_shown.count(b"KeyboardInterrupt") == 1


# -- signals to the process group -------------------------------------------------------------

HANDLER = """
import os, signal, sys, time
seen = []
signal.signal(signal.SIGTERM, lambda *a: (seen.append(1), print("shutdown handler", flush=True)))
print("ready", flush=True)
deadline = time.monotonic() + 60
while not seen and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(3)  # a second delivery would come in here
print("handled", len(seen), flush=True)
"""


def _signalled(argv: list[str], signum: int, *, group: bool) -> tuple[int, bytes, bytes]:
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"
        if group:
            os.killpg(proc.pid, signum)  # scancel, systemd, a shell's job kill
        else:
            proc.send_signal(signum)  # `kill PID`, a container's PID 1 being stopped
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, b"ready\n" + out, err


@pytest.mark.parametrize("group", [True, False], ids=["process-group", "fpdoctor-alone"])
def test_sigterm_reaches_the_command_once(tmp_path, group):
    prog = script(tmp_path, HANDLER)
    plain = _signalled([sys.executable, prog], signal.SIGTERM, group=group)
    watched = _signalled([*FPDOCTOR, "--", sys.executable, prog], signal.SIGTERM, group=group)
    assert plain == (0, b"ready\nshutdown handler\nhandled 1\n", b"")
    assert watched == plain


# -- what the command leaves running ----------------------------------------------------------


def test_a_background_helper_keeps_its_stderr_after_the_command_exits(tmp_path):
    """A fire-and-forget upload that logs to stderr: fpdoctor exits with the command, and the
    helper goes on writing to the same stderr, to its end (no SIGPIPE from a closed pipe)."""
    done = tmp_path / "uploaded"
    helper = script(
        tmp_path,
        f"""
        import sys, time
        time.sleep(2)
        for i in range(3):
            print("upload", i, file=sys.stderr, flush=True)
            time.sleep(0.1)
        open({str(done)!r}, "w").write("ok")
        """,
        "helper.py",
    )
    prog = script(
        tmp_path,
        f"""
        import subprocess, sys
        subprocess.Popen([sys.executable, {helper!r}])
        print("training done", flush=True)
        """,
    )
    proc = subprocess.Popen([*FPDOCTOR, "--", sys.executable, prog], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.wait(timeout=120) == 0
    exited = time.time()
    out, err = proc.communicate(timeout=60)  # to EOF: until the helper has closed the stream
    assert out == b"training done\n"
    assert err == b"upload 0\nupload 1\nupload 2\n"
    assert done.exists() and done.stat().st_mtime > exited  # it ended after fpdoctor had


# -- a terminal stays a terminal --------------------------------------------------------------

INTERLEAVED = """
import sys
print("ready", sys.stdout.isatty(), sys.stderr.isatty(), flush=True)
for i in range(150):
    print("out", i)
    print("err", i, file=sys.stderr)
"""


def test_in_a_terminal_the_command_keeps_a_terminal_and_its_order(tmp_path):
    """isatty stays true for stdout and stderr, interleaved lines keep their order, and unbuffered
    output (print's text and newline written apart) is not glued together."""
    prog = script(tmp_path, INTERLEAVED)
    env = {"PYTHONUNBUFFERED": "1"}
    plain, expected = in_terminal([sys.executable, prog], env=env)
    code, shown = in_terminal([*FPDOCTOR, "--", sys.executable, prog], env=env)
    assert plain == code == 0
    assert expected.startswith(b"ready True True\r\n")
    assert shown == expected


# -- a clean exit -----------------------------------------------------------------------------


def test_a_child_that_fails_inside_a_clean_run_adds_nothing(tmp_path):
    """An optional-dependency probe in a child process fails; the command handles it and exits 0."""
    prog = script(
        tmp_path,
        """
        import subprocess, sys
        probe = subprocess.run([sys.executable, "-c", "import apex_not_installed"], capture_output=True)
        print("apex available:", probe.returncode == 0)
        """,
    )
    plain = subprocess.run([sys.executable, prog], capture_output=True, timeout=120, check=False)
    watched = subprocess.run([*FPDOCTOR, "--", sys.executable, prog], capture_output=True, timeout=120, check=False)
    assert (watched.returncode, watched.stdout, watched.stderr) == (0, plain.stdout, plain.stderr) == (
        0,
        b"apex available: False\n",
        b"",
    )


# -- DataLoader workers -----------------------------------------------------------------------

DATALOADER = """
import ctypes
import torch
from torch.utils.data import DataLoader, Dataset

class Data(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 5:
            ctypes.string_at(0)  # a native library's bug inside the worker
        return torch.full((4,), float(i))

for batch in DataLoader(Data(), batch_size=4, num_workers=1):
    pass
"""


def _report(tmp_path: Path, argv: list[str]) -> tuple[subprocess.CompletedProcess[bytes], dict]:
    out = tmp_path / "report.json"
    result = subprocess.run([*FPDOCTOR, "-o", str(out), "--", *argv], capture_output=True, timeout=240, check=False)
    return result, json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.timeout(300)
def test_a_segfault_in_a_dataloader_worker_is_named(tmp_path):
    pytest.importorskip("torch")
    result, doc = _report(tmp_path, [sys.executable, script(tmp_path, DATALOADER)])
    assert result.returncode == 1 and b"killed by signal: Segmentation fault" in result.stderr
    first = doc["findings"][0]
    assert first["name"] == "fatal-signal" and first["evidence"]["signal"] == "SIGSEGV", first
    worker = next(p for p in doc["data"]["processes"] if p["pid"] == first["where"]["pid"])
    assert worker["ppid"] != os.getpid() and worker["ended"] == "signal"
    assert doc["verdict"] == "error"


def test_a_worker_death_behind_a_lost_connection_is_not_a_lost_rank(tmp_path):
    """The main process's own error is a ConnectionResetError whose cause names the dead worker
    (torch's message): the worker's SIGSEGV comes first, and in a job without ranks nothing
    speaks of a collective or another rank."""
    prog = script(
        tmp_path,
        """
        import ctypes, faulthandler, os, sys
        pid = os.fork()
        if pid == 0:
            faulthandler.disable()  # torch's worker handler replaces faulthandler's
            sys.stderr.write("ERROR: Unexpected segmentation fault encountered in worker.\\n")
            sys.stderr.flush()
            ctypes.string_at(0)
        os.waitpid(pid, 0)
        try:
            raise RuntimeError(f"DataLoader worker (pid {pid}) is killed by signal: Segmentation fault. ")
        except RuntimeError as exc:
            raise ConnectionResetError(104, "Connection reset by peer") from exc
        """,
    )
    result, doc = _report(tmp_path, [sys.executable, prog])
    assert result.returncode == 1
    names = [f["name"] for f in doc["findings"]]
    assert names == ["fatal-signal", "uncaught-exception"], names
    assert doc["findings"][0]["evidence"]["signal"] == "SIGSEGV"
    text = json.dumps(doc)
    assert "collective" not in text and "another rank" not in text


# -- torch.compile under --breadcrumbs --------------------------------------------------------

COMPILED = """
import torch
from torch import nn
from torch._dynamo.utils import counters

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # the code around a break runs eagerly, modules and all
        return self.b(x) * 2

compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Net()), backend="eager")
for _ in range(3):
    compiled(torch.randn(2, 8))
stats = counters["stats"]
print("graphs", stats["unique_graphs"], "ops", stats["calls_captured"], "frames", counters["frames"]["total"])
print("breaks", sum(counters["graph_break"].values()))
"""


@pytest.mark.timeout(400)
def test_breadcrumbs_do_not_change_what_torch_compile_compiles(tmp_path):
    pytest.importorskip("torch")
    prog = script(tmp_path, COMPILED)
    plain = subprocess.run([sys.executable, prog], capture_output=True, timeout=300, check=False)
    watched = subprocess.run(
        [*FPDOCTOR, "--breadcrumbs", "--", sys.executable, prog], capture_output=True, timeout=300, check=False
    )
    assert plain.returncode == watched.returncode == 0, watched.stderr[-2000:]
    assert watched.stdout == plain.stdout
    assert watched.stderr == plain.stderr  # no Dynamo warnings about global hooks or recompiles
