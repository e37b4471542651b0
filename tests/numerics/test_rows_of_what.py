"""Rows along dim 0 that hold NaN, where only some do, are said to be rows of the batch only when
they are: an activation of the forward, or rows the step's dataset items matched. A weight whose
rows hold NaN, or an op of the optimizer's, has rows of its own, not the batch's."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _traced(poison_weight: bool) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(12, 8)
    if poison_weight:
        with torch.no_grad():
            model[0].weight[3] = float("nan")  # one output unit's row of the weight
    else:
        x[5] = float("nan")  # one item of the batch
    with fpdoctor.trace(model) as tr:
        model(x).sum().backward()
    return tr.report


def _messages(report: fpdoctor.Report) -> str:
    return " ".join(f.message for f in report.findings)


def test_nan_rows_of_the_batch_are_said_to_be_the_batch() -> None:
    report = _traced(poison_weight=False)
    assert "row 5 of the 12 along dim 0 (the batch)" in _messages(report), _messages(report)


def test_nan_rows_of_a_weight_are_not_called_the_batch() -> None:
    report = _traced(poison_weight=True)
    text = _messages(report)
    assert "along dim 0" in text and "(the batch)" not in text, text
