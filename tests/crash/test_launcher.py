"""The launcher: streams byte for byte and live, terminals kept, signals forwarded, never hangs."""

from __future__ import annotations

import io
import os
import pty
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fpdoctor.crash import CommandError, run_command
from fpdoctor.crash.launcher import descendants, launch


def script(tmp_path: Path, body: str, name: str = "prog.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_large_output_passes_byte_for_byte(tmp_path):
    prog = script(
        tmp_path,
        """
        import os, sys
        block = bytes(range(256)) * 256  # every byte value, 64 KiB
        for i in range(80):
            os.write(1, block)
            if i % 7 == 0:
                os.write(2, b"progress %d\\n" % i)
        """,
    )
    out, err = io.BytesIO(), io.BytesIO()
    result = run_command([sys.executable, prog], stdout=out, stderr=err, environment=False)
    assert result.exit_code == 0
    assert out.getvalue() == bytes(range(256)) * 256 * 80
    assert err.getvalue() == b"".join(b"progress %d\n" % i for i in range(0, 80, 7))


def test_text_streams_and_discarding():
    out = io.StringIO()
    result = run_command([sys.executable, "-c", "print('héllo')"], stdout=out, stderr=None, environment=False)
    assert (result.exit_code, out.getvalue()) == (0, "héllo\n")
    result = run_command([sys.executable, "-c", "print('x')"], stdout=None, stderr=None, environment=False)
    assert result.exit_code == 0


def test_a_terminal_stays_a_terminal(tmp_path):
    """With fpdoctor's stdout on a terminal the command writes to it directly: it line-buffers
    and colours exactly as without fpdoctor."""
    master, slave = pty.openpty()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "fpdoctor", "run", "--", sys.executable, "-c", "import os; print(os.isatty(1))"],
            stdout=slave,
            stderr=subprocess.PIPE,
            timeout=60,
            check=False,
        )
        os.close(slave)
        slave = -1
        got = b""
        while True:
            try:
                chunk = os.read(master, 1024)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(master)
        if slave != -1:
            os.close(slave)
    assert done.returncode == 0 and got.strip() == b"True"


def test_sigterm_to_fpdoctor_reaches_the_command(tmp_path):
    prog = script(
        tmp_path,
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print("command got SIGTERM", flush=True), sys.exit(0)))
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "fpdoctor", "run", "--", sys.executable, prog],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (0, b"command got SIGTERM\n", b"")


def test_sigint_not_from_a_terminal_is_forwarded(tmp_path):
    prog = script(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fpdoctor", "run", "--", sys.executable, prog],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # no controlling terminal: the SIGINT comes from kill, not Ctrl-C
    )
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # Python's KeyboardInterrupt (exit 1, or death by SIGINT); an interruption is not a crash to report
    assert proc.returncode in (1, -signal.SIGINT)
    assert b"KeyboardInterrupt" in err and b"fpdoctor run" not in err


@pytest.mark.timeout(120)
def test_a_hanging_job_is_stopped_after_the_bounded_wait(tmp_path):
    """A launcher that waits forever for its ranks, one of which died while the other hangs:
    fpdoctor stops the whole tree after --wait and reports, with the survivor's stack."""
    rank = script(
        tmp_path,
        """
        import os, time
        def wait_for_peers():
            time.sleep(600)  # a collective whose peer is gone, as far as this rank can tell
        print("rank", os.environ["RANK"], "up", flush=True)
        if os.environ["RANK"] == "1":
            time.sleep(1.0)
            os.abort()
        wait_for_peers()
        """,
        "rank.py",
    )
    launcher = script(
        tmp_path,
        f"""
        import os, subprocess, sys
        procs = [subprocess.Popen([sys.executable, {rank!r}], env={{**os.environ, "RANK": str(r), "WORLD_SIZE": "2"}})
                 for r in range(2)]
        for p in procs:
            p.wait()
        """,
        "launcher.py",
    )
    started = time.monotonic()
    out, err = io.BytesIO(), io.BytesIO()
    result = run_command([sys.executable, launcher], stdout=out, stderr=err, environment=False, wait_s=1.0)
    elapsed = time.monotonic() - started
    assert elapsed < 60
    assert result.exit_code == 128 + signal.SIGTERM  # the launcher, stopped by fpdoctor
    crash = result.report.by_name("fatal-signal")
    assert len(crash) == 1 and crash[0].where["rank"] == 1 and crash[0].evidence["signal"] == "SIGABRT"
    (stopped,) = result.report.by_name("rank-stopped")
    assert stopped.where["rank"] == 0 and stopped.evidence["state"] == "running"
    assert stopped.evidence["user_frame"] == f"{rank}:4 in wait_for_peers"
    assert "fpdoctor stopped it" in stopped.message
    assert ["stopped", "fpdoctor terminated the command: it was still running after the first failure"] in [
        list(row) for row in result.report.data["summary"]
    ]
    assert not [p for p in result.report.data["processes"] if p["ended"] == "running"]


def test_descendants_follow_the_process_tree(tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc (Linux) to walk the process tree")
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert descendants(proc.pid) == [grandchild]
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


def test_commands_that_cannot_start(tmp_path):
    with pytest.raises(CommandError, match="not found on PATH"):
        launch(["no-such-fpdoctor-command"], env=dict(os.environ))
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello\n")
    text_file.chmod(0o755)  # executable, but no interpreter line: exec fails
    with pytest.raises(CommandError, match="cannot be executed"):
        launch([str(text_file)], env=dict(os.environ))
    with pytest.raises(CommandError, match="no such file"):
        launch([str(tmp_path / "absent.sh")], env=dict(os.environ))


@pytest.mark.timeout(120)
def test_a_command_that_outlives_sigkill_does_not_hold_the_report(tmp_path, monkeypatch):
    """A process stuck in a kernel call (a hung GPU driver) ignores even SIGKILL until the call
    returns: after the bounded wait the report comes all the same."""
    from fpdoctor.crash import launcher as launcher_module

    real_signal_all = launcher_module._signal_all

    def sigkill_lost(pids: list[int], signum: int) -> None:
        if signum != signal.SIGKILL:  # as if every process were stuck where SIGKILL cannot reach it
            real_signal_all(pids, signum)

    monkeypatch.setattr(launcher_module, "_signal_all", sigkill_lost)
    rank = script(
        tmp_path,
        """
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if os.environ["RANK"] == "1":
            os.abort()
        time.sleep(600)
        """,
        "rank.py",
    )
    pid_file = tmp_path / "launcher.pid"
    launcher = script(
        tmp_path,
        f"""
        import os, signal, subprocess, sys
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        procs = [subprocess.Popen([sys.executable, {rank!r}], env={{**os.environ, "RANK": str(r), "WORLD_SIZE": "2"}})
                 for r in range(2)]
        for p in procs:
            p.wait()
        """,
        "launcher.py",
    )
    started = time.monotonic()
    try:
        result = run_command([sys.executable, launcher], stdout=None, stderr=None, environment=False, wait_s=1.0)
        assert time.monotonic() - started < 30
        assert result.exit_code == 128 + signal.SIGKILL  # what the shell will see once SIGKILL lands
        (crash,) = result.report.by_name("fatal-signal")
        assert crash.where["rank"] == 1 and crash.evidence["signal"] == "SIGABRT"
        summary = dict(result.report.data["summary"])
        assert "still there after SIGKILL" in summary["not ended"]
    finally:
        pid = int(pid_file.read_text())
        real_signal_all([pid, *descendants(pid)], signal.SIGKILL)
