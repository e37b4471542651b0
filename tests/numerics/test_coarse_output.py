"""What watch reads from a training output (numerics/training/coarse_output.py): a column whose
rounding to its format costs a large share of what it varies by, or that is one value of the
format on every row; not logits, not zeros, not an fp32 output."""

from __future__ import annotations

import torch

from fpdoctor.numerics.training.coarse_output import coarse, finding


def test_a_many_column_forecast_near_2000_in_bf16_is_coarse():
    torch.manual_seed(0)
    forecast = (2000 + 3 * torch.randn(128, 48)).bfloat16()  # 48 steps ahead: more columns than a head
    found = coarse([forecast])
    assert found is not None and found["dtype"] == "bfloat16" and found["spread"] > 0
    assert found["rounding"] >= 0.05 * found["spread"]


def test_one_value_of_the_format_on_every_row_is_the_coarsest_case():
    start = torch.full((64, 1), 288.15).bfloat16()  # a model starting at a climatological mean
    found = coarse([start])
    assert found is not None and found["spread"] == 0
    text = finding(found, 4, {}).message
    assert "is one value of bfloat16 on all 64 rows" in text


def test_logits_zeros_and_fp32_outputs_are_not_coarse():
    torch.manual_seed(0)
    assert coarse([(3 * torch.randn(128, 200)).bfloat16()]) is None  # logits: spread far above spacing
    assert coarse([torch.zeros(64, 4, dtype=torch.bfloat16)]) is None  # nothing away from 0
    assert coarse([torch.full((64, 1), 288.15)]) is None  # fp32 holds it


def test_an_input_column_of_one_written_value_is_not_a_rounded_reading():
    """A PINN's boundary call `u(torch.ones_like(t), t)`: its x column is 1 on every row by construction,
    in any format; a reading that bf16 collapsed to one value (pressure near 1013.2, spread 0.1, all 1012)
    is still named, and an output of one value too (a model at a climatological mean)."""
    t = torch.rand(256, 1, generator=torch.Generator().manual_seed(0))
    for written in (1.0, -0.5, 3.0, 0.75):
        boundary = torch.cat([torch.full_like(t, written), t], 1).to(torch.bfloat16)
        assert coarse([boundary], inputs=True) is None
        assert coarse([boundary])["column"] == 0  # an output of one value: named
    pressure = (1013.2 + 0.1 * torch.randn(256, 1, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    assert pressure.unique().numel() == 1
    found = coarse([torch.cat([pressure, t.to(torch.bfloat16)], 1)], inputs=True)
    assert found is not None and found["column"] == 0 and found["spread"] == 0
