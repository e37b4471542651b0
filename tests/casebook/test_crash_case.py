"""The casebook's crash case: a process that really dies of SIGFPE inside a Linear, read back by `run`."""

from __future__ import annotations

import pytest

from fpdoctor.casebook import run_case
from fpdoctor.casebook.crash import SIGFPE_RUN


@pytest.fixture(scope="module")
def outcome():
    return run_case(SIGFPE_RUN)


def test_the_case_reproduces(outcome):
    assert outcome.reproduces(SIGFPE_RUN), sorted(outcome.found)
    assert outcome.report.verdict == "error"


def test_the_report_names_the_signal_op_module_shape_and_dtype(outcome):
    (death,) = outcome.report.by_name("fatal-signal")
    assert death.evidence["signal"] == "SIGFPE"
    assert death.evidence["returncode"] == -8
    assert death.where["op"] == "aten.addmm.default"  # where.op: str() of the OpOverload
    assert death.where["module"] == "blocks.0.ff.proj"
    in_flight = death.evidence["op_in_flight"]
    assert "bfloat16[2, 1024]" in in_flight and "bfloat16[1024, 18432]" in in_flight, in_flight


def test_the_report_gives_the_cublas_fix_from_the_recorded_h20_facts(outcome):
    (known,) = outcome.report.by_name("cublas-h20-sigfpe")
    assert 'pip install "nvidia-cublas-cu12==12.4.5.8"' in known.fix
    assert known.evidence["gpus"] == ["NVIDIA H20"]


def test_the_story_says_the_signal_is_injected():
    assert "fault injection" in SIGFPE_RUN.story and "stand" in SIGFPE_RUN.story
