"""The model's own code around its submodules (compare/own_code.py): a deterministic DDIM sampler
whose schedule (a cumulative product of 1 - beta over 1000 steps) and state are computed in bf16
around a bf16 denoiser. Its cumprod alone is ~33x its floor, the sampler's output 11x what came in:
no divergence, no line's fix enough alone, and compare said OK. The model's own ops in fp32 (its
denoiser in bf16) are now checked, named with the forward's lines, and the fix applied as printed
(the schedule's buffer a plain fp32 attribute, the state in fp32, the denoiser called on a bf16 copy
of it) brings the error down and compare's re-check (--inputs-as-given) says OK."""

from __future__ import annotations

import copy
import inspect
import math

import torch
from torch import nn

import fpdoctor


class _Eps(nn.Module):
    """An epsilon-prediction MLP with a sinusoidal timestep embedding."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.inp, self.emb = nn.Linear(dim, hidden), nn.Linear(64, hidden)
        self.body = nn.Sequential(nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        f = torch.exp(-math.log(1e4) * torch.arange(32, device=x.device) / 32)
        a = t.float()[:, None] * f[None]
        return self.body(self.inp(x) + self.emb(torch.cat([a.sin(), a.cos()], -1).to(x.dtype)))


class Sampler(nn.Module):
    """Deterministic DDIM over a linear beta schedule; `fixed`: the fix as compare prints it."""

    def __init__(self, fixed: bool = False, steps: int = 1000, sample: int = 25) -> None:
        super().__init__()
        self.eps, self.fixed = _Eps(), fixed
        betas = torch.linspace(1e-4, 0.02, steps)
        if fixed:
            self.betas = betas.float()  # a plain fp32 tensor attribute: the model's cast leaves it
        else:
            self.register_buffer("betas", betas)
        self.register_buffer("ts", torch.arange(steps - 1, -1, -(steps // sample)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = next(self.eps.parameters())
        if self.fixed:
            x = x.float()
        ab = torch.cumprod(1 - self.betas.to(x.device), 0)
        for i, t in enumerate(self.ts):
            a = ab[t]
            b = ab[self.ts[i + 1]] if i + 1 < len(self.ts) else torch.ones_like(a)
            tt = t.expand(x.shape[0])
            e = self.eps(x.to(p.dtype), tt).float() if self.fixed else self.eps(x, tt)
            x0 = (x - (1 - a).sqrt() * e) / a.sqrt()
            x = b.sqrt() * x0 + (1 - b).sqrt() * e
        return x


def _sampler(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Sampler(fixed).eval()
    with torch.no_grad():  # a prediction of unit size, as a trained one makes
        for layer in (model.eps.inp, *model.eps.body[1::2]):
            layer.weight.mul_(0.5)
    return model, torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _error(model: nn.Module, x: torch.Tensor, *, given: bool) -> float:
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        out = copy.deepcopy(model).to(torch.bfloat16)(x if given else x.to(torch.bfloat16))
    return float((out.double() - exact).norm() / exact.norm())


def test_a_samplers_own_code_in_bf16_is_named_with_a_fix_that_works_as_printed() -> None:
    model, x = _sampler()
    report = fpdoctor.compare(model, x, candidate="bf16").report
    first = report.findings[0]
    assert first.evidence.get("kind") == "own-code", str(report)
    assert first.evidence["own_op"] == "aten.cumprod.default" and first.evidence["isolated_ratio"] > 16
    first_line = inspect.getsourcelines(Sampler.forward)[1]
    assert f"lines {first_line}-" in first.fix and "(Sampler.forward)" in first.fix
    assert "`betas`" in first.fix and "a plain fp32 tensor attribute" in first.fix and "`eps`" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before
    assert first.severity == "error"  # fp32 own code cures it: the cause, as a line's cure confirms one

    fixed, _ = _sampler(fixed=True)
    fixed.load_state_dict(model.state_dict(), strict=False)  # `betas` is no longer in the state dict
    before, after = _error(model, x, given=False), _error(fixed, x, given=True)
    assert after * 4 <= before and after <= 2 * first.trial.after, (before, after)
    again = fpdoctor.compare(fixed, x, candidate="bf16", inputs_as_given=True).report
    assert not [f for f in again.findings if f.severity in ("error", "warning")], str(again)


def test_the_same_sampler_in_fp16_keeps_its_own_code_within_its_floor() -> None:
    """fp16's finer spacing holds the schedule's factors near 1: no own-code finding."""
    model, x = _sampler()
    report = fpdoctor.compare(model, x, candidate="fp16").report
    assert not [f for f in report.findings if f.evidence.get("kind") == "own-code"], str(report)
