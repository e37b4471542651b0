"""Rotary tables for positions far into a long context, built in the model's dtype: bf16 holds the
positions (whole numbers past 256) and their products with inv_freq coarsely. The lines that make the
tables in fp32 take the error down to what bf16's rounding of the rest explains (16x the floor at most)
without taking it down 4x (2.5x here): that is the fix, checked, not "not enough". Two forms of position
interpolation: positions / 16 at 8000-8127, positions / 64 at 30000-30127."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Rope(nn.Module):
    def __init__(self, dim: int, base: float, ntk: float, interpolate: float) -> None:
        super().__init__()
        self.dim, self.base, self.ntk, self.interpolate = dim, base * ntk ** (dim / (dim - 2)), ntk, interpolate

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        t = x.shape[-2]
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=x.dtype) / self.dim))
        pos = torch.arange(start, start + t, dtype=x.dtype) / self.interpolate
        freqs = torch.outer(pos, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Layer(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, **rope: float) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.rope = Rope(d // heads, **rope)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, -1))
        q, k = self.rope(q, start), self.rope(k, start)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, t, d))


class LM(nn.Module):
    def __init__(self, start: int, **rope: float) -> None:
        super().__init__()
        self.start, self.emb = start, nn.Embedding(256, 64)
        self.layers = nn.ModuleList(Layer(**rope) for _ in range(2))
        self.head = nn.Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h, self.start)
        return self.head(h)


@pytest.mark.parametrize(
    ("start", "rope"),
    [
        (8000, {"base": 10000.0, "ntk": 1.0, "interpolate": 16.0}),
        (30000, {"base": 10000.0, "ntk": 1.0, "interpolate": 64.0}),
    ],
    ids=["interpolated-8k", "interpolated-30k"],
)
def test_rope_tables_far_into_the_context_get_their_lines_checked_as_the_fix(start: int, rope: dict) -> None:
    torch.manual_seed(0)
    model = LM(start, **rope).eval()
    result = fpdoctor.compare(model, torch.randint(0, 256, (2, 128)), candidate="bf16")
    first = result.report.findings[0]
    assert first.trial is not None and first.trial.tried, (first.name, first.fix, first.trial)
    assert "fp32" in first.fix and math.isfinite(float(first.trial.after))
    assert float(first.trial.after) * 2 <= float(first.trial.before)
