"""A loss that is finite while its gradient is not (a pairwise distance through sqrt, 0 on the diagonal):
the watch replays the model, not the loss code, and its finding said the loss "(or its gradient)" was
non-finite (trial134: the script's loss was finite on every step). It says which: the loss finite, its
gradient not, in the loss code."""

from __future__ import annotations

import torch
from torch import nn

from fpdoctor.integrations.script import ScriptWatch


def test_a_finite_loss_whose_gradient_is_not_is_told_as_such() -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    losses = []
    watch = ScriptWatch(gpu_health=False)
    with watch:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            e = model(x)
            loss = (e[:, None, :] - e[None, :, :]).pow(2).sum(-1).sqrt().mean()  # sqrt(0) on the diagonal
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))  # the premise: the loss itself is finite
    (replayed,) = [f for f in watch.report.findings if f.name == "deterministic-nonfinite"]
    assert "so was the step's loss, while the loss's gradient was not" in replayed.message, replayed.message
