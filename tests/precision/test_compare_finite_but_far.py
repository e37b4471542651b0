"""A non-finite output whose narrow fix leaves it finite but far off: a hand-written log-mel front end in
fp16, whose power spectrum of quiet frames underflows to 0 before `log(mel + 1e-10)` (1e-10 is 0 in fp16)
makes -inf. The log's line in fp32 makes the output finite, but the spectrum it reads was already
flushed: the error stays ~1000x the output's floor. The module kept in fp32 is checked beside it and
leads, and works as printed."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


class Front(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        n, k = torch.arange(64, dtype=torch.float32), torch.arange(33, dtype=torch.float32)
        self.register_buffer("cos", torch.cos(2 * math.pi * n[:, None] * k[None] / 64) / 8)
        self.register_buffer("mel", torch.rand(33, 16, generator=g) / 4)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        power = (frames @ self.cos).pow(2)
        logmel = torch.log(power @ self.mel + 1e-10)
        return (logmel - logmel.mean(1, keepdim=True)) / (logmel.std(1, keepdim=True) + 1e-5)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.frontend, self.head = Front(), nn.Sequential(nn.Flatten(), nn.Linear(40 * 16, 10))

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.head(self.frontend(frames))


def test_a_nan_fix_that_leaves_the_output_far_off_gives_way_to_its_module_in_fp32_checked_as_printed():
    g = torch.Generator().manual_seed(1)
    x = torch.logspace(0, -4, 8)[:, None, None] * torch.randn(8, 40, 64, generator=g)  # loud to near-silent
    first = fpdoctor.compare(Net().eval(), x, candidate="fp16").report.findings[0]
    assert first.name == "nonfinite-produced" and first.fix.startswith("keep `frontend` in fp32"), first.fix
    assert "the output is finite but its error is" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 1e-2, first.trial
    # as printed: the model in fp16, `frontend` in fp32 taking its input cast up and giving its output back in fp16
    model = Net().eval().half()
    front = model.frontend.float()
    forward = front.forward
    front.forward = lambda frames: forward(frames.float()).half()  # type: ignore[method-assign]
    with torch.no_grad():
        exact = Net().eval().double()(x.double())
        got = model(x.half()).double()
    error = float((got - exact).norm() / exact.norm())
    assert error < 3 * first.trial.after, (error, first.trial)
