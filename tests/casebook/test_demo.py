from __future__ import annotations

import time

import pytest

from fpdoctor.casebook import CASES, run_case
from fpdoctor.casebook.faulty_gpu import FAULTY_GPU
from tests.conftest import run_fpdoctor


# the faulty-GPU case (a 2-rank job within 45 s, run alone after the parallel pass) has a file of
# its own, test_faulty_gpu_case.py, whose first test is this one
@pytest.mark.parametrize("case", [c for c in CASES if c is not FAULTY_GPU], ids=lambda c: c.name)
def test_case_reproduces(case):
    outcome = run_case(case)
    assert outcome.reproduces(case), sorted(outcome.found)
    assert outcome.report.verdict != "ok"


def test_h20_case_gives_the_exact_fix():
    case = next(c for c in CASES if c.name == "h20-sigfpe")
    finding = run_case(case).report.by_name("cublas-h20-sigfpe")[0]
    assert 'python -m pip install "nvidia-cublas-cu12==12.4.5.8"' in finding.fix
    assert finding.evidence["cublas"] == "12.1.3.1"


@pytest.mark.serial  # the whole demo within 60 s, its 2-rank case within 45 s
def test_demo_end_to_end_within_budget():
    start = time.perf_counter()
    result = run_fpdoctor("demo")
    elapsed = time.perf_counter() - start
    assert result.code == 0, result.err
    assert f"All {len(CASES)} case(s) reproduced" in result.out
    assert elapsed < 60


def test_demo_list(cli):
    out = cli("demo", "--list").out
    assert all(c.name in out for c in CASES)
