"""The strided sample every figure of compare is computed on reads every column of the output: a
stride that shares a factor with the last dimension reads some features only, and an error made in
the others goes unseen (a rotary table rounded to bf16: every 64th value of a [.., 64] output is
feature 0, whose frequency 1.0 bf16 holds exactly)."""

from __future__ import annotations

import pytest
import torch

import fpdoctor
from fpdoctor.precision.metrics import SAMPLE, flat_sample, sample_step
from tests.precision.factories import Rotary


@pytest.mark.parametrize("shape", [(2, 4096, 64), (8, 128, 768), (4, 1000, 1000), (3, 50257), (7, 3, 224, 224)])
def test_the_sample_reads_every_column_and_at_most_twice_sample_values(shape: tuple[int, ...]) -> None:
    t = torch.arange(0, torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
    sample = flat_sample(t)
    assert sample is not None and sample.numel() < 2 * SAMPLE
    columns = (sample.long() % shape[-1]).unique().numel()
    assert columns == min(shape[-1], sample.numel())
    assert sample_step(t.numel()) in (1, *[p for p in range(11, 10**6) if p == sample_step(t.numel())])


def test_an_error_in_the_columns_a_power_of_two_stride_skips_is_seen() -> None:
    torch.manual_seed(0)
    model, x = Rotary().eval(), torch.randn(2, 4096, 64)
    with torch.no_grad():
        exact = model.double()(x.double())
        model.float()
        rounded = Rotary().eval()
        rounded.load_state_dict(model.state_dict())
        bf16 = rounded.to(torch.bfloat16)(x.to(torch.bfloat16)).double()
    actual = float((bf16 - exact).norm() / exact.norm())
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert actual > 0.1 and result.rows[-1].propagated > 0.5 * actual
    assert result.report.verdict != "ok"
