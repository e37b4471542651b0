"""A top-2 router in bf16 that picks other experts for some tokens, in a classifier: the selection's
checked fix (its lines in fp32) gives the decisions back, so the decisions finding cites it, checked
by what that run decides, instead of sending the user to a plan."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class _Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.router = nn.Linear(16, 6)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.head = nn.Linear(16, 10)
        with torch.no_grad():
            self.router.weight.mul_(0.05)
            self.router.bias.fill_(4.0)  # scores near 4: bf16 holds them in steps of 0.03
            for e in self.experts:
                e.weight.mul_(4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x), -1)
        weight, chosen = probs.topk(2, -1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                rows = chosen[:, k] == e
                out[rows] += weight[rows, k, None] * expert(x[rows])
        return self.head(torch.tanh(out))


def test_the_decisions_finding_cites_the_selections_checked_fix() -> None:
    x = torch.randn(1024, 16, generator=torch.Generator().manual_seed(4))
    report = fpdoctor.compare(_Experts().eval(), x, candidate="bf16").report
    names = [f.name for f in report.findings]
    assert names[0] == "selection-changed", names
    decisions = next(f for f in report.findings if f.name == "decisions-changed")
    assert decisions.trial is not None and decisions.trial.tried, decisions.fix
    assert "No fix tried gives the decisions back" not in decisions.message + decisions.fix
    assert report.findings[0].fix.partition("; checked:")[0] in decisions.fix
