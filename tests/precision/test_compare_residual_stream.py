"""A value handed from module to module, rounded wherever it is stored between them: a residual
stream at an offset of 40 in fp16 (spacing 1/32 there) or 300 in bf16 (spacing 2), which every norm
centres. No line of the norm helps in fp32, since what it reads is already rounded: the check keeps
the lines that make what the divergent modules are passed in fp32 from module to module (the inputs
fed in fp32), and the fix applied as printed cures it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import fpdoctor


class Norm(nn.Module):
    """A LayerNorm by hand whose statistics are fp32 (`carried`: what it reads is fp32 too, and it
    returns the model's dtype, as the fix says)."""

    def __init__(self, dim: int, carried: bool) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))
        self.carried = carried

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.float().mean(-1, keepdim=True)
        var = (x.float() * x.float()).mean(-1, keepdim=True) - mean * mean
        if not self.carried:
            mean, var = mean.to(self.weight.dtype), var.to(self.weight.dtype)
        x = (x - mean) / torch.sqrt(var + 1e-5)
        out = x * self.weight + self.bias
        return out.to(self.weight.dtype) if self.carried else out


class Block(nn.Module):
    def __init__(self, dim: int, carried: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = Norm(dim, carried), Norm(dim, carried)
        self.mix = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return x


class Sensors(nn.Module):
    """Readings near 40 (spread 1) enter the stream as they are; `carried`: the fix as printed."""

    def __init__(self, dim: int = 64, depth: int = 2, length: int = 16, carried: bool = False) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, carried) for _ in range(depth))
        self.norm = Norm(dim, carried)
        self.carried = carried

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() + self.pos.float()
        if not self.carried:
            x = x.to(self.norm.weight.dtype)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(1)


def _readings() -> torch.Tensor:
    return 40.0 + torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))


def _divergence(result: fpdoctor.CompareResult) -> fpdoctor.Finding:
    return next(f for f in result.report.findings if f.name == "precision-divergence")


def test_the_stream_kept_in_fp32_is_the_checked_fix_and_works_as_printed():
    torch.manual_seed(0)
    model = Sensors().eval()
    result = fpdoctor.compare(model, _readings(), candidate="fp16")
    finding = _divergence(result)
    assert finding.trial is not None and finding.trial.tried, finding.fix
    assert finding.fix.startswith("Keep the value these modules are passed in fp32 where it is made and carried")
    assert "residual_in_fp32" in finding.fix and "pass the model's inputs in fp32" in finding.fix
    carried = finding.evidence["carried_lines"]
    lines = {int(at.rpartition(":")[2]) for at in carried}
    source = Path(__file__).read_text().splitlines()
    # what the norms are passed: the model's first line, and the two residual adds of the block
    assert {source[n - 1].strip() for n in lines} == {
        "x = x.to(self.norm.weight.dtype)", "x = x + self.mix(self.norm1(x))", "x = x + self.mlp(self.norm2(x))",
    }  # fmt: skip
    before, after = float(finding.trial.before), float(finding.trial.after)
    assert after * 4 <= before
    # applied as printed: the stream not cast back, the norms returning fp16, the inputs fed as they are
    torch.manual_seed(0)
    fixed = Sensors(carried=True).eval()
    fixed.load_state_dict(model.state_dict())
    again = fpdoctor.compare(fixed, _readings(), candidate="fp16", inputs_as_given=True)
    assert not any(f.name == "precision-divergence" for f in again.report.findings)
    assert again.rows[-1].propagated <= 2 * after


class Kelvin(nn.Module):
    """Temperatures near 300 (spread 2) into a residual stream read by torch's LayerNorms, in bf16;
    `carried`: the fix as printed (the norms in fp32 in the forward, what they return cast)."""

    def __init__(self, dim: int = 32, depth: int = 2, carried: bool = False) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(16, dim) * 0.1)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, 4)
        self.carried = carried

    def normed(self, m: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        if not self.carried:
            return m(x)
        out = F.layer_norm(x.float(), m.normalized_shape, m.weight.float(), m.bias.float(), m.eps)
        return out.to(self.head.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pos
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(self.normed(norm, x))
        return self.head(self.normed(self.norm, x).mean(1))


def test_torch_norms_reading_the_stream_kept_in_fp32_with_it_is_the_fix_and_works_as_printed():
    torch.manual_seed(0)
    x = 300.0 + 2.0 * torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))
    model = Kelvin().eval()
    finding = _divergence(fpdoctor.compare(model, x, candidate="bf16"))
    assert finding.trial is not None and finding.trial.tried, finding.fix
    assert "a residual stream" in finding.fix and "leaves the end-to-end error at" in finding.message
    assert finding.evidence["kept_fp32"] == ["norm", "norms.0", "norms.1"]
    assert "F.layer_norm(x.float(), m.normalized_shape" in finding.fix
    after = float(finding.trial.after)
    assert after * 4 <= float(finding.trial.before)
    fixed = Kelvin(carried=True).eval()
    fixed.load_state_dict(model.state_dict())
    again = fpdoctor.compare(fixed, x, candidate="bf16", inputs_as_given=True)
    assert not any(f.name == "precision-divergence" for f in again.report.findings)
    assert again.rows[-1].propagated <= 2 * after
