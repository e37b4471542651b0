"""Positions held as a float buffer (`register_buffer("positions", torch.arange(n).float())`), which the
model's cast to fp16 rounds past 2048 with every other buffer: an ALiBi bias made from them loses the
distance of nearby tokens at late positions. No line makes them in the forward, so nothing else names
them (the error was called accumulation, with a fix that could not be acted on): the buffers of one
attribute held in fp32 and the lines that read them computed in fp32 are the checked fix, NUM020."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Alibi(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, held: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.register_buffer("slopes", torch.tensor([2.0 ** (-8 * (i + 1) / heads) for i in range(heads)]))
        positions = torch.arange(4096).float()
        if held:  # the fix as printed: a plain fp32 attribute, which the model's cast leaves as it is
            self.positions = positions
        else:
            self.register_buffer("positions", positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        p = self.positions[:t]
        bias = (-self.slopes[:, None, None] * (p[None, :] - p[:, None]).abs()).to(x.dtype)
        return self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, c))


class Encoder(nn.Module):
    def __init__(self, held: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.layers = nn.ModuleList(Alibi(held=held) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = h + layer(h)
        return h


def test_whole_numbers_in_a_buffer_the_cast_rounds_are_named_and_the_fix_works_as_printed():
    torch.manual_seed(0)
    model = Encoder().eval()
    x = torch.randn(1, 3000, 8, generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model, x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "whole-numbers-rounded", [(f.code, f.title) for f in result.report.findings]
    assert first.evidence["buffers"] == ["layers.0.positions", "layers.1.positions"]
    assert "`positions` of 2 modules" in first.fix and "plain fp32 tensor attributes" in first.fix
    assert first.trial is not None and first.trial.tried
    after = float(first.trial.after)
    assert after * 4 <= float(first.trial.before)
    torch.manual_seed(0)
    fixed = Encoder(held=True).eval()
    fixed.load_state_dict(model.state_dict(), strict=False)
    again = fpdoctor.compare(fixed, x, candidate="fp16")
    assert not again.report.by_name("whole-numbers-rounded")
    assert again.rows[-1].propagated <= 2 * after
