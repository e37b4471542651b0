"""A cast to fp16 of values past its range: a mask fill written far past any range (-1e9) gets the
format's own limit as the value to write, checked; data in large units (incomes near 1e5) is never
told to be clamped to 65504, which would change the data: it is kept in fp32, or scaled, or bf16."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _first(step) -> fpdoctor.Finding:  # type: ignore[no-untyped-def]
    with fpdoctor.Trace() as tr:
        step()
    return tr.report.findings[0]


def test_a_mask_fill_past_fp16_gets_the_formats_limit() -> None:
    torch.manual_seed(0)
    scores = torch.randn(4, 8)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[:, 6:] = True
    mask[0] = True  # a row masked whole: -inf everywhere is NaN in the softmax, -65504 is not

    def step() -> None:
        filled = scores.masked_fill(mask, -1e9).half()  # the fill made in fp32, cast: -inf in fp16
        (filled.float().softmax(-1) * 2).sum()

    first = _first(step)
    assert first.fix.startswith("Write the limit of the dtype you cast to"), first.fix
    assert first.trial is not None and first.trial.tried


def test_data_in_large_units_past_fp16_is_never_told_to_be_clamped() -> None:
    torch.manual_seed(0)
    income = 4e4 + 2e4 * torch.randn(256, 1).abs()  # dollars: many rows past 65504
    model = nn.Linear(1, 1).half()

    def step() -> None:
        model(income.half()).float().mean()

    first = _first(step)
    assert first.name == "nonfinite-produced", first
    assert "clamp the values" not in first.fix, first.fix  # before: "clamp the values to +-65504 before the cast"
    assert "bf16" in first.fix, first.fix
