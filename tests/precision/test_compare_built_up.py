"""NUM024: no part diverges, and the error the format builds up across the model is past plan's target.

A normalizing flow scored in bf16: each coupling adds 2-3x its floor and the log-likelihood carries
the sum of eight. compare used to say OK here while plan, on the same model, found the output past its
target; now it says what it measured, with the worst modules kept in fp32 as the checked fix."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


class Coupling(nn.Module):
    def __init__(self, dim: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(nn.Linear(dim, 64), nn.ReLU(), nn.Linear(64, 2 * dim))
        self.scale = nn.Parameter(torch.full((dim,), 3.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, t = self.net(x * self.mask).chunk(2, dim=-1)
        s = self.scale * torch.tanh(s) * (1 - self.mask)
        return x * self.mask + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(-1)


class Flow(nn.Module):
    """Per-sample log-likelihood: the base density of z plus the couplings' log-determinants."""

    def __init__(self, depth: int, dim: int = 16) -> None:
        super().__init__()
        masks = [(torch.arange(dim) % 2 == i % 2).float() for i in range(depth)]
        self.layers = nn.ModuleList(Coupling(dim, m) for m in masks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log_det = torch.zeros(x.shape[0], dtype=x.dtype)
        for layer in self.layers:
            x, ld = layer(x)
            log_det = log_det + ld
        return -0.5 * (x**2).sum(-1) - 0.5 * x.shape[-1] * math.log(2 * math.pi) + log_det


class _InFp32(nn.Module):
    """The fix as printed: the module in fp32, its inputs cast to fp32 and its outputs cast back."""

    def __init__(self, module: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.dtype = module.float(), dtype

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(o.to(self.dtype) for o in self.module(x.float()))


def _flow(depth: int) -> tuple[Flow, torch.Tensor]:
    torch.manual_seed(0)
    # the data served as the bf16 model gets it: rounding it costs nothing more
    return Flow(depth).eval(), torch.randn(512, 16, generator=torch.Generator().manual_seed(1)).bfloat16()


def test_a_deep_flow_in_bf16_is_said_to_build_up_its_error_and_the_kept_set_works_as_printed() -> None:
    model, x = _flow(8)
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert result.report.verdict == "warning" and first.name == "error-builds-up", str(result.report)
    ev = first.evidence
    assert ev["error_rel"] > ev["target_rel"] >= 16 * ev["floor_rel"], ev
    assert first.trial is not None and first.trial.tried and first.trial.after < ev["error_rel"], first.trial
    kept = next(t["fp32"] for t in ev["tried"] if t["error_rel"] == first.trial.after)
    if set(kept) >= {f"layers.{i}" for i in range(8)}:  # every layer: the model in fp32, never a part's fix
        assert first.fix.startswith("Keep the model in fp32"), first.fix
    else:
        assert first.fix.startswith("Keep " + ", ".join(f"`{m}`" for m in kept) + " in fp32"), first.fix
    # applied as printed, by hand
    with torch.no_grad():
        exact = model.double()(x.double())
        fixed = _flow(8)[0].to(torch.bfloat16)
        for name in kept:
            parent, _, child = name.rpartition(".")
            holder = fixed.get_submodule(parent)
            setattr(holder, child, _InFp32(getattr(holder, child), torch.bfloat16))
        got = fixed(x).double()
    assert abs(float((got - exact).norm() / exact.norm()) - first.trial.after) <= 0.1 * first.trial.after
    # plan on the same model answers it with its own search: no such finding beside its plan
    planned = fpdoctor.plan(_flow(8)[0], x, candidate="bf16")
    assert not planned.report.by_name("error-builds-up"), str(planned.report)


def test_a_shallow_flow_in_bf16_within_its_floor_stays_ok() -> None:
    model, x = _flow(2)
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert result.report.verdict == "ok", str(result.report)


def test_an_fp32_candidate_gets_no_such_finding_plan_keeps_no_module_in_fp32_for_it() -> None:
    model, x = _flow(8)
    report = fpdoctor.compare(model, x.float(), candidate="fp32", reference="fp64").report
    assert not report.by_name("error-builds-up"), str(report)
