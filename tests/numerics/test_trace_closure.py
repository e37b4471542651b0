"""A step taken with a closure (LBFGS; Lightning's automatic optimization runs training_step in one):
the closure's forward and backward run inside optimizer.step(), and their ops are the forward's and
the backward's, not the update's. A division by 0 in the closure's forward was the optimizer's phase,
called masked, and the first finding was its backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


@pytest.mark.parametrize("optimizer", ["sgd", "lbfgs"])
def test_a_closures_forward_is_the_forward(optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    params = model.parameters()
    opt = torch.optim.SGD(params, lr=0.1) if optimizer == "sgd" else torch.optim.LBFGS(params, max_iter=2)
    x = torch.randn(16, 4)
    x[3] = 0  # its row's denominator is 0

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) / x.sum(1, keepdim=True).abs().sqrt()).mean()
        loss.backward()
        return loss

    with fpdoctor.trace(model) as t:
        for _ in range(2):
            opt.step(closure)
    first = t.report.findings[0]
    assert first.where["phase"] == "forward" and first.where["op"] == "aten.div.Tensor", (first.title, first.where)
    assert not t.report.by_name("nonfinite-masked"), [f.title for f in t.report.findings]
