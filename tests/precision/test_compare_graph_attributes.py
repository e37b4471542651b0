"""A model that keeps a tensor of its last training forward as a plain attribute (a mixture of
experts' load-balancing loss, `self.aux_loss = ...`, still in the autograd graph) cannot be
deep-copied as it is: torch refuses to copy a non-leaf tensor. compare and plan copy it all the
same (that tensor as a detached value) and leave the user's model as it was."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Routed(nn.Module):
    def __init__(self, d: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.aux_loss: torch.Tensor | None = None
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)
        self.aux_loss = (probs.mean(0) ** 2).sum() * probs.shape[-1]  # kept for the training loss
        self.history = [self.aux_loss]
        return sum(probs[:, e : e + 1] * expert(x) for e, expert in enumerate(self.experts))


def _trained() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(Routed(), nn.GELU(), nn.Linear(32, 10))
    x = torch.randn(64, 32)
    loss = F.cross_entropy(model(x), torch.randint(0, 10, (64,))) + 0.01 * model[0].aux_loss
    loss.backward()  # the attribute stays a non-leaf tensor of that graph
    return model, x


def test_compare_and_plan_run_on_a_model_holding_a_tensor_of_its_graph_and_leave_it_as_it_was():
    model, x = _trained()
    held, listed = model[0].aux_loss, model[0].history
    assert not held.is_leaf
    report = fpdoctor.compare(model, x, candidate="fp16").report
    assert report.findings is not None
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert result.report is not None
    assert model[0].aux_loss is held and model[0].history is listed and not held.is_leaf
