"""Scores whose argmax is the decision but that compare's test for logits does not take (a sum of
per-token log-probabilities over candidate continuations: the model's own ops make them, of the
candidates' count) were judged by their relative error only: bf16 changed the chosen candidate on a
fifth of the queries, with a warning and exit 0, and `plan --metric top1` refused them. Declared
(`decisions="argmax"`), they are judged by the decisions they make, and plan takes the metrics of logits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.report.model import Severity


class Chooser(nn.Module):
    """Picks one of 5 continuations of a prompt by the summed log-probability of its 8 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 48)
        self.body = nn.Sequential(nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 48))
        self.head = nn.Linear(48, 500, bias=False)
        with torch.no_grad():
            self.head.weight.mul_(6.0)

    def forward(self, prompt: torch.Tensor, options: torch.Tensor) -> torch.Tensor:
        b, c, n = options.shape
        context = self.embed(prompt).mean(1)[:, None, None].expand(b, c, n, -1)
        h = self.body(torch.cat([self.embed(options), context], -1))
        logp = torch.log(torch.softmax(self.head(h), -1))
        return logp.gather(-1, options.unsqueeze(-1)).squeeze(-1).sum(-1)  # [queries, options]


def _made() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 500, (96, 10), generator=g)
    options = torch.randint(0, 500, (96, 1, 8), generator=g).expand(96, 5, 8).clone()
    options[..., -2:] = torch.randint(0, 500, (96, 5, 2), generator=g)  # they differ at the end
    return Chooser().eval(), (prompt, options)


def test_declared_argmax_scores_are_judged_by_the_candidate_they_choose():
    model, inputs = _made()
    plain = fpdoctor.compare(model, inputs, candidate="bf16").report
    assert "decisions" not in plain.data  # not taken for logits on their own
    model, inputs = _made()
    declared = fpdoctor.compare(model, inputs, candidate="bf16", decisions="argmax").report
    decided = declared.data["decisions"]
    assert decided["source"].startswith("scores [96x5] decided by their argmax") and decided["top1"] < 0.95, decided
    assert declared.exit_code == 1 and any(f.severity is Severity.ERROR for f in declared.findings)
    model, inputs = _made()
    planned = fpdoctor.plan(model, inputs, candidate="bf16", metric="top1", decisions="argmax")  # was refused
    assert planned.plan.metric == "top1"
    with pytest.raises(ValueError, match="decisions must be 'argmax'"):
        fpdoctor.compare(model, inputs, candidate="bf16", decisions="max")


def test_a_regression_head_taken_for_logits_says_how_to_declare_it_and_none_judges_its_error_alone():
    """Four regression outputs from a Linear head, close to each other: compare's test takes them for class
    scores, whose argmax bf16 flips. The finding says so and how to say otherwise; declared
    (`decisions="none"`), the output is judged by its error alone, with no decisions."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).eval()
    with torch.no_grad():  # four forecasts of one quantity: rows of the head nearly equal
        model[2].weight.copy_(model[2].weight[:1] + 0.002 * torch.randn(4, 32))
        model[2].bias.fill_(0.1)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    guessed = fpdoctor.compare(model, x, candidate="bf16").report
    (coarse,) = guessed.by_name("output-too-coarse")  # their margins below bf16's spacing
    assert "is taken for class scores from its last layer" in coarse.message
    assert '`--decisions none` (decisions="none" in Python) judges it by its error alone' in coarse.message
    declared = fpdoctor.compare(model, x, candidate="bf16", decisions="none").report
    assert not declared.by_name("output-too-coarse") and "decisions" not in declared.data
    with pytest.raises(ValueError, match="or 'none'"):
        fpdoctor.compare(model, x, candidate="bf16", decisions="max")


def test_plan_takes_decisions_none_as_no_logits_and_refuses_their_metrics():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).eval()
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="is not logits"):
        fpdoctor.plan(model, x, candidate="bf16", metric="kl", decisions="none")
