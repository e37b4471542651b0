"""The sentinel's control experiment: a bad step that reproduces is replayed again in fp32.

Finite in fp32 only: the precision is the cause. Non-finite in fp32 too: the data or the math.
The control never touches the user's state: weights, dtypes, gradients and autocast objects."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Amplifier(nn.Module):
    """A Linear whose outputs exceed fp16's 65504 for large inputs: finite in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.weight.fill_(0.5)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) * 100.0)


def _step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    return step


def _run(model: nn.Module, batches: list[torch.Tensor], step=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = fpdoctor.Sentinel(model, opt)
    fn = step or _step(model, opt)
    for x in batches:
        guard.step(fn, x)
    return guard.report


def test_an_fp16_overflow_is_finite_in_fp32_and_blamed_on_the_precision():
    torch.manual_seed(0)
    model = Amplifier().half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.full((4, 8), 200.0, dtype=torch.float16)  # fc: 800, x100 = 80000 > 65504
    report = _run(model, [x])
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "finite"
    assert "the precision is the cause" in verdict.message
    assert "fpdoctor plan" in verdict.fix
    # the control put everything back: same tensors, same dtype, same values, no gradient
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float16 and torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_a_bug_that_is_nonfinite_in_fp32_too_is_blamed_on_the_math():
    model = nn.Linear(4, 1).half()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = torch.log(model(x) - model(x)).float().mean()  # log(0) at any precision
        loss.backward()
        return loss

    report = _run(model, [torch.ones(2, 4, dtype=torch.float16)], step=step)
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "nonfinite"
    assert "not the precision" in verdict.message


def test_autocast_overflow_and_the_users_autocast_object_is_left_as_it_was():
    torch.manual_seed(0)
    model = Amplifier()  # fp32 parameters, fp16 compute under autocast
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    region = torch.autocast("cpu", dtype=torch.float16)  # made once, reused every step
    seen: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with region:
            seen.append(torch.is_autocast_enabled("cpu"))
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    guard = fpdoctor.Sentinel(model, opt)
    guard.step(step, torch.full((4, 8), 200.0))
    verdict = guard.report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "finite"
    # step, replay at the step's precision, control in fp32
    assert seen == [True, True, False]
    guard.step(step, torch.full((4, 8), 0.01))  # the next real step runs under autocast again
    assert seen[3:] == [True] and region._enabled is True


def test_an_fp32_model_gets_no_control():
    model = nn.Linear(4, 1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = torch.log(model(x) - model(x)).mean()
        loss.backward()
        return loss

    report = _run(model, [torch.ones(2, 4)], step=step)
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert "control_fp32" not in verdict.evidence
