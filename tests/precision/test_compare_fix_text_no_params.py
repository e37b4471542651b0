"""A fix whose lines sit in a module with no parameters and call no module: the printed fix says how to
cast back there (the dtype of the tensor the lines read), not through a parameter the module lacks, and
carries no recipe for modules the lines never call. Case: a running standardisation by cumulative sums
of readings near 45 over 2048 steps, in bf16."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class RunningStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)
        mean = x.cumsum(1) / n
        var = (x * x).cumsum(1) / n - mean**2
        return (x - mean) / torch.sqrt(var.clamp_min(0) + 1e-5)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RunningStandardize()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)[:, -256:].mean(1))


def test_the_fix_in_a_module_without_parameters_casts_back_by_its_input():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = 40.0 + 10 * torch.rand(16, 1, 8, generator=g) + 0.3 * torch.randn(16, 2048, 8, generator=g)
    x = x.bfloat16().float()  # readings bf16 holds: the sums lose, not the inputs
    first = fpdoctor.compare(Classifier().eval(), x, candidate="bf16").report.findings[0]
    assert first.trial is not None and first.trial.tried, first
    assert "x.dtype" in first.fix and "F.layer_norm" not in first.fix, first.fix
