"""The fix contract fails a test that makes a report whose fix says nothing of its trial, whichever
way the report is made, and passes one whose fixes carry a trial or a reason (tests/fix_contract.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PLANTED = """
from fpdoctor import catalog
from fpdoctor.report.model import Report, Trial


def test_a_planted_unchecked_fix():
    Report(command="trace", findings=[catalog.make("nonfinite-produced", message="m", fix="add eps")])


def test_a_fix_added_after_the_report_was_made():
    report = Report(command="trace")
    report.findings.append(catalog.make("precision-divergence", message="m"))


def test_a_checked_fix_and_a_declared_reason():
    Report(command="trace", findings=[
        catalog.make("nonfinite-produced", message="m", trial=Trial.checked("x", metric="y", before=1.0, after=0.0)),
        catalog.make("cublas-h20-sigfpe", message="m"),  # the catalogue says why: an installation change
        catalog.make("nonfinite-produced", message="m", fix=""),  # no fix printed: nothing to say
    ])
"""


def test_the_contract_fails_a_planted_unchecked_fix(tmp_path: Path):
    (tmp_path / "conftest.py").write_text(
        "from tests.fix_contract import _every_printed_fix_says_if_tried, _reports_recorded  # noqa: F401\n"
    )
    (tmp_path / "test_planted.py").write_text(PLANTED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, out
    assert "ERROR test_planted.py::test_a_planted_unchecked_fix" in out
    assert "ERROR test_planted.py::test_a_fix_added_after_the_report_was_made" in out
    assert "NUM001 nonfinite-produced" in out and "NUM006 precision-divergence" in out
    assert "3 passed, 2 errors" in out
