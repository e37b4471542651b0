"""Running states that are the cause only together (a sum and what it is divided by): compare keeps
every state that rounds in fp64 in one checked run, and prints the set with its figure; applied as
printed, the error is gone. Two models the shared cases do not contain: a streaming mean (a sum and
a count) and a decayed average (a numerator and a denominator, each updated with a decay). A state
updated only by ops that select among values (a running max beside a running sum) holds them
exactly in bf16: it is not tried, and the sum alone is the fix, in one checked run."""

from __future__ import annotations

import pytest
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
    # one checked run, both together: neither has a figure of its own
    first, second = finding.evidence["states_tried"]
    assert all(t["tried_together"] and not t["tried_alone"] and t["raised_rel"] is None for t in (first, second))
    assert finding.evidence["tried_only_together"] == [first["location"], second["location"]]
    assert "one fix, not tried one by one" in finding.message

    torch.manual_seed(0)
    fixed = fpdoctor.compare(RunningMean(fp32_states=True).eval(), x, candidate="bf16")
    assert fixed.report.verdict == "ok", str(fixed.report)


def test_a_decayed_numerator_and_denominator_are_named_together():
    torch.manual_seed(0)
    finding = _states_finding(DecayedAverage().eval(), torch.randn(2, 400, 16) + 0.5)
    assert finding.trial is not None and finding.trial.tried
    assert finding.trial.after * 4 <= finding.trial.before


class SumAndMax(nn.Module):
    """A running sum (which bf16 loses) and a running max (which it holds exactly), per token."""

    def __init__(self, sum_first: bool = True, fp32_sum: bool = False) -> None:
        super().__init__()
        self.sum_first, self.fp32_sum = sum_first, fp32_sum
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        total = h.new_zeros(h.shape[0], h.shape[-1], dtype=torch.float32 if self.fp32_sum else h.dtype)
        top = h[:, 0]
        out = []
        for t in range(h.shape[1]):
            if self.sum_first:
                total = total + h[:, t]
                top = torch.maximum(top, h[:, t])
            else:
                top = torch.maximum(top, h[:, t])
                total = total + h[:, t]
            out.append(total.to(h.dtype) + top)
        return torch.stack(out, 1)


def _counted_runs(monkeypatch) -> list[int]:
    from fpdoctor.precision.compare import compare as steps

    runs: list[int] = []
    raised, searched = steps.raised_error, steps.carried_and_raised

    def counted(*args, **kwargs):
        runs.append(len(args[3]))  # the sites raised in this run
        return raised(*args, **kwargs)

    def search_counted(*args, **kwargs):  # the search's own run, the check where it kept the states tried
        states, lines, figure = searched(*args, **kwargs)
        runs.append(len(lines))
        return states, lines, figure

    monkeypatch.setattr(steps, "raised_error", counted)
    monkeypatch.setattr(steps, "carried_and_raised", search_counted)
    return runs


@pytest.mark.parametrize("sum_first", [True, False])
def test_a_running_max_is_not_tried_and_the_sum_alone_is_the_fix_in_one_checked_run(monkeypatch, sum_first):
    runs = _counted_runs(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2, 2000, 16) + 0.5
    result = fpdoctor.compare(SumAndMax(sum_first=sum_first).eval(), x, candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    ev = finding.evidence
    assert ev["kind"] == "accumulation" and ev["state_location"].endswith(
        f":{_line('total = total + h[:, t]', 3 - sum_first)}"
    )
    assert runs == [1]  # the sum's one site, raised alone: the max is never raised
    (top,) = [t for t in ev["states_tried"] if t["location"].endswith(f":{_line('torch.maximum(top', 2 - sum_first)}")]
    assert top["exact"] and not top["tried_together"] and top["raised_rel"] is None
    assert f"{top['location']} is not tried: those ops select among values" in finding.message
    assert finding.trial is not None and finding.trial.tried and finding.trial.after == ev["raised_rel"]
    assert ev["raised_rel"] * 4 <= ev["propagated_rel"]

    torch.manual_seed(0)  # the fix as printed: the sum alone in fp32
    fixed = fpdoctor.compare(SumAndMax(sum_first=sum_first, fp32_sum=True).eval(), x, candidate="bf16")
    assert fixed.report.verdict == "ok", str(fixed.report)


def _line(text: str, nth: int = 1) -> int:
    from pathlib import Path

    lines = Path(__file__).read_text().splitlines()
    return [k + 1 for k, line in enumerate(lines) if text in line][nth - 1]


class BeamSearch(nn.Module):
    """A 3-token-context LM decoded by beam search whose scores are kept in the logits' dtype
    (trial79): the state is carried through two lines, the sum at one and its topk (or a sort and a
    slice) at the next, which returns (values, indices). The search counted a state at one line only
    and ignored tuple outputs, so the finding said "no op reads its own previous output".
    `fp32_scores`: the fix as printed (the scores created in fp32)."""

    def __init__(self, by: str = "topk", fp32_scores: bool = False, vocab: int = 800, steps: int = 120) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 64)
        self.mlp = nn.Sequential(nn.Linear(192, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.head = nn.Linear(256, vocab)
        self.by, self.fp32_scores, self.vocab, self.steps = by, fp32_scores, vocab, steps
        with torch.no_grad():
            self.head.weight.mul_(3.0)  # a trained LM is more peaked than a random init

    def forward(self, prompt: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if self.fp32_scores else self.head.weight.dtype
        ctx = prompt[-3:].repeat(4, 1)
        scores = torch.full((4,), float("-inf"), dtype=dtype)
        scores[0] = 0.0
        for _ in range(self.steps):
            logp = torch.log_softmax(self.head(self.mlp(self.emb(ctx).flatten(1))), dim=-1)
            cand = (scores[:, None] + logp).view(-1)
            if self.by == "topk":
                scores, idx = cand.topk(4)
            else:
                ranked, order = cand.sort(descending=True)
                scores, idx = ranked[:4], order[:4]
            ctx = torch.cat([ctx[idx // self.vocab, 1:], (idx % self.vocab)[:, None]], dim=1)
        return scores


@pytest.mark.parametrize("by", ["topk", "sort"])
def test_a_state_carried_through_two_lines_is_found_and_the_fix_as_printed_removes_the_error(by: str) -> None:
    torch.manual_seed(0)
    model, prompt = BeamSearch(by).eval(), torch.tensor([5, 17, 99, 3, 250])
    result = fpdoctor.compare(model, prompt, candidate="bf16")
    first = result.report.findings[0]
    assert first.evidence.get("kind") == "accumulation", [f.name for f in result.report.findings]
    assert "No op reads its own previous output" not in first.message
    assert first.trial is not None and first.trial.tried, first.trial
    assert first.trial.after * 4 < first.trial.before, first.trial
    assert len(first.evidence["state_locations"]) >= 2  # the sum's line and the selection's
    fixed = BeamSearch(by, fp32_scores=True).eval()
    fixed.load_state_dict(model.state_dict())
    after = fpdoctor.compare(fixed, prompt, candidate="bf16")
    assert after.rows[-1].propagated * 4 < result.rows[-1].propagated
