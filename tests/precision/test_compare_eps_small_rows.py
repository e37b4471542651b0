"""An RMS normalisation by hand with eps=1e-12 (0 in fp16) over audio frames, some of them silence
(all zero) and some near it (amplitude 1e-3): in fp16 the silent frames are 0/0. fp16's smallest
normal value as the eps makes them finite but outweighs a quiet frame's mean square (1e-6 against
6e-5), so computing the line in fp32 leads, checked, with the constant beside it and its larger error."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class _FrameNet(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fixed = fixed
        self.proj = nn.Linear(40, 64)
        self.head = nn.Linear(64, 5)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # as printed: the line in fp32, cast back where the rest reads it
            f = frames.float()
            x = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-12)).to(self.proj.weight.dtype)
        else:
            x = frames * torch.rsqrt(frames.pow(2).mean(-1, keepdim=True) + 1e-12)
        return self.head(torch.relu(self.proj(x)))


def _frames() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 40, generator=g)
    x[:16] = 0.0  # silence
    x[16:40] *= 1e-3  # near silence
    return x


def test_an_eps_that_outweighs_quiet_rows_is_not_the_lead_fix() -> None:
    x = _frames()
    result = fpdoctor.compare(_FrameNet().eval(), x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced", str(result.report)
    assert first.fix.startswith("compute aten.rsqrt.default at "), first.fix
    assert "that eps outweighs what small rows hold" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 0.01
    model = _FrameNet(fixed=True).eval()
    with torch.no_grad():
        exact = model.double()(x.double())
        got = model.half()(x.half())
    assert bool(torch.isfinite(got).all())
    assert float((got.double() - exact).norm() / exact.norm()) < 4 * first.trial.after
