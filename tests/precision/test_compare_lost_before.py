"""A module blamed for an error its input lost before it computed: readings projected onto a shared
baseline of 3000 (a sensor offset folded into a bias) that a LayerNorm removes. In fp16 the projection's
output is rounded to fp16's spacing of 2 there, so the variation the LayerNorm keeps is gone before it
runs: compare named the LayerNorm with "keep it in fp32", which changes nothing. Kept alone it is tried,
and the projection kept with it, fp32 between them, is the fix, checked; plan verifies that set and its
code, as printed, gives the decisions back."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Baseline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(24, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(64, 5))
        with torch.no_grad():
            self.proj.weight.mul_(0.05)
            self.proj.bias.fill_(3000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(x)))


def _made() -> nn.Module:
    torch.manual_seed(0)
    return Baseline().eval()


X = torch.randn(256, 24, generator=torch.Generator().manual_seed(1))


def _top1(model: nn.Module, x: torch.Tensor, exact: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).float().argmax(-1) == exact.argmax(-1)).float().mean())


def test_the_module_before_kept_with_it_fp32_between_is_the_checked_fix_and_the_plan():
    with torch.no_grad():
        exact = _made().double()(X.double())
    report = fpdoctor.compare(_made(), X, candidate="fp16").report
    first = report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "norm", first.title
    assert first.fix.startswith("keep `proj` and `norm` in fp32, `proj`'s output left in fp32"), first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < first.trial.before / 10
    assert "Kept in fp32 alone, `norm` leaves the end-to-end error" in first.message
    decided = report.by_name("decisions-changed")[0]
    assert decided.fix.startswith("keep `proj` and `norm`") and decided.trial.tried, decided.fix
    # as printed: proj and norm in fp32, fp32 between them, the rest in fp16
    fixed = _made().half()
    fixed.proj.float()
    fixed.norm.float()
    fixed.forward = lambda x: fixed.head(fixed.norm(fixed.proj(x.float())).to(x.dtype))
    assert _top1(_made().half(), X.half(), exact) < 0.5 and _top1(fixed, X.half(), exact) > 0.97
    result = fpdoctor.plan(_made(), X, candidate="fp16")
    assert result.plan.verified and result.plan.keep_fp32 == ["proj", "norm"] and result.plan.fp32_outputs == ["proj"]
    planned = _made()
    exec(result.plan.to_code(), {"model": planned})  # as printed
    assert _top1(planned, X, exact) > 0.97
