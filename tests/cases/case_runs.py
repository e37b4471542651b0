"""Running a case users brought (tests/fixtures/cases/) the way its README says, and editing a copy of
its script the way a user applies a printed fix: a fresh interpreter per run, fpdoctor from this
checkout's src/, each case in its own temporary folder (some scripts write files)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIXTURES
from tests.fix_contract import PRINTED

CASES = FIXTURES / "cases"
TIMEOUT = 280  # the suite's per-test limit is 300 s (pyproject.toml); a case's command takes 5-60 s


def copy_case(name: str, to: Path) -> Path:
    """The case's scripts in a fresh folder `to/name`, writable."""
    folder = to / name
    shutil.copytree(CASES / name, folder)
    for path in folder.iterdir():
        path.chmod(0o644)
    return folder


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    path = os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])
    # one thread, as `make test` runs the suite: these models are loops of small ops, where more threads
    # cost more than they give (the streaming case: 5 s on one thread, 53 s on two shared cores)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def python(folder: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """`python ARGV` in the case's folder, as the user runs it."""
    return subprocess.run(
        [sys.executable, *argv], cwd=folder, capture_output=True, text=True, env=_env(), timeout=TIMEOUT, check=False
    )


def fpdoctor(folder: Path, command: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`fpdoctor COMMAND -o report.json -q ARGS` in the case's folder, and the report it wrote. The
    report is held to the fix contract (tests/fix_contract.py) like every report the suite prints."""
    report = folder / "report.json"
    proc = python(folder, "-m", "fpdoctor", command, "-o", str(report), "-q", *args)
    assert report.exists(), f"fpdoctor {command} wrote no report (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    text = report.read_text()
    PRINTED.append(text)
    return proc, json.loads(text)


def read_report(path: Path) -> dict:
    text = path.read_text()
    PRINTED.append(text)
    return json.loads(text)


def line_of(location: str) -> tuple[str, int]:
    """'/tmp/.../run.py:31' (or 'train.py:17 in pairwise_distances') -> ('run.py', 31)."""
    match = re.fullmatch(r"(?:.*/)?([^/:]+):(\d+)(?: in \S+)?", location)
    assert match, f"not a file:line location: {location!r}"
    return match[1], int(match[2])


def edit(source: Path, to: Path, edits: dict[int, list[tuple[str, str]]]) -> Path:
    """A copy of `source` at `to` with, on each 1-based line, each (old, new) replaced once, as a user
    edits those lines; an edit whose text is not on its line fails (the case changed under the test)."""
    lines = source.read_text().splitlines(keepends=True)
    for number, replacements in edits.items():
        for old, new in replacements:
            assert old in lines[number - 1], f"{source.name}:{number} has no {old!r}: {lines[number - 1]!r}"
            lines[number - 1] = lines[number - 1].replace(old, new, 1)
    to.write_text("".join(lines))
    return to


def relative_errors(stdout: str, key: str) -> dict[int, tuple[float, float]]:
    """The rows the cases' run.py prints, '<key> N ... rel.err E  top-1 agree A%' -> {N: (E, A/100)}."""
    rows = re.findall(rf"{key}\s+(\d+)\S*\s+rel\.err ([0-9.]+)\s+top-1 agree\s+([0-9.]+)%", stdout)
    assert rows, f"no '{key} ... rel.err' rows in:\n{stdout}"
    return {int(n): (float(err), float(agree) / 100) for n, err, agree in rows}
