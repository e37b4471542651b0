"""Shared test helpers: fixture paths, in-process and subprocess CLI runners."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
ENV_FIXTURES = FIXTURES / "env"


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]):
    """Run `fpdoctor ARGS` in-process (fast; the CLI's own code paths)."""
    from fpdoctor.cli.main import main

    def run(*args: str) -> Result:
        code = main(list(args))
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def run_fpdoctor(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> Result:
    """Run `python -m fpdoctor ARGS` in a fresh interpreter (end to end)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "fpdoctor", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)
