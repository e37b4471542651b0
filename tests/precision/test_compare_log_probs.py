"""`compare` on a classifier that returns log-probabilities: a log-softmax written out after a temperature
(`logits - log(exp(logits).sum())`) or an nn.LogSoftmax last. Their relative error is read against values
the size of the log-sum-exp, so a candidate that changed the decided class on 1-8% of the rows was OK
(no decision was judged), and an nn.LogSoftmax's output was taken for probabilities (every row the same
argmax: 100% agreement, KL 0). Both are judged by their decisions, with the fix checked and applied as
printed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.plan.codegen import plan_code


class IntentClassifier(nn.Module):
    """Bag of tokens -> MLP -> 300 intents sharing a bias offset (the margins are below bf16's spacing)."""

    def __init__(self, module: bool) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(3000, 96, mode="mean")
        self.body = nn.Sequential(nn.Linear(96, 192), nn.GELU(), nn.Linear(192, 96), nn.LayerNorm(96))
        self.classify = nn.Linear(96, 300)
        self.log_softmax = nn.LogSoftmax(-1) if module else None
        with torch.no_grad():
            self.classify.bias.add_(6.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.classify(self.body(self.embed(tokens)))
        if self.log_softmax is not None:
            return self.log_softmax(logits)
        scaled = logits / 0.05  # a temperature
        return (
            scaled
            - torch.log(torch.exp(scaled - scaled.amax(-1, keepdim=True)).sum(-1, keepdim=True))
            - scaled.amax(-1, keepdim=True)
        )


def _top1(model: nn.Module, tokens: torch.Tensor, exact: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(tokens).argmax(-1) == exact.argmax(-1)).double().mean())


@pytest.mark.parametrize("module", [False, True], ids=["written out", "nn.LogSoftmax"])
def test_log_probabilities_are_judged_by_their_decisions_and_the_fix_works_as_printed(module: bool) -> None:
    torch.manual_seed(1)
    model, tokens = IntentClassifier(module).eval(), torch.randint(0, 3000, (1024, 12))
    result = fpdoctor.compare(model, tokens, candidate="bf16")
    decisions = result.report.data["decisions"]
    assert decisions["source"].startswith("log-probabilities of the logits of `classify`"), decisions
    assert decisions["top1"] < 0.97 and decisions["kl"] > 0, decisions
    first = result.report.findings[0]
    assert first.severity in ("error", "warning") and first.name in ("decisions-changed", "output-too-coarse")
    assert first.trial is not None and first.trial.tried, first.trial
    assert "`classify`" in first.fix and "fp32" in first.fix

    with torch.no_grad():
        exact = copy.deepcopy(model).double()(tokens)
    fixed = copy.deepcopy(model)
    exec(plan_code("bf16", ["classify"], ["classify"]), {"model": fixed})  # as printed: `classify` kept in fp32
    plain = copy.deepcopy(model).to(torch.bfloat16)
    assert _top1(plain, tokens, exact) < 0.97
    assert _top1(fixed, tokens, exact) > 0.985


class CosineHead(nn.Module):
    """Scores against a table of class prototypes (NormFace), scaled, then an nn.LogSoftmax."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(48, 96), nn.GELU())
        self.weight = nn.Parameter(torch.randn(120, 96))
        self.log_softmax = nn.LogSoftmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = nn.functional.normalize(self.body(x), dim=-1) @ nn.functional.normalize(self.weight, dim=-1).T
        return self.log_softmax(32.0 * scores)


def test_log_probabilities_of_scores_against_a_class_table_are_judged_by_their_decisions() -> None:
    """The leaf before the nn.LogSoftmax is the model's own ops (no Linear): no decision was judged."""
    torch.manual_seed(0)
    result = fpdoctor.compare(CosineHead().eval(), torch.randn(512, 48), candidate="bf16")
    decisions = result.report.data["decisions"]
    assert decisions["source"].startswith("log-probabilities of the scores of the model against its `weight`")
    assert decisions["classes"] == 120 and decisions["rows"] == 512, decisions
