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


def test_an_op_amplifying_a_submodules_rounding_gets_that_submodule_returning_fp32_checked_and_as_printed() -> None:
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1)).half()
    report = fpdoctor.compare(Residual().eval(), x, candidate="fp16").report
    first = report.findings[0]
    assert report.verdict == "error" and first.name == "precision-divergence", str(report)
    assert first.fix.startswith("Keep `net` in fp32 with its fp32 weights, returning fp32"), first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    # as printed: the fp32 net assigned again after the cast, returning fp32, the rest as the fp16 model runs it
    model = Residual().eval()
    with torch.no_grad():
        exact = Residual().double()(x.double())
        net = Residual().net
        model.half()
        model.net = net
        got = ((x - model.net(x.float())) * 100.0).double()
    error = float((got - exact).norm() / exact.norm())
    assert abs(error - first.trial.after) <= 0.1 * first.trial.after, (error, first.trial)


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
