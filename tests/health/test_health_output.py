"""`health -o FILE` is a drain gate's: an -o that cannot be written (read-only, full, a directory
that is not there) keeps the exit status of the report, which then goes to stdout after one line
on stderr. A 2 there would read 'leave the node as it is' for a node with an unusable GPU."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

UNREACHABLE = str(FIXTURES / "health" / "rules" / "HWR010-gpu-unreachable.txt")
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


@pytest.fixture(params=["proc", "full", "missing directory"])
def report_path(request: pytest.FixtureRequest, tmp_path: Path):
    """(a report path that cannot be written, how to start fpdoctor, the reason said)."""
    if request.param == "proc":
        return "/proc/fpdoctor-health.json", [sys.executable, "-m", "fpdoctor"], "No such file or directory"
    if request.param == "full":
        return str(tmp_path / "health.json"), [sys.executable, "-c", FULL], os.strerror(errno.ENOSPC)
    missing = tmp_path / "missing"
    return str(missing / "health.json"), [sys.executable, "-m", "fpdoctor"], f"{missing} does not exist"


def test_an_unwritable_o_keeps_the_gates_status_and_prints_the_report(tmp_path, report_path):
    path, start, reason = report_path
    done = subprocess.run(
        [*start, "health", "--from", UNREACHABLE, "-o", path],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # an unusable GPU: drain, as without -o
    (line,) = done.stderr.splitlines()
    assert line.startswith("fpdoctor: ") and reason in line and line.endswith("the report follows on stdout")
    report = json.loads(done.stdout)  # in -o's format
    assert report["command"] == "health" and [f["name"] for f in report["findings"]] == ["gpu-unreachable"]
