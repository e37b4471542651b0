"""A log of a softmax's probability written by hand under fp16 autocast with a GradScaler (a policy
gradient's log pi(a|s), a focal or label-smoothed loss): the log's backward divides the scaled gradient
by the probability, past fp16's range for an unlikely action, and the scaler skips step after step.
"Compute the division in fp32" cannot be written (autograd's op) and does not help (what it hands back
stays past the range); trace names the stable form, F.log_softmax, checked on the step's gradient.
Written with F.log_softmax, the same run has no finding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _run(stable: bool, steps: int = 30, eps: bool = False) -> fpdoctor.numerics.api.Trace:
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32))
    with torch.no_grad():
        policy[2].weight.mul_(12.0)  # a policy grown confident: most actions' probabilities near 0
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    with fpdoctor.trace(policy) as t:
        for _ in range(steps):
            obs = torch.randn(128, 16, generator=g)
            actions = torch.randint(0, 32, (128,), generator=g)  # replayed from an older policy
            advantages = torch.randn(128, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                logits = policy(obs)
                if stable:
                    logp = torch.nn.functional.log_softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
                elif eps:  # a guard against log(0), on its own line: the backward still divides by the probability
                    probs = torch.softmax(logits, -1).gather(1, actions[:, None]).squeeze(1)
                    logp = torch.log(probs + 1e-8)
                else:
                    logp = torch.log(torch.softmax(logits, -1).gather(1, actions[:, None]).squeeze(1))
                loss = -(advantages * logp).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return t


@pytest.mark.parametrize("stable", [False, True], ids=["log of softmax", "log_softmax"])
def test_the_backward_of_a_log_of_softmax_is_fixed_by_its_stable_form(stable: bool) -> None:
    findings = _run(stable).report.findings
    if stable:
        assert not [f for f in findings if f.severity == "error"], [(f.code, f.title) for f in findings]
        return
    first = findings[0]
    assert first.name == "grad-scaler-stalled", [(f.code, f.title) for f in findings]
    assert first.fix.startswith("Write F.log_softmax(x, dim) instead of log(softmax(x, dim))"), first.fix
    assert "in fp32" not in first.fix.split(".")[0], first.fix
    assert first.trial is not None and first.trial.tried and first.trial.before == "inf", first.trial
    assert isinstance(first.trial.after, float) and first.trial.after < 65504, first.trial


def test_a_log_of_softmax_guarded_by_an_eps_on_another_line_gets_the_stable_form_too() -> None:
    first = _run(False, eps=True).report.findings[0]
    assert first.name == "grad-scaler-stalled", first.title
    assert first.fix.startswith("Write F.log_softmax(x, dim) instead of log(softmax(x, dim) + eps) at lines "), (
        first.fix
    )
    assert first.trial is not None and first.trial.tried and first.trial.before == "inf", first.trial
