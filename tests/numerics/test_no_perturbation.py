"""The observer never perturbs: with trace on, outputs, gradients and parameters are bitwise equal."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fpdoctor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from models import batch, make_step, small_transformer


def _train(traced: bool):
    torch.manual_seed(0)
    model = small_transformer(layers=2, dim=64, vocab=200)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = make_step(model, opt)
    tokens, targets = batch(vocab=200, size=4, length=16)
    torch.manual_seed(1)  # dropout
    losses = []
    for _ in range(3):
        if traced:
            with fpdoctor.trace(model) as t:
                losses.append(step(tokens, targets).detach())
                opt.step()
            assert t.report is not None and t.report.verdict == "ok"
        else:
            losses.append(step(tokens, targets).detach())
            opt.step()
    grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
    return losses, grads, [p.detach().clone() for p in model.parameters()]


def test_trace_is_bitwise_invisible():
    plain, traced = _train(False), _train(True)
    for a, b in zip(plain, traced, strict=True):
        assert len(a) == len(b)
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
