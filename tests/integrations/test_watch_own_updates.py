"""`fpdoctor watch` judges torch.optim steps. A script whose weights change by code of its own (a
hand-written optimizer, a step taken from torch.autograd.grad) got "OK, no findings" with no step
judged; it is TRN033, a warning that says nothing was judged and points at `trace`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class Momentum:
    """A hand-written SGD with momentum, its buffers made with zeros_like (bf16 on a bf16 model)."""

    def __init__(self, params, lr: float = 1e-2, beta: float = 0.9) -> None:
        self.params, self.lr, self.beta = list(params), lr, beta
        self.bufs = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        for p, buf in zip(self.params, self.bufs, strict=True):
            buf.mul_(self.beta).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def _data(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(32, 6, generator=g)
    return x.to(dtype), (x[:, :1] * 3).to(dtype)


@pytest.mark.parametrize("how", ["hand-written momentum, bf16", "autograd.grad, fp32"])
def test_weights_updated_by_the_scripts_own_code_are_said_not_judged(how):
    torch.manual_seed(0)
    dtype = torch.bfloat16 if "bf16" in how else torch.float32
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)
    opt = Momentum(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    with fpdoctor.watch() as w:
        for step in range(40):
            x, y = _data(step, dtype)
            loss = nn.functional.mse_loss(model(x), y)
            if how.startswith("autograd.grad"):
                grads = torch.autograd.grad(loss, list(model.parameters()))
                with torch.no_grad():
                    for p, g in zip(model.parameters(), grads, strict=True):
                        p.sub_(1e-2 * g)
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    first = w.report.findings[0]
    assert first.name == "updates-outside-optimizer", [f.name for f in w.report.findings]
    assert first.severity.value == "warning" and first.evidence["training_forwards"] == 40
    assert "fpdoctor trace" in first.fix and first.trial is not None and not first.trial.tried


@pytest.mark.parametrize("how", ["torch.optim", "gradients only", "LBFGS, a closure"])
def test_a_torch_optim_loop_or_a_loop_that_updates_nothing_is_not_it(how):
    """An optimizer the watch judges; one that steps with a closure (LBFGS, Lightning's loop), which the
    watch does not judge itself but is torch.optim's; a loop that takes gradients (a saliency probe in
    training mode) and leaves the weights as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = (
        torch.optim.LBFGS(model.parameters(), max_iter=2)
        if "LBFGS" in how
        else torch.optim.SGD(model.parameters(), lr=1e-2)
    )
    with fpdoctor.watch() as w:
        for step in range(40):
            x, y = _data(step, torch.float32)

            def closure(x=x, y=y):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            if "LBFGS" in how:
                opt.step(closure)
                continue
            closure()
            if how == "torch.optim":
                opt.step()
    assert "updates-outside-optimizer" not in [f.name for f in w.report.findings]


def test_a_torch_optim_step_compiled_into_a_graph_is_not_taken_for_an_update_of_the_scripts_own():
    """A compiled training step runs its optimizer step inside the graph, where no step hook is called."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    @torch.compile(backend="aot_eager")
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    with fpdoctor.watch() as w:
        for i in range(25):
            step(*_data(i, torch.float32))
    assert "updates-outside-optimizer" not in [f.name for f in w.report.findings]


class _Lazy:
    """A live object of another library whose class lookup runs code (a lazy proxy): it raises."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise RuntimeError("resolved lazily")


def test_a_live_object_whose_class_lookup_raises_does_not_break_the_search_for_an_optimizer():
    lazy = _Lazy()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    with fpdoctor.watch() as w:
        for step in range(40):
            x, y = _data(step, torch.float32)
            grads = torch.autograd.grad(nn.functional.mse_loss(model(x), y), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.sub_(1e-2 * g)
    assert lazy is not None and [f.name for f in w.report.findings] == ["updates-outside-optimizer"], [
        (f.name, f.message[:120]) for f in w.report.findings
    ]
