"""What `fpdoctor run` is handed, the command is handed as from the shell, and nothing fpdoctor
fails at changes the command's fate: an -o in a directory that is not there does not stop the
command (its status stays, one line and the report on stderr); a closed stdout (`>&-`) is
closed for the command too (its writes fail as they would, never into a file of fpdoctor's);
a closed stderr costs the report, not the command's death by signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

WRITES = "import os, sys; print('to stdout', flush=True); os.write(1, b'raw\\n'); sys.exit(0)"


def _shell(command: str) -> subprocess.CompletedProcess[str]:
    """A shell line, so that `>&-` and `2>&-` close descriptors as a user's shell does."""
    return subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120, check=False)


def test_an_o_in_a_directory_that_is_not_there_never_stops_the_command(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "missing" / "report.json"
    code = f"open({str(marker)!r}, 'w').close(); raise SystemExit(3)"
    done = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "run", "-o", str(path), "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3 and marker.exists()  # the command ran, its status passed through
    line = f"fpdoctor: could not write the report to {path}: "
    assert done.stderr.count("fpdoctor: could not write") == 1 and done.stderr.startswith(line), done.stderr
    doc = json.JSONDecoder().raw_decode(done.stderr.split("\n", 1)[1])[0]
    assert doc["data"]["exit_status"] == 3 and doc["verdict"] == "error"


def test_a_closed_stdout_is_closed_for_the_command_too():
    python, fpdoctor = sys.executable, f"{sys.executable} -m fpdoctor run --"
    plain = _shell(f'{python} -c "{WRITES}" >&-')
    watched = _shell(f'{fpdoctor} {python} -c "{WRITES}" >&-')
    assert plain.returncode == watched.returncode == 1  # os.write(1): Bad file descriptor
    assert "Bad file descriptor" in plain.stderr and watched.stderr.startswith(plain.stderr)


def test_a_closed_stderr_costs_the_report_not_the_commands_death_by_signal():
    segv = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    done = _shell(f'{sys.executable} -m fpdoctor run -- {sys.executable} -c "{segv}" 2>&-; echo status $?')
    assert done.stdout == f"status {128 + signal.SIGSEGV}\n", done
    assert os.sep + "fpdoctor" + os.sep not in done.stderr  # no traceback of fpdoctor's own


CHATTY = """
import sys, time
print("ready", flush=True)
time.sleep(float(sys.argv[2]))
for i in range(5):
    print(f"line {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
open(sys.argv[1], "w").write("finished")
"""


def test_a_command_outlives_fpdoctor_killed_by_sigkill_and_keeps_its_streams(tmp_path):
    """fpdoctor itself killed (kill -9, the out-of-memory killer): the command's next lines go on to
    where they went, through the forwarding process started beside each pump, never into a pipe
    nobody reads (EPIPE, SIGPIPE)."""
    import time

    script, done = tmp_path / "chatty.py", tmp_path / "done"
    script.write_text(CHATTY, encoding="utf-8")
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fpdoctor", "run", "--", sys.executable, str(script), str(done), "3"],
            stdout=o, stderr=e, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while b"ready" not in out.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # the last lines through the forwarding process
    assert done.read_text() == "finished"  # no BrokenPipeError ended it
    assert out.read_text() == "ready\n" + "".join(f"line {i}\n" for i in range(5))
    assert err.read_text() == "".join(f"err {i}\n" for i in range(5))


def test_a_reader_that_goes_away_still_gives_the_command_epipe():
    """`| head -1`: the forwarding process beside the pump lets go of the pipe too, so the command
    meets EPIPE as without fpdoctor, never a pipe that fills and blocks it."""
    loop = "import sys\ntry:\n    while True: print('x' * 100)\nexcept BrokenPipeError:\n    sys.exit(7)\n"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fpdoctor", "run", "--", sys.executable, "-c", loop],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"x" * 100 + b"\n"
    proc.stdout.close()  # head has what it wanted
    assert proc.wait(timeout=60) == 7
