from __future__ import annotations

import pytest

from fpdoctor.casebook import CASES, Case, Outcome, run_case
from fpdoctor.casebook.faulty_gpu import FAULTY_GPU
from tests.conftest import run_fpdoctor


# the faulty-GPU case (a 2-rank job within 45 s, run alone after the parallel pass) has a file of
# its own, test_faulty_gpu_case.py, whose first test is this one
@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    """Each case's outcome, run once in this process for the module's tests (filled as they run)."""
    return {}


def _outcome(case: Case, outcomes: dict[str, Outcome]) -> Outcome:
    if case.name not in outcomes:
        outcomes[case.name] = run_case(case)
    return outcomes[case.name]


@pytest.mark.parametrize("case", [c for c in CASES if c is not FAULTY_GPU], ids=lambda c: c.name)
def test_case_reproduces(case, outcomes):
    outcome = _outcome(case, outcomes)
    assert outcome.reproduces(case), sorted(outcome.found)
    assert outcome.report.verdict != "ok"


def test_h20_case_gives_the_exact_fix(outcomes):
    case = next(c for c in CASES if c.name == "h20-sigfpe")
    finding = _outcome(case, outcomes).report.by_name("cublas-h20-sigfpe")[0]
    assert 'python -m pip install "nvidia-cublas-cu12==12.4.5.8"' in finding.fix
    assert finding.evidence["cublas"] == "12.1.3.1"


def test_demo_end_to_end():
    # every case but the faulty-GPU one, which test_faulty_gpu_case.py runs alone (its 2-rank job has
    # 45 s); the whole demo's 60 s budget is benchmarks/bench_demo.py's
    names = [c.name for c in CASES if c is not FAULTY_GPU]
    result = run_fpdoctor("demo", *names)
    assert result.code == 0, result.err
    assert f"All {len(names)} case(s) reproduced" in result.out


def test_demo_list(cli):
    out = cli("demo", "--list").out
    assert all(c.name in out for c in CASES)
