"""A sinusoidal embedding of a continuous time in [0, 1] at frequencies up to 2^11, its sin and its cos
each on their own line: in bf16 the rounded input makes both garbage, each line in fp32 alone is not
enough, and neither are both on the rounded input. compare prints the fix that works: the inputs in
fp32, both lines computed in fp32 from them, the result cast back, checked; applied so, the error
falls as the check said."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class _TimeEmbed(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.register_buffer("freqs", 2.0 ** torch.arange(12.0))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # as printed: fed in fp32, both lines in fp32, the result cast to the model's dtype
            tf = t.float()
            s = torch.sin(tf[:, None] * self.freqs.float())
            c = torch.cos(tf[:, None] * self.freqs.float())
            return torch.cat([s, c], -1).to(self.freqs.dtype)
        s = torch.sin(t[:, None] * self.freqs)
        c = torch.cos(t[:, None] * self.freqs)
        return torch.cat([s, c], -1)


class _Denoiser(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = _TimeEmbed(fixed)
        self.mlp = nn.Sequential(nn.Linear(24, 64), nn.SiLU(), nn.Linear(64, 8))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(t))


def test_two_encoding_lines_on_rounded_inputs_get_the_inputs_in_fp32_with_both_lines_checked() -> None:
    t = torch.rand(512, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(_Denoiser().eval(), t, candidate="bf16")
    first = result.report.findings[0]
    assert first.fix.startswith("Do that computation before the cast: pass the model's inputs in fp32"), str(
        result.report
    )
    assert first.trial is not None and first.trial.tried and first.trial.after * 10 <= first.trial.before
    # the cast back reads the model's dtype, which a module that holds no parameter reads from a buffer
    assert "in a module that holds none a buffer the model's cast converts" in first.fix, first.fix
    assert len(first.evidence["feeding_lines"]) == 2
    model = _Denoiser(fixed=True).eval()
    with torch.no_grad():
        exact = model.double()(t.double())
        got = model.to(torch.bfloat16)(t)  # the inputs as they come, in fp32
    error = float((got.double() - exact).norm() / exact.norm())
    assert error <= 4 * first.trial.after, (error, first.trial)
