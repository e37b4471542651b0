"""A sampler whose output is a filtered distribution (top-p: the rest of the vocabulary masked to 0):
compare judges the entries each row keeps, beside rounding the exact output, and is never OK where
the candidate moves more than 1% of them (a nucleus of 435 tokens in bf16 loses 16 a row, because the
cumulative sum is rounded near p). The selection search then names the comparison, row by row (a few
of each row's 2048 values decide the set), and the line set in fp32 that gives the sets back,
checked by the values decided otherwise. With that fix the kept sets move by less than 1%: OK, and the
summary says what was judged. A nucleus of thousands of tokens that gains a few dozen of the smallest
is reported, not flagged."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor


class LM(nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 128) -> None:
        super().__init__()
        self.emb, self.mix = nn.Embedding(vocab, d), nn.GRU(d, d, batch_first=True)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.mix(self.emb(ids))
        return self.head(self.norm(h[:, -1]))


class TopP(nn.Module):
    """Keeps the smallest set of tokens whose mass reaches p (`wide`: the sum in fp32), renormalised; or
    (`logits`) returns the logits with the rest set to -inf, as a generation loop's logits warper does."""

    def __init__(self, lm: nn.Module, *, wide: bool, logits: bool = False, p: float = 0.95) -> None:
        super().__init__()
        self.lm, self.wide, self.logits, self.p = lm, wide, logits, p

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        scores = self.lm(ids) / 0.7
        probs = scores.softmax(-1)
        ranked, order = probs.sort(-1, descending=True)
        mass = ranked.float() if self.wide else ranked
        inside = mass.cumsum(-1) - mass < self.p  # the mass before each token
        keep = torch.zeros_like(inside).scatter(-1, order, inside)
        if self.logits:
            return scores.masked_fill(~keep, float("-inf"))
        kept = probs * keep
        return kept / kept.sum(-1, keepdim=True)


SUM = next(n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "inside = mass.cumsum" in line)


def _sampler(wide: bool, logits: bool = False, scale: float = 3.0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(11)
    lm = LM()
    with torch.no_grad():
        lm.head.weight.mul_(scale)
    ids = torch.randint(0, 2048, (128, 16), generator=torch.Generator().manual_seed(2))
    return TopP(lm, wide=wide, logits=logits).eval(), ids


@pytest.mark.parametrize("logits", [False, True], ids=["probabilities", "logits masked with -inf"])
def test_a_nucleus_that_moves_in_bf16_is_named_at_its_cumulative_sum_with_the_fix_checked(logits: bool) -> None:
    model, ids = _sampler(wide=False, logits=logits)
    result = fpdoctor.compare(model, ids, candidate="bf16")
    # -inf where fp64 has -inf is a mask, not an overflow: the error is finite and no NaN/Inf is claimed
    assert math.isfinite(result.rows[-1].propagated), str(result.report)
    assert not result.report.by_name("nonfinite-produced"), str(result.report)
    kept = result.report.data["kept"]
    assert kept["changed"] > 0.9 and kept["flips"] > 0.02 * kept["kept"], kept
    if logits:  # named by the layer that made them, not by the embedding table of the same height
        assert result.report.data["decisions"]["source"].startswith("logits of `lm.head`"), result.report.data
    assert result.report.verdict == "error", str(result.report)
    first = result.report.findings[0]
    assert first.name == "selection-changed" and first.evidence["op"] == "lt", str(result.report)
    assert first.evidence["location"].endswith(f":{SUM}"), first.evidence  # the line with the cumulative sum
    assert first.trial is not None and first.trial.tried, first.trial
    before, after = (float(str(v).split()[0]) for v in (first.trial.before, first.trial.after))
    assert after * 4 <= before, first.trial
    assert "a row" in first.fix and f"line {SUM} " in first.fix, first.fix


@pytest.mark.parametrize("logits", [False, True], ids=["probabilities", "logits masked with -inf"])
def test_the_nucleus_summed_in_fp32_is_ok_and_says_what_was_judged(logits: bool) -> None:
    model, ids = _sampler(wide=True, logits=logits)
    result = fpdoctor.compare(model, ids, candidate="bf16")
    assert result.report.verdict == "ok", str(result.report)
    kept = result.report.data["kept"]
    assert kept["flips"] < 0.01 * kept["kept"], kept
    assert any(label.startswith("kept entries") for label, _ in result.report.data["summary"]), str(result.report)


class _Decided(nn.Module):
    """A classifier that returns its decision as a one-hot row, or its attention-like weights over every
    class: rows summing to 1 that no filter made."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.body, self.head = kind, nn.Linear(64, 64), nn.Linear(64, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.head(torch.relu(self.body(x)))
        if self.kind == "onehot":
            return nn.functional.one_hot(z.argmax(-1), 1000).to(z.dtype)
        return z.softmax(-1)


@pytest.mark.parametrize("kind", ["onehot", "softmax"])
def test_rows_that_sum_to_one_without_a_filter_are_no_masked_output(kind: str) -> None:
    torch.manual_seed(0)
    result = fpdoctor.compare(_Decided(kind).eval(), torch.randn(2000, 64), candidate="bf16")
    assert "kept" not in result.report.data, result.report.data.get("kept")
    assert not [f for f in result.report.findings if f.severity == "error"], [
        (f.code, f.title) for f in result.report.findings
    ]


def nucleus(logits: torch.Tensor, p: float = 0.95) -> torch.Tensor:
    """A hand-written top-p filter in the logits' dtype, as generation code writes one."""
    probs = (logits / 0.7).softmax(-1)
    ranked, order = probs.sort(-1, descending=True)
    inside = ranked.cumsum(-1) - ranked < p
    ranked = ranked * inside
    return torch.zeros_like(probs).scatter(-1, order, ranked / ranked.sum(-1, keepdim=True))


NUCLEUS_SUM = next(
    n for n, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "inside = ranked.cumsum" in line
)


class Nucleus(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return nucleus(logits)


class EveryPosition(nn.Module):
    """An LM that returns the logits of every position, the sampler taking the last one after the head
    (`logits[:, -1]`), or a sampler module of its own called last."""

    def __init__(self, own_module: bool) -> None:
        super().__init__()
        self.lm = LM()
        self.filter = Nucleus() if own_module else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.lm.mix(self.lm.emb(ids))
        logits = self.lm.head(self.lm.norm(h)) * 3.0
        return self.filter(logits[:, -1]) if self.filter is not None else nucleus(logits[:, -1])


@pytest.mark.parametrize("where", ["after the last position", "a module of its own", "the filter alone"])
def test_a_filtered_distribution_is_judged_by_its_kept_sets_wherever_the_filter_runs(where: str) -> None:
    torch.manual_seed(11)
    ids = torch.randint(0, 2048, (128, 16), generator=torch.Generator().manual_seed(2))
    model: nn.Module = EveryPosition(own_module=where == "a module of its own").eval()
    inputs: torch.Tensor = ids
    if where == "the filter alone":  # given the logits it keeps a nucleus of: its output has their shape
        with torch.no_grad():
            inputs = model.lm.head(torch.randn(128, 128, generator=torch.Generator().manual_seed(3))) * 3.0
        model = Nucleus().eval()
    result = fpdoctor.compare(model, inputs, candidate="bf16")
    kept = result.report.data.get("kept")
    assert kept is not None and kept["flips"] > 0.02 * kept["kept"], str(result.report)
    assert result.report.verdict == "error", str(result.report)
    first = result.report.findings[0]
    assert first.name == "selection-changed" and first.evidence["location"].endswith(f":{NUCLEUS_SUM}"), str(
        result.report
    )
    assert first.trial is not None and first.trial.tried, first.trial
