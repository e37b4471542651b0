"""plan judges an output as compare does, and never keeps less than compare's checked fix.

Three outputs a structural test of "a Linear from features to classes" misses or misjudges:
- scores against a class table (a cosine classifier over class embeddings, a learned scale): compare
  judges their decisions; plan --metric kl judges the same scores, where it refused them before;
- a Linear's logits divided by a temperature: compare judges their decisions (the same argmax);
- a regression head whose output's format is too coarse for it (a thermometer's kelvins, 290 +- 3,
  in bf16: spacing 2): compare's output-too-coarse keeps the head in fp32, returning fp32, checked;
  plan's target, set from that format's own floor, saw nothing and kept nothing. Now the plan starts
  from that layer, and applied as printed the error in the output's units falls as compare's check.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import fpdoctor


class _CosineHead(nn.Module):
    def __init__(self, vocab: int = 300, width: int = 64, classes: int = 700) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 48))
        self.classes = nn.Parameter(torch.randn(classes, 48))
        self.scale = nn.Parameter(torch.tensor(30.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = nn.functional.normalize(self.body(self.emb(ids)), dim=-1)
        return self.scale * h @ nn.functional.normalize(self.classes, dim=-1).T


class _Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.head = nn.Linear(128, 400)
        self.temperature = 0.37

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)) / self.temperature


class _Thermometer(nn.Module):
    """Sensor readings to kelvins: the head's bias carries the 290 K offset."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.head.weight.mul_(25.0)
            self.head.bias.fill_(290.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_plan_judges_scores_against_a_class_table_by_kl_as_compare_judges_their_decisions() -> None:
    torch.manual_seed(0)
    model, ids = _CosineHead().eval(), torch.randint(0, 300, (256, 12))
    compared = fpdoctor.compare(model, ids, candidate="bf16")
    assert "classes" in compared.report.data["decisions"]["source"], compared.report.data.get("decisions")
    planned = fpdoctor.plan(model, ids, candidate="bf16", metric="kl")  # refused before: "not logits"
    assert planned.plan.metric == "kl"
    assert "KL" in str(planned.report)
    # scores the model's own ops make past what bf16 holds: no module set fixes it, and "verified" says so
    # (where compare checked its own ops in fp32 as the fix, that finding is the fix: no module set either)
    coarse = planned.report.by_name("output-too-coarse")
    if coarse and not any(f.trial is not None and f.trial.tried for f in coarse):
        assert "the output's format itself is too coarse" in dict(planned.report.data["summary"])["verified"]


def test_compare_judges_a_linears_logits_divided_by_a_temperature_by_their_decisions() -> None:
    torch.manual_seed(0)
    model, x = _Tempered().eval(), torch.randn(256, 32)
    decided = fpdoctor.compare(model, x, candidate="bf16").report.data.get("decisions")
    assert decided is not None and decided["source"].startswith("logits of `head`"), decided
    assert "scaled by a constant" in decided["source"]
    assert fpdoctor.plan(model, x, candidate="bf16", metric="top1").plan.metric == "top1"


def test_plan_keeps_the_head_compare_checked_for_an_output_too_coarse_and_applied_its_error_falls() -> None:
    torch.manual_seed(0)
    model, x = _Thermometer().eval(), torch.randn(512, 6)
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        cast = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16)).double()
    before = float((cast - exact).abs().mean())
    (coarse,) = fpdoctor.compare(model, x, candidate="bf16").report.by_name("output-too-coarse")
    assert coarse.trial is not None and coarse.trial.tried and coarse.where["module"] == "head"
    planned = fpdoctor.plan(model, x, candidate="bf16")
    assert planned.plan.verified and planned.plan.keep_fp32 == ["head"], str(planned.report)
    applied = fpdoctor.apply_plan(copy.deepcopy(model), planned.plan)
    with torch.no_grad():
        out = applied(x)
    after = float((out.double() - exact).abs().mean())
    assert out.dtype == torch.float32  # the head returns fp32, as the plan's code says
    assert after * 4 <= before, (before, after)
