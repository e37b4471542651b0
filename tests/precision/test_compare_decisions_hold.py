"""A classifier whose inputs' rounding costs more than the noise floor while its decisions stay the
exact model's: compare warns (the error is the inputs'), and passes, rather than failing a CI job
on a model whose every decision is right."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class _Centred(nn.Module):
    """Readings near 500 (spread 30), centred inside the model, then a classifier with wide margins."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("centre", torch.full((8,), 500.0))
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.head.weight.copy_(4 * torch.randn(4, 8, generator=g))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x - self.centre)


def _inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    centres = 30 * torch.randn(4, 8, generator=g)
    labels = torch.arange(256) % 4
    return 500 + centres[labels] + 0.3 * torch.randn(256, 8, generator=g)


def test_inputs_rounding_with_decisions_that_hold_is_a_warning() -> None:
    result = fpdoctor.compare(_Centred().eval(), _inputs(), candidate="bf16")
    found = [f for f in result.report.findings if f.name == "precision-divergence"]
    assert found and all(f.severity == "warning" for f in found), str(result.report)
    assert "The decisions hold all the same: top-1 agreement" in found[0].message
    assert result.report.verdict == "warning" and result.report.data["decisions"]["top1"] >= 0.99
