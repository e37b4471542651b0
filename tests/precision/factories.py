"""Reproductions the precision lab is tested on. Each function is a MODEL factory: it takes no
arguments and returns (model, inputs), so the CLI can load it as
`tests.precision.factories:overflow_attention`."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from typing import Any

import torch
from torch import nn


def loads_strict(text: str) -> Any:
    """json.loads that refuses NaN/Infinity literals, as RFC 8259 parsers do."""

    def refuse(literal: str) -> Any:
        raise ValueError(f"non-standard JSON literal {literal}")

    return json.loads(text, parse_constant=refuse)


class Attention(nn.Module):
    """Self-attention without the 1/sqrt(d) scale: the q·kᵀ scores are the largest values in the model."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # (batch, tokens, tokens)
        return torch.softmax(scores, dim=-1) @ self.v(x)


def overflow_attention() -> tuple[nn.Module, torch.Tensor]:
    """fp16 q·kᵀ scores overflow inside `attn` (up to ~2e5 against fp16's 65504) while every
    module's output, the attention's included, fits fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), attn=Attention(), head=nn.Linear(64, 16)))
    with torch.no_grad():
        model.attn.q.weight.mul_(150)
        model.attn.k.weight.mul_(150)
    return model, torch.randn(4, 32, 64)


class SimilarityAttention(nn.Module):
    """Attention over the raw inputs (no query/key projection), near one-hot: the inputs share a
    large offset, so the scores are large and a rounding of the inputs moves them by whole units."""

    def __init__(self, dim: int = 64, sharpness: float = 0.1) -> None:
        super().__init__()
        self.value = nn.Linear(dim, dim)
        self.sharpness = sharpness

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        scores = (x @ x.transpose(-1, -2)) * self.sharpness  # (batch, tokens, tokens), up to ~2.7e3
        return torch.softmax(scores, dim=-1) @ self.value(x - x.mean(dim=-2, keepdim=True))


def ill_conditioned() -> tuple[nn.Module, torch.Tensor]:
    """Rounding the inputs to fp16 alone moves the output by ~2% (the fp32 model fed fp16-rounded
    inputs), far above plan's default tolerance."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(attn=SimilarityAttention(), head=nn.Linear(64, 16)))
    return model, torch.randn(4, 32, 64) + 20


def ill_conditioned_root() -> tuple[nn.Module, torch.Tensor]:
    """The same attention as the whole model: its sensitive ops are the root's own."""
    torch.manual_seed(0)
    return SimilarityAttention(), torch.randn(4, 32, 64) + 20


class Denoiser(nn.Module):
    """A diffusion denoiser: the noisy sample's scale grows with the timestep."""

    def __init__(self) -> None:
        super().__init__()
        self.time = nn.Sequential(nn.Linear(1, 64), nn.SiLU(), nn.Linear(64, 64))
        self.net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        with torch.no_grad():
            self.net[0].weight.mul_(10)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:  # x: (batch, 64), t: (batch,)
        return self.net(x + self.time(t[:, None].to(x.dtype) / 1000))


def sigma(t: int) -> float:
    """Noise level at timestep t: 0.1 at t=0 up to 5000 at t=1000."""
    return 0.1 * math.exp(t * math.log(5e4) / 1000)


def sampler() -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Judged at three timesteps; only the last one overflows fp16 (net.0's outputs pass 65504)."""
    torch.manual_seed(0)
    model = Denoiser()
    sets = [(torch.randn(8, 64) * sigma(t), torch.full((8,), t)) for t in (10, 500, 999)]
    return model, sets


def mixed_params() -> tuple[nn.Module, torch.Tensor]:
    """A model shipped with its head in fp16 and the rest in fp32: it crashes as given."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(body=nn.Linear(64, 64), act=nn.GELU(), head=nn.Linear(64, 16)))
    model.head.half()
    return model, torch.randn(8, 64)


class QuietBranch(nn.Module):
    """A residual branch that diverges in fp16 but adds a thousandth to the main path."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = SimilarityAttention()
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + 1e-3 * self.branch(x))


def quiet_divergence() -> tuple[nn.Module, torch.Tensor]:
    """compare names `branch`; the end-to-end error needs nothing kept."""
    torch.manual_seed(0)
    return QuietBranch(), torch.randn(4, 32, 64) + 20


def huge_inputs() -> tuple[nn.Module, torch.Tensor]:
    """Inputs beyond fp16's range: they are Inf before the first module runs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)), torch.randn(8, 64) * 1e5


class TemperedAttention(nn.Module):
    """Attention whose small temperature is applied after the product: q·kᵀ overflows fp16 while
    the scaled scores, and the softmax, are moderate."""

    def __init__(self, dim: int = 64, temperature: float = 1e-4) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.temperature = temperature

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # (batch, tokens, tokens), up to ~1e5
        return torch.softmax(scores * self.temperature, dim=-1) @ self.v(x)


def tempered_attention() -> tuple[nn.Module, torch.Tensor]:
    """compare finds the q·kᵀ overflow inside `attn`; computing that product and the softmax in fp32
    is enough, the projections stay fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(embed=nn.Linear(64, 64), attn=TemperedAttention(), head=nn.Linear(64, 16)))
    with torch.no_grad():
        model.attn.q.weight.mul_(150)
        model.attn.k.weight.mul_(150)
    return model, torch.randn(4, 32, 64)


class RunningSum(nn.Module):
    """A streaming model: a per-token running sum kept in the model's dtype, one add per token."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        h = self.inp(x)
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            state = state + h[:, t]  # the running state: rounded to the model's dtype at every token
            outs.append(state)
        return self.out(torch.stack(outs, 1))


def running_sum() -> tuple[nn.Module, list[torch.Tensor]]:
    """In bf16 the end-to-end error grows with the sequence (~0.015, 0.05, 0.5 at 200, 800, 3000
    tokens) while every op and module alone stays within a few floors."""
    torch.manual_seed(0)
    return RunningSum(), [torch.randn(2, n, 16) + 0.5 for n in (200, 800, 3000)]


class Rotary(nn.Module):
    """Rotary embeddings whose frequency table is a buffer built in fp32: the candidate's cast rounds
    it, and every 64th value of the output is feature 0, whose frequency 1.0 bf16 holds exactly."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("inv_freq", 1.0 / 10000.0 ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        angles = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        a, b = h[..., 0::2], h[..., 1::2]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
