"""A rollout whose output is lost in its units before the error reaches DIVERGENCE_RATIO times what any
part explains: an Euler integration of a learned field, 400 steps in bf16. The running state is tried
(it was "the error builds up across them, find the large value", which cannot apply), and only the state
is named: the field's line reads the state, it does not carry one."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fpdoctor


class Field(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Euler(nn.Module):
    def __init__(self, steps: int = 400, state_fp32: bool = False) -> None:
        super().__init__()
        self.field, self.steps, self.state_fp32 = Field(), steps, state_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = []
        dtype = x.dtype
        if self.state_fp32:  # the fix as printed: the state created in fp32, what is read from it cast back
            x = x.float()
        for _ in range(self.steps):
            x = x + 1e-3 * self.field(x.to(dtype)).to(x.dtype)
            out.append(x.to(dtype))
        return torch.stack(out, 1)


def _model(**kwargs: bool) -> tuple[Euler, torch.Tensor]:
    torch.manual_seed(0)
    model = Euler(**kwargs).eval()
    with torch.no_grad():
        for p in model.field.net[0].parameters():
            p.mul_(1.5)
    return model, 3.0 + 0.2 * torch.randn(8, 8, generator=torch.Generator().manual_seed(1))


def test_an_output_lost_below_the_divergence_ratio_gets_its_running_state_named_and_checked():
    model, x = _model()
    result = fpdoctor.compare(model, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.evidence.get("kind") == "accumulation", first
    lines = inspect.getsourcelines(Euler.forward)
    state = lines[1] + next(i for i, text in enumerate(lines[0]) if "x = x + 1e-3" in text)
    assert f":{state} in fp32" in first.fix, first.fix
    field_line = inspect.getsourcelines(Field.forward)[1] + 1
    assert f":{field_line}" not in first.fix, first.fix  # the field reads the state; it carries none
    assert first.trial is not None and first.trial.tried and first.trial.after * 5 < first.trial.before
    # as printed: the state in fp32 takes the rollout's error down as checked
    fixed, _ = _model(state_fp32=True)
    exact = model.double()(x.double())
    err = {
        name: float((m.to(torch.bfloat16)(x.to(torch.bfloat16)).double() - exact).norm() / exact.norm())
        for name, m in (("as is", _model()[0]), ("fixed", fixed))
    }
    assert err["fixed"] * 5 < err["as is"], err


class Rk4(nn.Module):
    """The same field stepped by RK4: its four stages feed each other within a step (k2 reads x + dt/2 k1),
    a cycle of two lines that carries nothing from one step to the next."""

    def __init__(self, steps: int = 300) -> None:
        super().__init__()
        self.field, self.steps = Field(), steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, dt = [], 1e-3
        for _ in range(self.steps):
            k1 = self.field(x)
            k2 = self.field(x + dt / 2 * k1)
            k3 = self.field(x + dt / 2 * k2)
            k4 = self.field(x + dt * k3)
            x = x + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            out.append(x)
        return torch.stack(out, 1)


def test_rk4_stages_that_feed_each_other_within_a_step_are_not_named_beside_the_state():
    model, x = _model()
    rk4 = Rk4().eval()
    rk4.field.load_state_dict(model.field.state_dict())
    result = fpdoctor.compare(rk4, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.evidence.get("kind") == "accumulation", first
    lines = inspect.getsourcelines(Rk4.forward)
    state = lines[1] + next(i for i, text in enumerate(lines[0]) if "x = x + dt / 6" in text)
    assert f"running state updated at {__file__}:{state} in fp32" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 5 < first.trial.before
