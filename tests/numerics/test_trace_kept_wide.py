"""A power of raw values past fp16's range, brought back by a later op (a log-power spectrogram of
raw 16-bit audio; an L2 normalisation of raw features written by hand): the fix kept the power in
fp32 "for what reads it" and said nowhere where to cast back, so the fp32 result reached an fp16
BatchNorm and crashed (trial80). Now it says: cast back after the ops that bring it within range,
before a layer that holds fp16 weights; and pow's other advice leads with the large base, not a
zero degree. Applied as printed, both run finite in fp16."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class Spectrogram(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.frames = nn.Conv1d(1, 64, 64, stride=32, bias=False)  # a DFT-like filterbank
        self.norm, self.head, self.fixed = nn.BatchNorm1d(32), nn.Linear(32, 4), fixed

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        z = self.frames(wav[:, None])
        re, im = z[:, :32], z[:, 32:]
        if self.fixed:  # as printed: the power and the log in fp32, cast back after the log
            feats = torch.log(re.float().pow(2) + im.float().pow(2) + 1e-6).to(z.dtype)
        else:
            power = re.pow(2) + im.pow(2)
            feats = torch.log(power + 1e-6)
        return self.head(self.norm(feats).mean(-1))


class Normalised(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.head, self.fixed = nn.Linear(64, 4), fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # as printed: the squares and the division in fp32, cast back after the division
            unit = (x.float() / x.float().pow(2).sum(-1, keepdim=True).sqrt()).to(x.dtype)
        else:
            unit = x / x.pow(2).sum(-1, keepdim=True).sqrt()
        return self.head(unit)


@pytest.mark.parametrize(
    ("make", "inputs"),
    [
        (Spectrogram, lambda g: torch.randn(8, 4096, generator=g) * 8000),  # raw int16-scale audio
        (Normalised, lambda g: torch.randn(16, 64, generator=g) * 1000),  # raw readings
    ],
    ids=["log-power-spectrogram", "l2-normalisation-by-hand"],
)
def test_a_power_kept_in_fp32_says_where_to_cast_back_and_works_as_printed(make, inputs) -> None:
    torch.manual_seed(0)
    model = make().eval().half()
    x = inputs(torch.Generator().manual_seed(1)).half()
    with fpdoctor.trace() as t, torch.no_grad():
        model(x)
    assert t.report is not None
    first = t.report.findings[0]
    assert first.fix.startswith("Compute aten.pow"), (first.name, first.fix)
    assert "cast back to float16 only after the ops that bring it within that range" in first.fix
    assert first.fix.split("Also possible, not tried: ")[1].startswith("a power of a large base overflows")
    fixed = make(fixed=True).eval()
    fixed.load_state_dict(model.float().state_dict())
    fixed.half()
    with torch.no_grad():
        assert torch.isfinite(fixed(x)).all()
