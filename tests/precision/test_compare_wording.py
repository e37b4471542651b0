"""compare's renderings: no placeholder numbers, one referee, the metric defined."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.report.render import render

PLACEHOLDERS = ("1e-300", "6000", "infinitely", "isolated inf", "inf dB", "nan")


def _out_of_range() -> tuple[nn.Module, torch.Tensor]:
    """A layer whose fp64 output does not fit fp16 (values ~1e5): with fp64 as the reference no
    reference error is measured, so its floor is unknown."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(16, 16), big=nn.Linear(16, 16), head=nn.Linear(16, 4)))
    with torch.no_grad():
        model.big.weight.mul_(1e6)
        model.head.weight.mul_(1e-5)
    return model, torch.randn(8, 16)


@pytest.mark.parametrize("fmt", ["text", "markdown", "json"])
def test_an_unknown_floor_is_said_as_unknown_in_every_format(fmt):
    model, x = _out_of_range()
    result = fpdoctor.compare(model, x, candidate="fp16", reference="fp64")
    (big,) = [r for r in result.rows if r.module == "big"]
    assert big.out_of_range and big.reference is None  # the case: no floor was measured
    text = render(result.report.to_dict(), fmt)
    for placeholder in PLACEHOLDERS:
        assert placeholder not in text, placeholder
    assert "unknown" in text


def test_one_referee_and_the_metric_defined():
    model, x = _out_of_range()
    result = fpdoctor.compare(model, x, candidate="fp16")
    summary = dict(result.report.data["summary"])
    assert summary["candidate / floor model"].startswith("fp16 / fp32: every error is measured against fp64")
    assert summary["error metric"].startswith("relative L2 error against the fp64 run")
    for finding in result.report.findings:
        if finding.name == "precision-divergence":
            assert finding.evidence["referee"] == "fp64" and finding.evidence["floor_model"] == "fp32"
            assert "reference" not in finding.evidence
