"""Findings say the optimizer step, as a training log counts it, beside the module call count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class Gate(nn.Module):
    """Passes its input on, except on the step (and in the mode) chosen to go bad: 0 / 0."""

    def __init__(self, bad_step: int, in_training: bool = True) -> None:
        super().__init__()
        self.bad_step, self.in_training, self.step = bad_step, in_training, 0

    def forward(self, h):
        return (h - h) / (h - h) if self.step == self.bad_step and self.training == self.in_training else h


def _train(gate: Gate, steps: int = 4, evals: int = 3, scaler=None, skip_first: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), gate, nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        gate.step = step
        model.train()
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        if scaler is not None:
            scaler.scale(loss).backward()
            if skip_first and step == 1:
                with torch.no_grad():
                    model[0].bias.grad[0] = float("inf")  # an overflowed gradient: the scaler skips this step
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            for _ in range(evals):  # evaluation forwards between the steps: calls, not steps
                model(torch.randn(8, 4))


def _producer(report):
    """The gate's 0 / 0 (a skipped step's overflow is a finding of its own)."""
    return next(f for f in report.findings if f.name == "nonfinite-produced" and f.where["op"] == "aten.div.Tensor")


def test_a_finding_names_the_optimizer_step_beside_the_module_call():
    with fpdoctor.trace() as t:
        _train(Gate(bad_step=3))
    f = _producer(t.report)
    assert f.where["module"] == "1" and f.where["iteration"] == 9  # 2 steps x (1 + 3 evaluations) + 1
    assert f.evidence["step"] == 3 and "evaluation" not in f.evidence
    assert "(forward, optimizer step 3, module call 9)" in f.message
    assert ("optimizer steps", "4") in t.report.data["summary"]


def test_a_value_made_in_an_evaluation_forward_follows_a_step():
    with fpdoctor.trace() as t:
        _train(Gate(bad_step=2, in_training=False), evals=1)
    f = _producer(t.report)
    assert f.where["iteration"] == 4  # step 1's training and evaluation calls, step 2's training call, then this
    assert f.evidence["step"] == 2 and f.evidence["evaluation"] is True
    assert "in an evaluation after optimizer step 2, module call 4" in f.message


def test_a_step_the_grad_scaler_skips_is_a_step():
    scaler = torch.amp.GradScaler("cpu")
    with fpdoctor.trace() as t:
        _train(Gate(bad_step=3), scaler=scaler, skip_first=True)
    # steps 1 and 3 skipped (65536 halved twice): optimizer.step ran once before the 0 / 0
    assert scaler.get_scale() == 16384.0
    f = _producer(t.report)
    assert f.evidence["step"] == 3 and "optimizer step 3" in f.message
    assert ("optimizer steps", "4") in t.report.data["summary"]


def test_a_second_optimizer_in_the_same_iteration_adds_no_step():
    torch.manual_seed(0)
    gen, disc = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g, opt_d = torch.optim.SGD(gen.parameters(), lr=0.01), torch.optim.SGD(disc.parameters(), lr=0.01)
    with fpdoctor.trace() as t:
        for step in range(1, 4):
            fake = gen(torch.randn(8, 4))
            opt_d.zero_grad()
            disc(fake.detach()).mean().backward()
            opt_d.step()
            opt_g.zero_grad()
            out = disc(fake)
            (out / (out - out) if step == 3 else out).mean().backward()
            opt_g.step()
    f = _producer(t.report)
    assert f.evidence["step"] == 3 and ("optimizer steps", "3") in t.report.data["summary"]


@pytest.mark.parametrize(("critic", "teacher"), [(5, 0), (0, 20)], ids=["wgan-5-critic-steps", "teacher-then-student"])
def test_a_second_optimizer_after_a_phase_of_the_first_starts_its_own_steps(critic: int, teacher: int):
    """A student trained after its teacher's 20 steps (trial79: its first step was numbered the
    teacher's last, the run one step short) starts steps of its own; a WGAN's generator after its
    critic's 5 steps still joins the critic's step, as a GAN's second optimizer does."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 1), nn.Linear(4, 1)
    opt_1, opt_2 = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (first, second))

    def step(model, opt, bad=False):
        opt.zero_grad()
        out = model(torch.randn(8, 4))
        (out / (out - out) if bad else out).mean().backward()
        opt.step()

    with fpdoctor.trace() as t:
        for _ in range(teacher):
            step(first, opt_1)
        for k in range(1, 4):
            for _ in range(critic):
                step(first, opt_1)
            step(second, opt_2, bad=k == 3)
    f = _producer(t.report)
    # each critic step is a step (it steps again), the generator's joins the last of them
    expected = 3 * critic if critic else teacher + 3
    assert f.evidence["step"] == expected and ("optimizer steps", str(expected)) in t.report.data["summary"]


def test_without_an_optimizer_only_calls_are_counted():
    model = nn.Sequential(nn.Linear(4, 4), Gate(bad_step=0))
    with fpdoctor.trace() as t:
        model(torch.randn(2, 4))
    f = _producer(t.report)
    assert "step" not in f.evidence and "optimizer step" not in f.message
