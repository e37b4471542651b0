"""A module whose own op overflows fp16 and whose output passes fp16's range too (a T5-style residual
stream past 65504, trial78): compare said "Its output fits fp16, but inside it aten.add.Tensor
overflows", and to cast the result back "after the ops that consume it (e.g. the softmax)". The
output does not fit: cast back, it overflows again. Now the message says the output passes the
range and the fix keeps what the op makes in fp32 for what reads it (a module whose output fits
keeps the old words: test_compare_causes)."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Norm(nn.Module):
    """T5's layer norm: a scale, no centring."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.wi, self.wo = (
            Norm(dim),
            nn.Linear(dim, 4 * dim, bias=False),
            nn.Linear(4 * dim, dim, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.wo(torch.relu(self.wi(self.norm(x))))


class Encoder(nn.Module):
    """Pre-LN blocks whose last FFNs write large values into a few channels of the residual stream,
    as a trained T5 checkpoint's do: the last block's residual add passes fp16's max."""

    def __init__(self, dim: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        with torch.no_grad():
            for block in self.blocks[2:]:
                block.wo.weight[:4] *= 1.1e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_residual_stream_past_fp16_is_not_said_to_fit() -> None:
    torch.manual_seed(0)
    model = Encoder().eval()
    result = fpdoctor.compare(model, torch.randn(2, 16, 32), candidate="fp16")
    found = [f for f in result.report.findings if f.evidence.get("overflow_inside")]
    assert found, [(f.name, f.message[:200]) for f in result.report.findings]
    assert "Its output fits" not in found[0].message and "passes fp16's range" in found[0].message
    assert "e.g. the softmax" not in found[0].fix
    # what it makes stays in fp32 past it: the op's, or the block's, checked end to end
    assert "keep what it makes in fp32" in found[0].fix or "its output left in fp32" in found[0].fix, found[0].fix


class _GatedFeedForward(nn.Module):
    """A T5-style gated feed-forward whose output projection's values pass 65504 in fp64: kept in fp32 but
    cast back to fp16 it is Inf again, so the fix must leave its output in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.wi, self.wg = nn.Linear(32, 128, bias=False), nn.Linear(32, 128, bias=False)
        self.wo = nn.Linear(128, 32, bias=False)
        with torch.no_grad():
            self.wo.weight.mul_(8000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(nn.functional.gelu(self.wg(x)) * self.wi(x))


def test_a_module_whose_exact_output_passes_fp16_is_kept_with_its_output_in_fp32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_GatedFeedForward(), nn.LayerNorm(32)).eval()
    result = fpdoctor.compare(model, torch.randn(64, 32) * 4, candidate="fp16")
    found = [f for f in result.report.findings if f.name == "precision-divergence" and f.where.get("module") == "0.wo"]
    assert found, [(f.name, f.where) for f in result.report.findings]
    # before: "keep `0.wo` in fp32 (fpdoctor plan finds the smallest such set)": cast back, Inf again
    assert found[0].fix.startswith("keep `0.wo` in fp32 with its output left in fp32"), found[0].fix
