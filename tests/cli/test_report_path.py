"""A report path fpdoctor cannot write (read-only, full, not a file system at all) under the commands
that run the user's program (run, watch, trace): the exit status stays the program's, fpdoctor's
own failure is one line on stderr, and the report follows it there."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# fpdoctor with every file write failing as on a full tmpfs
FULL = textwrap.dedent(
    """
    import errno, os, sys
    import fpdoctor.files

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    fpdoctor.files.write_atomic = full
    from fpdoctor.cli.main import main
    sys.exit(main(sys.argv[1:]))
    """
)


@pytest.fixture(params=["read-only", "proc", "full"])
def report_path(request: pytest.FixtureRequest, tmp_path: Path):
    """(a report path that cannot be written, how to start fpdoctor, the reason said)."""
    if request.param == "read-only":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only directory")
        folder = tmp_path / "ro"
        folder.mkdir()
        folder.chmod(0o500)
        yield str(folder / "report.json"), [sys.executable, "-m", "fpdoctor"], "Permission denied"
        folder.chmod(0o700)
    elif request.param == "proc":
        yield "/proc/fpdoctor-report.json", [sys.executable, "-m", "fpdoctor"], "No such file or directory"
    else:
        yield str(tmp_path / "report.json"), [sys.executable, "-c", FULL], os.strerror(errno.ENOSPC)


def fpdoctor(start: list[str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*start, *args], capture_output=True, text=True, timeout=120, check=False, cwd=cwd)


def said_once(stderr: str, path: str, reason: str) -> dict:
    """The one line, then the report that the file would have held (JSON), read back."""
    line = f"fpdoctor: could not write the report to {path}: {reason}; the report follows on stderr\n"
    assert stderr.count("fpdoctor: could not write") == 1 and line in stderr, stderr
    assert f"{os.sep}fpdoctor{os.sep}cli{os.sep}" not in stderr  # no traceback of fpdoctor's own
    return json.JSONDecoder().raw_decode(stderr.split(line)[1])[0]


@pytest.mark.parametrize(("code", "status"), [("pass", 0), ("raise SystemExit(3)", 3)])
def test_run_keeps_the_commands_exit_status(tmp_path, report_path, code, status):
    path, start, reason = report_path
    done = fpdoctor(start, "run", "-o", path, "--", sys.executable, "-c", code, cwd=tmp_path)
    assert done.returncode == status
    assert said_once(done.stderr, path, reason)["data"]["exit_status"] == status
    assert done.stdout == ""


def test_run_of_a_failing_command_keeps_its_status_and_its_crash_report(tmp_path, report_path):
    path, start, reason = report_path
    done = fpdoctor(start, "run", "-o", path, "--", sys.executable, "-c", "raise ValueError('bad batch')", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr.startswith("Traceback")  # the command's own stderr first
    doc = said_once(done.stderr, path, reason)
    # the crash is the report's one finding of its own; a machine's (ENV102 on a GPU image with two
    # copies of cuDNN) may follow it
    assert [f["name"] for f in doc["findings"] if not f["code"].startswith("ENV")] == ["uncaught-exception"]
    assert doc["findings"][0]["name"] == "uncaught-exception"
    assert "CRS002 uncaught-exception" in done.stderr.rsplit("}", 1)[1]  # and the text report, as without -o


@pytest.mark.parametrize("command", ["watch", "trace"])
def test_watch_and_trace_keep_the_scripts_exit_status(tmp_path, report_path, command):
    path, start, reason = report_path
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('trained', flush=True)\nsys.exit(3)\n")
    done = fpdoctor(start, command, "-o", path, "--", str(script), cwd=tmp_path)
    assert (done.returncode, done.stdout) == (3, "trained\n")
    assert said_once(done.stderr, path, reason)["command"] == command


def test_a_ranks_report_files_under_torchrun(tmp_path, report_path):
    """Under torchrun a rank writes FILE.rankN (and a sidecar for the merge): the same rule."""
    path, start, reason = report_path
    script = tmp_path / "train.py"
    script.write_text("print('trained', flush=True)\n")
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    done = subprocess.run(
        [*start, "watch", "-o", path, "--", str(script)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, "trained\n")
    rank_file = str(Path(path).with_name(Path(path).stem + ".rank1.json"))
    assert said_once(done.stderr, rank_file, reason)["data"]["distributed"]["rank"] == 1
