"""The observer never perturbs: with trace on, outputs, gradients and parameters are bitwise equal."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
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


def _recipe(traced: bool, impl: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """AdamW (foreach or fused), autocast with a GradScaler, BatchNorm, two micro-batches a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **{impl: True})
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    data = torch.randn(3, 2, 6, 8)  # steps x micro-batches x batch x features
    seen: list[torch.Tensor] = []

    def step(batches: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        for x in batches:
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x).float().square().mean() / len(batches)
            scaler.scale(loss).backward()
            seen.append(loss.detach())
        seen.extend(p.grad.detach().clone() for p in model.parameters())
        scaler.step(opt)
        scaler.update()

    for batches in data:
        if traced:
            with fpdoctor.trace(model) as t:
                step(batches)
            assert t.report is not None and t.report.findings == [], [f.title for f in t.report.findings]
        else:
            step(batches)
    return [*seen, *model.parameters(), *model.buffers(), *(v for s in opt.state.values() for v in s.values())]


@pytest.mark.parametrize("impl", ["foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_trace_is_bitwise_invisible_on_an_amp_recipe(impl, dtype):
    plain, traced = _recipe(False, impl, dtype), _recipe(True, impl, dtype)
    assert len(plain) == len(traced)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))


def test_a_run_of_the_users_model_leaves_its_modules_public_attributes_as_they_were():
    """preserve.preserved (every replay, reference step and what-if runs inside it): attributes a step
    sets, rebinds, writes in place or appends to are as before; torch's own (leading underscore) are not
    touched."""
    from fpdoctor.preserve import preserved

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    inner = model[0]
    inner.total, inner.outputs, inner.seen = torch.zeros(()), [1.0, torch.ones(3)], {"a": 1, "t": torch.ones(2)}
    inner.history, inner.recent = collections.defaultdict(list, {"loss": [0.5]}), collections.deque([1], maxlen=4)
    with torch.inference_mode():
        inner.cached = torch.ones(2)  # made in an evaluation under inference_mode: keeps no version
    inner.gone = None
    total = inner.total
    with preserved(model):
        inner.total.add_(5.0)  # in place
        inner.outputs.append(torch.zeros(3))  # tensors in the list: compared by identity, not ==
        inner.seen["b"] = 2
        inner.extra = torch.ones(1)  # set
        inner.total = torch.full((), 7.0, dtype=torch.float64)  # rebound
        inner.history["loss"].append(0.7)  # one level down
        inner.history["acc"].append(0.1)
        inner.recent.append(2)
        del inner.gone  # a None deleted
    assert inner.total is total and float(total) == 0.0
    assert len(inner.outputs) == 2 and sorted(inner.seen) == ["a", "t"] and not hasattr(inner, "extra")
    assert dict(inner.history) == {"loss": [0.5]} and list(inner.recent) == [1] and inner.recent.maxlen == 4
    assert inner.gone is None and inner.cached.is_inference()
