"""An own op that amplifies the rounding of what a submodule returns (x - net(x) with net nearly the
identity, scaled up: a sampler's x0 from its denoiser's noise): its lines in fp32 are measured not to
help, since what it reads was rounded where the submodule returned it. That is what the format costs,
a warning, whose fix is the submodule kept in fp32, never the lines measured not to help. And the
check of a line that reads a 0-dim fp32 value (a schedule's alphas[t]) runs as torch computes it."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.engine.raising import RaisedLines


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(16, 16)
        with torch.no_grad():
            self.net.weight.copy_(torch.eye(16) + 1e-3 * torch.randn(16, 16))
            self.net.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.net(x)
        return (x - e) * 100.0


def test_an_op_amplifying_a_submodules_rounding_is_a_warning_with_the_submodule_as_the_fix() -> None:
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1)).half()
    report = fpdoctor.compare(Residual().eval(), x, candidate="fp16").report
    first = report.findings[0]
    assert report.verdict == "warning" and first.name == "precision-divergence", str(report)
    assert first.trial is not None and not first.trial.tried and "did not help" in first.trial.reason, first.trial
    assert first.fix.startswith("Keep the submodules whose outputs") and "own lines is the fix" in first.fix


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor(3.0)  # a plain fp32 attribute: the model's cast leaves it as it is

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            y = x / self.scale.sqrt()
            x = self.lin(y)
        return x


def test_a_raised_line_reading_a_0_dim_fp32_value_is_cast_back_as_torch_would_compute_it() -> None:
    model = Scaled().half()
    source, start = inspect.getsourcelines(Scaled.forward)
    line = start + next(i for i, text in enumerate(source) if "self.scale.sqrt()" in text)
    mode = RaisedLines({(__file__, line)}, torch.float16)
    with mode, torch.no_grad():
        out = model(torch.randn(8, 4).half())
    assert mode.raised and out.dtype == torch.float16
