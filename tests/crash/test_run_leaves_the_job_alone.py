"""`fpdoctor run` does nothing to the job it watches: each case runs the same command with and
without fpdoctor and compares what the job did (exit status, output, files, handlers run)."""

from __future__ import annotations

import contextlib
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
        # as from an interactive shell: SIGINT at its default (a job started in the background by a
        # non-interactive shell, CI's or a test runner's, inherits it ignored)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
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


def test_ctrl_c_in_a_terminal_dies_of_sigint_as_without_fpdoctor(tmp_path):
    """CPython dies by SIGINT after an uncaught KeyboardInterrupt (the shell's 130), unless an
    exception hook imports something while it is handled: then it exits 1."""
    prog = script(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    plain, plain_shown = in_terminal([sys.executable, prog], keys=b"\x03")
    code, shown = in_terminal([*FPDOCTOR, "--", sys.executable, prog], keys=b"\x03")
    assert plain == -signal.SIGINT
    assert code == plain, shown
    assert shown.count(b"KeyboardInterrupt") == plain_shown.count(b"KeyboardInterrupt") == 1


# -- signals to the process group -------------------------------------------------------------

HANDLER = """
import os, signal, sys, time
seen = []
signal.signal(signal.SIGTERM, lambda *a: (seen.append(1), print("shutdown handler", flush=True)))
# Python runs a handler once for signals that arrive together; its C handler writes one byte per
# delivery to the wakeup fd, so a second delivery counts even when the handler ran once.
r, w = os.pipe()
os.set_blocking(w, False)
signal.set_wakeup_fd(w)
print("ready", flush=True)
deadline = time.monotonic() + 60
while not seen and time.monotonic() < deadline:
    time.sleep(0.05)
time.sleep(3)  # a second delivery would come in here
os.set_blocking(r, False)
print("deliveries", len(os.read(r, 100)), flush=True)
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
    assert plain == (0, b"ready\nshutdown handler\ndeliveries 1\n", b"")
    assert watched == plain


def test_only_a_signal_sent_to_fpdoctor_alone_is_passed_on():
    """Which signals fpdoctor passes on, without the timing of two deliveries (a signal that is
    still pending when the same one comes again is delivered once): a group's signal never is,
    one sent to fpdoctor's pid alone is, once."""
    code = textwrap.dedent(
        """
        import os, signal, time
        from fpdoctor.crash.signals import forwarding

        class Command:
            sent = []

            def send_signal(self, signum):
                self.sent.append(signum)

        os.setsid()  # a process group of our own to signal
        with forwarding([]) as bind:
            bind(Command())
            os.killpg(os.getpgrp(), signal.SIGUSR1)
            time.sleep(2)
            group = list(Command.sent)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(2)
        print(group, Command.sent[len(group):])
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == f"[] [{int(signal.SIGUSR1)}]\n"


CHECKPOINT_WRITER = """
import multiprocessing, os, signal, sys, time
disposition, start, path = sys.argv[1:]
stopping = []
if disposition == "handler":
    signal.signal(signal.SIGTERM, lambda *a: stopping.append(1))  # a graceful shutdown, after the write
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

def write():
    with open(path + ".tmp", "wb") as fh:
        for i in range(8):
            fh.write(bytes(48 * 1024))
            fh.flush()
            if i == 0:
                print("ready", flush=True)
            time.sleep(0.05)
    os.replace(path + ".tmp", path)

if start == "fork":
    pid = os.fork()
    if pid == 0:
        write()
        os._exit(0)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
else:
    writer = multiprocessing.get_context("fork").Process(target=write)
    writer.start()
    writer.join()
    code = writer.exitcode
print("writer", code, flush=True)
sys.exit(0 if code == 0 else 1)
"""


@pytest.mark.parametrize("start", ["fork", "multiprocessing"])
@pytest.mark.parametrize("disposition", ["handler", "ignore"])
def test_a_forked_checkpoint_writer_keeps_the_sigterm_disposition_it_inherited(tmp_path, disposition, start):
    """A program that handles (or ignores) SIGTERM and then forks a checkpoint writer: the group's
    SIGTERM finds the writer with its parent's disposition, and the checkpoint is written whole."""
    prog = script(tmp_path, CHECKPOINT_WRITER)
    results = []
    for argv in ([sys.executable], [*FPDOCTOR, "--", sys.executable]):
        checkpoint = tmp_path / "checkpoint"
        checkpoint.unlink(missing_ok=True)
        results.append(_signalled([*argv, prog, disposition, start, str(checkpoint)], signal.SIGTERM, group=True))
        assert checkpoint.stat().st_size == 8 * 48 * 1024 and not list(tmp_path.glob("*.tmp"))
    plain, watched = results
    assert plain == (0, b"ready\nwriter 0\n", b"")
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
    assert (
        (watched.returncode, watched.stdout, watched.stderr)
        == (0, plain.stdout, plain.stderr)
        == (
            0,
            b"apex available: False\n",
            b"",
        )
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
    # The worker's own handler always says so; the main process then raises either "killed by
    # signal" or, when its queue read wins the race with torch's SIGCHLD check, an EOFError.
    assert result.returncode == 1 and b"Unexpected segmentation fault encountered in worker" in result.stderr
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
    names = [f["name"] for f in doc["findings"] if not f["code"].startswith("ENV")]  # not the machine's
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


# -- 2-rank torchrun jobs (gloo over loopback) ------------------------------------------------

JOB = """
import os, signal, subprocess, sys, time
import torch
import torch.distributed as dist

mode, out = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
if mode == "probe":
    # an optional-dependency probe through a shell: the grandchild inherits RANK and fails
    probe = subprocess.run(f"{sys.executable} -c 'import apex_not_installed'", shell=True, capture_output=True)
    total = torch.ones(1)
    dist.all_reduce(total)
    os.write(1, f"rank {rank} probe {probe.returncode} sum {total.item():g}\\n".encode())  # one write per line
    time.sleep(4)  # longer than any bounded wait after the probe's failure
    dist.barrier()
    os.write(1, f"rank {rank} done\\n".encode())
elif mode == "checkpoint":
    if rank == 0:
        def save(*args):
            print("rank 0 saving", flush=True)
            time.sleep(5)  # an emergency checkpoint takes its time
            with open(os.path.join(out, "ckpt"), "w") as fh:
                fh.write("saved")
            print("rank 0 saved", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, save)
    dist.barrier()
    if rank == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(60)
dist.destroy_process_group()
"""


def _free_ports(n: int) -> list[int]:
    """n different free ports (held open together while they are chosen, so never the same one)."""
    import socket

    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def torchrun_both(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[bytes], ...]:
    """The job under plain torchrun and under fpdoctor run -o report.json, side by side (each mostly
    waits: its ranks sleep, or torchrun waits for them); each in a directory of its own for the
    files it writes."""
    pytest.importorskip("torch")
    job = script(tmp_path, JOB, "job.py")
    started = []
    ports = _free_ports(2)
    for port, (name, wrap) in zip(
        ports, (("plain", []), ("watched", [*FPDOCTOR, "-o", str(tmp_path / "report.json"), "--"])), strict=True
    ):
        out = tmp_path / name
        out.mkdir()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port), job, mode, str(out)]
        command = [*wrap, *torchrun]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        started.append((command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)))
    results = []
    for command, proc in started:
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for _, other in started:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(command, proc.returncode, stdout, stderr))
    return tuple(results)


def lines(data: bytes) -> list[bytes]:
    return sorted(data.splitlines())  # two ranks print in either order


@pytest.mark.jobs  # 2-rank torchrun job
@pytest.mark.timeout(600)
def test_a_ranks_child_that_inherits_rank_is_not_a_rank(tmp_path):
    plain, watched = torchrun_both(tmp_path, "probe")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert watched.returncode == 0, watched.stderr[-3000:]
    assert (
        lines(watched.stdout)
        == lines(plain.stdout)
        == [
            b"rank 0 done",
            b"rank 0 probe 1 sum 2",
            b"rank 1 done",
            b"rank 1 probe 1 sum 2",
        ]
    )
    assert watched.stderr == plain.stderr  # a clean exit adds nothing
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["verdict"] == "ok"  # the probes' own failures are notes in the file, nothing more
    assert {(f["name"], f["severity"]) for f in doc["findings"]} == {("uncaught-exception", "info")}
    ranks = [p for p in doc["data"]["processes"] if p.get("rank") is not None]
    assert len(ranks) == 4  # two ranks, and the probe each of them started
    assert "2 rank(s)" in dict(doc["data"]["summary"])["processes"]


@pytest.mark.jobs  # 2-rank torchrun job
@pytest.mark.timeout(600)
def test_the_launchers_own_shutdown_is_left_to_it(tmp_path):
    """Rank 1 fails; torchrun stops rank 0 with SIGTERM and waits for it (up to 30 s): its handler
    writes a checkpoint in 5 s. fpdoctor neither cuts that short nor signals the ranks itself."""
    plain, watched = torchrun_both(tmp_path, "checkpoint")
    assert plain.returncode == watched.returncode == 1
    for result, name in ((plain, "plain"), (watched, "watched")):
        assert (tmp_path / name / "ckpt").read_text() == "saved", result.stderr[-3000:]
        assert result.stdout.count(b"rank 0 saving") == 1 and b"rank 0 saved" in result.stdout
    doc = json.loads((tmp_path / "report.json").read_text())
    first = doc["findings"][0]
    assert first["name"] == "uncaught-exception" and first["where"]["rank"] == 1
    (stopped,) = [f for f in doc["findings"] if f["name"] == "rank-stopped"]
    assert stopped["where"]["rank"] == 0 and stopped["evidence"]["ended"] == "exited", stopped
    assert "stopped" not in dict(doc["data"]["summary"])
