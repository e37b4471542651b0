"""A NaN made by 0/0 of values that underflowed before it is no overflow: an embedding of sparse
sensor readings weighted by tiny per-channel gains (1e-8, a buffer) and L2-normalised in fp16. The
weighted rows of quiet channels are 0 in fp16, their norm is 0, and x / norm is NaN. compare names the
division, and its fix says what it reads is lost before it (nothing overflows: the exact output is at
most 1), never that its values pass fp16's largest or should be scaled down."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Sensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gains = torch.full((32,), 1.0)
        gains[16:] = 1e-8  # the quiet channels' calibration
        self.register_buffer("gains", gains)
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = x * self.gains
        w = w / w.norm(dim=-1, keepdim=True)
        return self.proj(w)


def test_a_nan_from_values_that_underflowed_before_the_division_is_said_so() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    x[:8, :16] = 0.0  # eight rows where only the quiet channels read anything
    result = fpdoctor.compare(Sensors().eval(), x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced", [(f.code, f.title) for f in result.report.findings]
    assert "nothing overflows" in first.fix and "scale them down" not in first.fix, first.fix
    assert "65504" not in first.fix, first.fix
    assert "buffer gains" in first.fix, first.fix  # what the cast made 0, named
