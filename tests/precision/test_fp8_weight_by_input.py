"""A weight judged for fp8 by what it adds to the output, not by its size: a standardiser folded into
the first Linear for serving (W / std) makes the weights of features logged in large units (pascals,
std ~6e4) tiny beside those of ratios (std ~0.03). Against its row's largest, a tiny
weight looks negligible; times its input it is what the output is made of. One per-tensor fp8 scale set
by the large weights flushes most of the tiny ones to zero, and NUM007 must say so (it said 0%)."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _folded() -> tuple[nn.Module, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    units = torch.full((64,), 20000.0)
    units[:4] = 0.01  # four ratios beside sixty pressures
    x = 3.0 * torch.randn(2048, 64, generator=g) * units
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10)).eval()
    with torch.no_grad():  # trained on standardised features; the standardiser folded in
        std = x.std(0)
        model[0].weight.div_(std)
    return model, x


def test_weights_that_multiply_large_inputs_are_counted_when_fp8_flushes_them():
    model, x = _folded()
    w = model[0].weight.detach()
    scale = w.abs().max() / 448.0
    flushed = float(((w / scale).to(torch.float8_e4m3fn).float() == 0).double().mean())
    assert flushed > 0.5  # what a per-tensor e4m3 cast of this weight does, measured directly
    result = fpdoctor.compare(model, x, candidate="fp8-e4m3")
    rows = {r["module"]: r for r in result.report.data["fp8"]}
    assert rows["0"]["weight_tensorwise_underflow"] > 0.5, rows["0"]
    assert rows["2"]["weight_tensorwise_underflow"] < 0.01, rows["2"]  # the second layer's inputs are alike
    saturation = result.report.by_name("fp8-saturation")
    assert saturation and saturation[0].where["module"] == "0" and "its weight" in saturation[0].message
