"""A DDIM sampler served in fp16: its cosine schedule's alphas_cumprod, a buffer, is rounded by the
model's cast (the last entries, 2e-9, become 0), and the division by its root makes the NaN. The op
that shows it is not the fix: the buffer held in fp32 is, checked, and it comes first. The op's own
check runs (its denoiser widens its input with `.to(x.dtype)`, which a value left in fp32 widens), so
its untried fix says what its run found, never that its line is unknown."""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.engine.raising import RaisedLines
from fpdoctor.precision.compare.passes import error_under
from fpdoctor.preserve import RngState

T = 1000


def _embedding(t: torch.Tensor, dim: int = 16) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000) * torch.arange(dim // 2, dtype=torch.float32) / (dim // 2))
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.temb = nn.Linear(2, 32), nn.Sequential(nn.Linear(16, 32), nn.SiLU())
        self.out = nn.Sequential(nn.SiLU(), nn.Linear(32, 2))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = _embedding(t).to(x.dtype)
        # nearly the noise itself at t = 999, as a trained one predicts it: the exact x0 stays in fp16's range
        return x + 1e-3 * self.out(self.inp(x) + self.temb(emb))


def _cosine_betas() -> torch.Tensor:
    f = [math.cos((i / T + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(T + 1)]
    return torch.tensor([min(1 - f[i + 1] / f[i], 0.999) for i in range(T)], dtype=torch.float32)


class Sampler(nn.Module):
    def __init__(self, steps: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.steps = Denoiser(), steps
        self.register_buffer("alphas_cumprod", torch.cumprod(1.0 - _cosine_betas(), dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ts = torch.linspace(T - 1, 0, self.steps).long()
        for i, t in enumerate(ts):
            a_t = self.alphas_cumprod[t]
            a_prev = self.alphas_cumprod[ts[i + 1]] if i + 1 < len(ts) else torch.ones((), dtype=x.dtype)
            eps = self.net(x, torch.full((x.shape[0],), int(t)))
            x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        return x


def test_a_schedule_buffer_rounded_to_zero_comes_first_checked_before_the_division_it_makes_nan() -> None:
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    findings = fpdoctor.compare(Sampler().eval(), x, candidate="fp16").report.findings
    first = findings[0]
    assert first.severity == "error" and "alphas_cumprod" in first.fix, [(f.code, f.fix[:80]) for f in findings]
    assert first.trial is not None and first.trial.tried and math.isfinite(float(first.trial.after)), first.trial
    division = next(f for f in findings if f.name == "nonfinite-produced")
    assert division.trial is not None and "not known" not in division.trial.reason, division.trial
    assert "lines" in division.trial.reason and "left the output non-finite" in division.trial.reason, division.trial
    # as printed: the buffer held as a plain fp32 attribute, the model cast to fp16
    fixed = Sampler().eval()
    held = fixed.alphas_cumprod.clone()
    fixed.half()
    fixed.alphas_cumprod = held  # a buffer assigned a tensor stays a buffer: set after the cast, as printed
    with torch.no_grad():
        exact = Sampler().eval().double()(x.double())
        got = fixed(x.half()).double()
    assert bool(torch.isfinite(got).all())
    error = float((got - exact).norm() / exact.norm())
    assert abs(error - float(first.trial.after)) <= 0.1 * error, (error, first.trial)


class FixedSampler(Sampler):
    """The fix as printed: the schedule a plain fp32 attribute, which the model's cast leaves as it is."""

    def __init__(self) -> None:
        super().__init__()
        held = self.alphas_cumprod
        del self.alphas_cumprod
        self.alphas_cumprod = held.float()


def test_after_its_fix_the_samplers_lines_are_checked_in_fp32_with_its_schedule_values_as_torch_reads_them() -> None:
    """The fixed schedule is read as 0-dim fp32 values (alphas[t]), which do not widen an op on fp16 tensors
    in torch: the check of the sampler's lines in fp32 runs as the code computes (what they make cast back
    before the denoiser reads it), so what compare prints is measured, never "the run failed"."""
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    report = fpdoctor.compare(FixedSampler().eval(), x, candidate="fp16").report
    first = report.findings[0]
    assert first.name == "precision-divergence" and first.trial is not None and first.trial.tried, str(report)
    assert first.trial.after * 100 < first.trial.before, first.trial


def test_a_check_run_again_casting_at_entry_tells_its_caller_to_forget_the_failed_run() -> None:
    # the sampler's last lines in fp32 feed the denoiser a value its `.to(x.dtype)` widens: the first run
    # fails, the second casts back at every module entry; what `each` saw of the first is the caller's to drop
    source, start = inspect.getsourcelines(Sampler.forward)
    at = start + next(i for i, s in enumerate(source) if "x0 = " in s)
    lines = {(inspect.getsourcefile(Sampler) or "", at + k) for k in range(-3, 2)}
    x = torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        truth = Sampler().eval().double()(x.double()).flatten()
    seen: list[str] = []
    restarts: list[int] = []
    mode = RaisedLines(lines, torch.float16)
    error_under(
        mode, Sampler().eval().half(), (x,), torch.float16, truth=truth, norm=float(truth.norm()),
        rng=RngState.capture(), device=None, noise=None, each=lambda name, index, output: seen.append(name),
        restart=lambda: restarts.append(len(seen)),
    )  # fmt: skip
    assert mode.entry_cast and len(restarts) == 1 and 0 < restarts[0] < len(seen), (restarts, len(seen))
