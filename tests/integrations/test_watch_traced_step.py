"""`fpdoctor watch` replays a bad step through the model alone; where the NaN is made in the loss
code, that replay cannot name the op. The watch then traces the next training step through its
loss and backward, with `fpdoctor trace`'s engine, and leads with the same checked fix. Two losses
of our own whose constant is 0 in fp16: a normalisation `t / (||t|| + 1e-10)` over padded rows (0/0
in the forward) and a smoothed cross-entropy at temperature
0.02 with `log(p.clamp_min(1e-30))` (log 0 times a weight of 0).
Each fix, applied as printed, gives a run with no bad step."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fpdoctor

FIX = re.compile(r"Replace the constant (\S+) at \S+:(\d+) \(it is 0 in float16\) with ([0-9.e+-]+),")
EPS = {"normalise": 1e-10, "smoothed": 1e-30}


def normalised_loss(out: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    t = target.half()
    unit = t / (t.norm(dim=1, keepdim=True) + eps)  # padded rows are all zero: 0 / eps
    return (out.float() - unit.float()).pow(2).mean()


def smoothed_loss(out: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    p = (out.half() / 0.02).softmax(-1)  # a sharp temperature: small probabilities underflow to 0
    weight = (target != 0).half()  # classes absent from the row weigh 0
    return -(weight * p.clamp_min(eps).log()).sum(-1).mean().float()


LOSSES = {"normalise": normalised_loss, "smoothed": smoothed_loss}


def _train(kind: str, eps: float, steps: int = 12) -> tuple[fpdoctor.ScriptWatch, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    bad = 0
    with fpdoctor.watch(reference_every=0) as w:
        for _ in range(steps):
            x = torch.randn(32, 16, generator=g)
            target = torch.randn(32, 8, generator=g)
            target[::4] = 0  # padded rows / absent classes
            if kind == "smoothed":
                target = (target > 0.5).float() * 0.9 + 0.0125
                target[::4, :4] = 0
            opt.zero_grad()
            loss = LOSSES[kind](model(x), target, eps)
            bad += not bool(torch.isfinite(loss))
            loss.backward()
            opt.step()
    return w, bad


@pytest.mark.parametrize("kind", sorted(LOSSES))
def test_a_nan_made_in_the_loss_code_gets_the_traced_steps_checked_fix(kind):
    watched, bad = _train(kind, EPS[kind])
    assert bad > 0  # the run as written goes NaN
    first = watched.report.findings[0]
    fix = FIX.search(first.fix)
    assert fix, (first.title, first.fix)
    assert float(fix[1]) == EPS[kind] and torch.tensor(EPS[kind], dtype=torch.float16) == 0
    assert first.trial is not None and first.trial.tried
    assert first.evidence["traced_step"] == watched.report.data["traced_step"]["step"]
    # applied as printed: the constant the fix names, nothing else
    fixed, bad_after = _train(kind, float(fix[3]))
    assert bad_after == 0 and not fixed.report.by_name("deterministic-nonfinite")


def test_a_bad_step_the_replay_explains_traces_nothing():
    """A NaN the model's own replay names with a checked fix: no step is traced."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with fpdoctor.watch(reference_every=0) as w:
        for i in range(4):
            x = torch.randn(8, 4)
            if i == 2:
                x[0, 0] = float("inf")  # bad data: the replay names the input
            opt.zero_grad()
            nn.functional.mse_loss(model(x), torch.zeros(8, 1)).backward()
            opt.step()
    assert "traced_step" not in w.report.data


def test_a_traced_step_the_scaler_skipped_is_told_as_that_step_not_as_the_whole_run():
    """A Gaussian likelihood by hand (the squared error over exp of a log-variance) under fp16 autocast
    and a GradScaler: on every 4th batch the log-variance passes 11, exp overflows, the loss stays
    finite (x / Inf = 0) and its gradients do not. The watch traces a step after a replayed one; the
    trace's count is of that one step, so the finding says which step it was, never 'skipped 1 of 1
    steps: the optimizer never ran' on a run that stepped on most of its batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    g = torch.Generator().manual_seed(1)
    with fpdoctor.watch(reference_every=0) as w:
        for step in range(40):
            x = torch.randn(64, 8, generator=g) * (30.0 if step % 4 == 3 else 1.0)  # every 4th batch: wide
            y = torch.randn(64, generator=g)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                mu, log_var = out[:, 0], out[:, 1].abs() * 4.0
                loss = 0.5 * (log_var + (y - mu) ** 2 / torch.exp(log_var)).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    first = w.report.findings[0]
    assert first.name == "grad-scaler-stalled" and first.evidence.get("traced_step"), [
        f.name for f in w.report.findings
    ]
    assert first.title == (
        f"GradScaler skipped the step traced at step {first.evidence['traced_step']}: its non-finite value is made "
        "at aten.exp.default"
    ), first.title
    assert "1 of 1" not in first.title + first.message and "never moved" not in first.message, first.message
