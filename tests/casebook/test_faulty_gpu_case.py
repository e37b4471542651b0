"""Incident 5 end to end on a CPU: the sentinel, the fingerprints and the kernel log agree on one rank/GPU."""

from __future__ import annotations

import pytest

from fpdoctor.casebook import run_case
from fpdoctor.casebook.faulty_gpu import FAULTY_GPU

pytestmark = pytest.mark.serial  # a 2-rank job the case gives 45 s


@pytest.fixture(scope="module")
def outcome():
    return run_case(FAULTY_GPU)


def test_the_case_reproduces(outcome):
    assert outcome.reproduces(FAULTY_GPU), sorted(outcome.found)


def test_the_sentinel_and_the_fingerprints_name_the_same_rank(outcome):
    report = outcome.report
    (transient,) = report.by_name("transient-fault-suspected")
    assert transient.where["rank"] == 1 and transient.evidence["step"] == 3
    (bad_gradient,) = report.by_name("nonfinite-gradient")
    assert bad_gradient.where["rank"] == 1 and "before the all-reduce" in bad_gradient.message
    (mismatch,) = report.by_name("gemm-mismatch")
    assert mismatch.where["rank"] == 1
    assert not [f for f in report.findings if f.name in ("gemm-mismatch", "rank-outlier") and f.where["rank"] != 1]


def test_the_recorded_kernel_log_is_explained(outcome):
    (xid,) = outcome.report.by_name("xid-error")
    assert xid.evidence["xid"] == 63 and xid.where["pci"] == "0000:10:1c.0"
    assert "remap" in xid.evidence["meaning"]


def test_the_story_says_what_is_injected():
    assert "fault injection" in FAULTY_GPU.story and "rank 1" in FAULTY_GPU.story
