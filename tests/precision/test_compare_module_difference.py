"""A difference of two large outputs of one module (two altitudes near 500 m subtracted into an
elevation gain, two reward scores into a preference): in bf16 each output is rounded to a spacing of
2-4 before the subtraction, and the difference is lost. The op that shows it (the subtraction) reads
a submodule's outputs, where compare's walk upstream stops; raising the subtraction's line alone
changes nothing. compare then raises the lines that call the module too, which runs the module's
ops in fp32, and says so; the fix written as printed (the module's functional form on the input
.float() with its own parameters .float(), the result cast back) makes compare OK."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Gain(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU())
        self.head = nn.Linear(64, 1)
        nn.init.constant_(self.head.bias, 500.0)

    def wide(self, x: torch.Tensor) -> torch.Tensor:
        """The modules the lines call, as printed: their functional forms on x.float() with their own
        parameters .float()."""
        first = self.body[0]
        h = F.gelu(F.linear(x.float(), first.weight.float(), first.bias.float()))
        return F.linear(h, self.head.weight.float(), self.head.bias.float())

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            return (self.wide(a) - self.wide(b)).squeeze(-1).to(self.head.weight.dtype)
        za = self.head(self.body(a))
        zb = self.head(self.body(b))
        return (za - zb).squeeze(-1)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    a = torch.randn(256, 16)
    return a, torch.randn(256, 16)


def test_a_difference_of_two_outputs_of_one_module_raises_the_lines_that_call_it_and_the_fix_is_ok():
    torch.manual_seed(0)
    model = Gain().eval()
    report = fpdoctor.compare(model, _inputs(), candidate="bf16").report
    first = report.findings[0]
    assert first.name == "precision-divergence" and first.evidence["own_op"] == "aten.sub.Tensor", first.title
    source, start = inspect.getsourcelines(Gain.forward)
    lines = [start + k for k, text in enumerate(source) if "za = " in text or "zb = " in text or "za - zb" in text]
    assert f"lines {lines[0]}-{lines[-1]}" in first.fix, first.fix
    assert "that module in fp32 too" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 0.1 * first.trial.before
    torch.manual_seed(0)
    fixed = Gain(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    after = fpdoctor.compare(fixed, _inputs(), candidate="bf16").report
    assert after.verdict == "ok", [(f.name, f.message[:200]) for f in after.findings]
