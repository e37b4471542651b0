"""Running states that are the cause only together (a sum and what it is divided by): compare tries
each alone, then all of them, and prints the set with its figures; applied as printed, the error is
gone. Two models the shared cases do not contain: a streaming mean (a sum and a count) and a decayed
average (a numerator and a denominator, each updated with a decay)."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class RunningMean(nn.Module):
    """The mean of the tokens so far, at every token: a running sum and a running count."""

    def __init__(self, fp32_states: bool = False) -> None:
        super().__init__()
        self.fp32_states = fp32_states
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        state = torch.float32 if self.fp32_states else h.dtype
        total = h.new_zeros(h.shape[0], h.shape[-1], dtype=state)
        count = h.new_zeros(h.shape[0], 1, dtype=state)
        out = []
        for t in range(h.shape[1]):
            total = total + h[:, t]
            count = count + 1.0
            out.append((total / count).to(h.dtype))
        return torch.stack(out, 1)


class DecayedAverage(nn.Module):
    """An exponentially decayed average of the tokens: numerator and denominator decay alike."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        num = h.new_zeros(h.shape[0], h.shape[-1])
        den = h.new_zeros(h.shape[0], 1)
        out = []
        for t in range(h.shape[1]):
            num = num * 0.995 + h[:, t]
            den = den * 0.995 + 1.0
            out.append(num / den)
        return torch.stack(out, 1)


def _states_finding(model: nn.Module, x: torch.Tensor) -> fpdoctor.Finding:
    result = fpdoctor.compare(model, x, candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    assert finding.evidence["kind"] == "accumulation", str(result.report)
    return finding


def test_a_sum_and_its_count_are_tried_together_and_the_fix_as_printed_removes_the_error():
    torch.manual_seed(0)
    x = torch.randn(2, 600, 16) + 0.5
    finding = _states_finding(RunningMean().eval(), x)
    assert len(finding.evidence["state_locations"]) == 2 and "all of them" in finding.fix
    assert finding.trial is not None and finding.trial.tried and "together" in finding.trial.changed
    assert "float32[2, 600, 16]" in finding.trial.on  # which input it was checked on
    for state in finding.evidence["states_tried"]:  # each alone leaves far more than both together
        assert state["raised_rel"] > 2 * finding.trial.after

    torch.manual_seed(0)
    fixed = fpdoctor.compare(RunningMean(fp32_states=True).eval(), x, candidate="bf16")
    assert fixed.report.verdict == "ok", str(fixed.report)


def test_a_decayed_numerator_and_denominator_are_named_together():
    torch.manual_seed(0)
    finding = _states_finding(DecayedAverage().eval(), torch.randn(2, 400, 16) + 0.5)
    assert finding.trial is not None and finding.trial.tried
    assert finding.trial.after * 4 <= finding.trial.before
