"""`compare` after the fix of a module's own divergence, where what is left is the bf16 rounding of the readings
it standardises: the module still leaves its floor (78x), but the model's output is at 1.8x its own floor, as
the layers after it absorb the difference. It was an ERROR (exit 1: a CI job failing on fixed code); it is a
warning that says the error does not reach the output. Before the fix the same module is an error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class RunningStandardise(nn.Module):
    """Each reading standardised by the mean and spread of the readings so far; `fixed`: the running sums in
    fp32 (compare's fix for them), else in the model's dtype."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float() if self.fixed else x
        n = torch.arange(1, x.shape[-1] + 1, device=x.device, dtype=wide.dtype)
        mean = wide.cumsum(-1) / n
        var = ((wide * wide).cumsum(-1) / n - mean * mean).clamp_min(0.0)
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        return (x - mean) / torch.sqrt(var + 1e-3)


class Detector(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        self.norm = RunningStandardise(fixed)
        self.convs = nn.Sequential(
            nn.Conv1d(3, 24, 5, padding=2), nn.GELU(), nn.Conv1d(24, 24, 5, padding=2), nn.GELU()
        )
        self.head = nn.Conv1d(24, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.convs(self.norm(x))))


def _readings() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    levels = torch.tensor([55.0, 1.2, 310.0]).view(1, 3, 1)
    spread = torch.tensor([2.0, 0.05, 3.0]).view(1, 3, 1)
    return levels + spread * torch.randn(4, 3, 1024, generator=g)


@pytest.mark.parametrize("fixed", [False, True], ids=["sums in bf16", "sums in fp32"])
def test_a_divergence_the_output_absorbs_is_a_warning_and_one_that_reaches_it_an_error(fixed: bool) -> None:
    torch.manual_seed(0)
    result = fpdoctor.compare(Detector(fixed).eval(), _readings(), candidate="bf16")
    [found] = result.report.by_name("precision-divergence")
    assert found.where["module"] == "norm", found.where
    if not fixed:
        assert found.severity == "error" and result.report.verdict == "error"
        return
    assert found.severity == "warning" and result.report.verdict != "error", found
    assert "does not reach the output" in found.message
    root = result.rows[-1]
    assert root.propagated <= 2.0 * root.floor
