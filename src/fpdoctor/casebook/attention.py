"""Incident 3: NaN frames from a video diffusion block whose fp16 attention overflows.

On the reporter's Ampere GPUs the attention scores were accumulated and stored in fp16 and
overflowed; on V100 a different kernel kept them in fp32. Here a small attention block runs in
fp16 on the CPU with unscaled scores large enough to pass 65504: the matmul makes Inf, softmax
turns it into NaN, and the frames are NaN. `trace` names both ops and the module; the fix,
attention in fp32, is verified by tracing again.
"""

from __future__ import annotations

import torch
from torch import nn

from fpdoctor.casebook import Case
from fpdoctor.report.model import Report


class Attention(nn.Module):
    def __init__(self, dim: int, fp32_scores: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.fp32_scores = fp32_scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (frames, tokens, dim)
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.fp32_scores:  # the fix: scores and softmax in fp32, back to fp16 for the value product
            weights = torch.softmax(q.float() @ k.float().transpose(-1, -2), dim=-1).to(v.dtype)
        else:  # (frames, tokens, tokens), unscaled, in fp16
            weights = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
        return weights @ v


class VideoBlock(nn.Module):
    def __init__(self, dim: int = 64, fp32_scores: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim, fp32_scores)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.attn(self.norm(x)))


def build(fp32_scores: bool = False) -> tuple[VideoBlock, torch.Tensor]:
    torch.manual_seed(0)
    block = VideoBlock(fp32_scores=fp32_scores)
    with torch.no_grad():  # trained weights with large q/k norms: |q . k| passes 65504 on 8% of token pairs
        block.attn.q.weight.mul_(120)
        block.attn.k.weight.mul_(120)
    frames = torch.randn(4, 16, 64)
    return block.half(), frames.half()


def diagnose() -> Report:
    import fpdoctor

    block, frames = build()
    with fpdoctor.trace(block) as t:
        out = block(frames)
    fixed, _ = build(fp32_scores=True)
    with fpdoctor.trace(fixed) as check:
        fixed_out = fixed(frames)
    report = t.report
    assert report is not None and check.report is not None
    bad_frames = int((~torch.isfinite(out)).flatten(1).any(1).sum())
    report.data["summary"] = [
        ("frames with NaN", f"{bad_frames} of {out.shape[0]} (fp16 attention)"),
        (
            "after the fix",
            f"attention scores in fp32: {check.report.verdict}, "
            f"{int((~torch.isfinite(fixed_out)).sum())} non-finite values",
        ),
        *report.data["summary"],
    ]
    return report


NAN_FRAMES = Case(
    name="fp16-attention-nan",
    incident=3,
    title="NaN frames from fp16 attention on a new GPU",
    story=(
        "A video diffusion block produces NaN (black) frames on A100 but not on V100. fpdoctor traces the block in "
        "fp16: the attention score matmul overflows to Inf and softmax turns it into NaN; keeping the scores in "
        "fp32 removes it, and a second trace verifies the fix."
    ),
    expect=frozenset({"nonfinite-produced"}),
    run=diagnose,
)
