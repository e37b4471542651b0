"""A loss divided by a tensor made from a number past float16's range: `torch.tensor(n_train,
dtype=pred.dtype)` under fp16 autocast is Inf from the start (no op overflowed), the loss divided by
it is 0 and every gradient is 0. trace names the division and the line, with the fix (the divisor
made in fp32); the same step with the divisor in fp32 has no finding. A -Inf mask read by softmax is
no such division."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _step(divisor_dtype: torch.dtype | None) -> fpdoctor.numerics.api.Trace:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 1))
    x = torch.randn(64, 12)
    y = x[:, :1] * 2.0
    with fpdoctor.trace(model) as t:
        with torch.autocast("cpu", dtype=torch.float16):
            pred = model(x)
            size = torch.tensor(120_000, dtype=divisor_dtype or pred.dtype)  # the training set's size
            loss = ((pred.float() - y) ** 2).sum() / size
        loss.backward()
    return t


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_a_loss_divided_by_a_number_past_fp16s_range_is_named_with_its_line(dtype):
    t = _step(dtype)
    findings = t.report.findings
    if dtype is torch.float32:
        assert not [f for f in findings if f.severity == "error"], findings
        return
    first = findings[0]
    assert first.name == "nonfinite-zeroed", [(f.code, f.title) for f in findings]
    assert "divides by a float16 tensor that holds Inf" in first.title
    assert first.evidence["location"].startswith(f"{__file__}:"), first.evidence
    assert "in fp32" in first.fix and first.trial is not None and first.trial.reason, first


def test_a_minus_inf_mask_the_softmax_reads_is_no_zeroed_divisor():
    scores = torch.randn(4, 8, dtype=torch.float16)
    mask = torch.zeros(4, 8, dtype=torch.float16)
    mask[:, 6:] = float("-inf")
    with fpdoctor.trace() as t:
        out = torch.softmax(scores + mask, -1) / torch.tensor(2.0, dtype=torch.float16)
        out.sum()
    assert not [f for f in t.report.findings if f.name == "nonfinite-zeroed"], t.report.findings


def test_padded_distances_held_as_inf_on_purpose_are_no_zeroed_divisor():
    # inverse-distance weights over neighbours, the padded slots' distances +Inf so that their weight is 0
    dist = torch.rand(4, 8, dtype=torch.float16) + 0.5
    dist[:, 6:] = float("inf")
    values = torch.randn(4, 8, dtype=torch.float16)
    with fpdoctor.trace() as t:
        weights = torch.ones_like(dist) / dist
        out = (weights * values).sum(-1) / weights.sum(-1)
        out.sum()
    assert not [f for f in t.report.findings if f.name == "nonfinite-zeroed"], t.report.findings
