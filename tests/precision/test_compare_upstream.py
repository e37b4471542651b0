"""An op whose error its inputs' precision forces (cos of a large angle): compare names where those
inputs are made, tries computing those lines in fp32, and the fix as printed removes the error.

Two models the shared cases do not contain: a diffusion model's sinusoidal timestep embedding in a
submodule (timesteps up to 999 cast to the model's dtype), and positions made by an arange in the
model's dtype inside the whole model's own forward."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int, fp32_tables: bool = False) -> None:
        super().__init__()
        self.dim, self.fp32_tables = dim, fp32_tables
        self.proj = nn.Linear(dim, dim)

    def forward(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.fp32_tables else like.dtype
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=dtype) / half)
        angles = t.to(dtype)[:, None] * freqs[None] * 1000.0
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1).to(like.dtype)
        return self.proj(emb)


class Denoiser(nn.Module):
    def __init__(self, fp32_tables: bool = False) -> None:
        super().__init__()
        self.time_embed = TimestepEmbedding(64, fp32_tables)
        self.body = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.time_embed(t, x))


def _denoiser(fp32_tables: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    return Denoiser(fp32_tables).eval(), (torch.randn(16, 64), torch.linspace(1, 999, 16).round().long())


def test_a_timestep_embedding_made_in_bf16_is_named_by_its_lines_and_fp32_there_is_checked():
    model, inputs = _denoiser()
    result = fpdoctor.compare(model, inputs, candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    assert finding.where["module"] == "time_embed"
    evidence = finding.evidence
    assert evidence["conditioned_rel"] >= 0.5 * evidence["isolated_rel"]  # the op is as wrong run exactly
    lines = {int(at.rsplit(":", 1)[1]) for at in evidence["feeding_lines"]}
    source = TimestepEmbedding.forward.__code__.co_firstlineno
    assert {source + 3, source + 4, source + 5} <= lines  # freqs, angles, the sin/cos line
    assert finding.trial is not None and finding.trial.tried
    assert finding.trial.after * 4 <= finding.trial.before and "in fp32" in finding.fix
    assert "not the cause" in finding.message

    # the fix as printed: those lines in fp32, the result cast back; compare has nothing left to say
    fixed, inputs = _denoiser(fp32_tables=True)
    after = fpdoctor.compare(fixed, inputs, candidate="bf16")
    assert not after.report.by_name("precision-divergence"), str(after.report)


class Positions(nn.Module):
    """A small LM whose positions come from an arange in the model's dtype, in its own forward."""

    def __init__(self, fp32_positions: bool = False) -> None:
        super().__init__()
        self.fp32_positions = fp32_positions
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor, offset: int) -> torch.Tensor:
        x = self.embed(tokens)
        dtype = torch.float32 if self.fp32_positions else x.dtype
        pos = torch.arange(tokens.shape[-1], dtype=dtype) + offset
        phase = (pos[:, None] / 10.0 ** (torch.arange(16, dtype=dtype) / 8)).to(dtype)
        x = x + torch.cat([phase.sin(), phase.cos()], -1).to(x.dtype)
        return self.head(x)


def test_positions_from_an_arange_in_bf16_are_the_cause_not_the_sin_that_reads_them():
    torch.manual_seed(1)
    model = Positions().eval()
    inputs = {"tokens": torch.randint(0, 64, (2, 128)), "offset": 3000}
    result = fpdoctor.compare(model, inputs, candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    assert finding.where["module"] == "" and finding.where["op"] in ("aten.sin.default", "aten.cos.default")
    assert finding.trial is not None and finding.trial.tried, finding.fix
    assert "arange" not in finding.fix or "in fp32" in finding.fix

    torch.manual_seed(1)
    fixed = Positions(fp32_positions=True).eval()
    after = fpdoctor.compare(fixed, inputs, candidate="bf16")
    assert after.report.verdict != "error", str(after.report)
    assert after.rows[-1].propagated * 4 <= result.rows[-1].propagated


class NaiveStd(nn.Module):
    """A normalisation by E[x^2] - E[x]^2: it cancels in fp32 when the mean is large (no matmul)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var.clamp_min(1e-12))


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = NaiveStd()
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def test_fp32_against_fp64_on_a_cpu_never_advises_tf32():
    torch.manual_seed(0)
    x = 3000.0 + 0.05 * torch.randn(64, 32)
    result = fpdoctor.compare(Scaled().eval(), x, candidate="fp32", reference="fp64")
    found = result.report.by_name("precision-divergence")
    assert found, str(result.report)
    for finding in found:
        assert "turn off TF32" not in finding.fix and "allow_tf32" not in finding.fix
        assert finding.trial is not None


def test_fp32_against_fp64_is_not_a_divergence_where_conditioning_forces_the_error():
    """sin of positions near 3000 in fp32: its inputs' rounding alone moves it by ~2e-5, as any fp32
    computation must; compare --candidate fp32 --reference fp64 says OK instead of failing CI."""
    torch.manual_seed(1)
    model = Positions().eval()  # the positions in the model's dtype: fp32 here, fp64 in the reference
    inputs = {"tokens": torch.randint(0, 64, (2, 128)), "offset": 3000}
    result = fpdoctor.compare(model, inputs, candidate="fp32", reference="fp64")
    assert result.report.verdict == "ok", str(result.report)
    root = result.rows[-1]
    assert root.own is not None and root.own["forced_rel"] > 1e-6  # measured, and taken as the floor
