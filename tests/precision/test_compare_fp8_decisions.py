"""An fp8 candidate's decisions, judged against the format its output is returned in. fp8 GEMMs write
the model's dtype (bf16 or fp32), never fp8: rounding the exact logits to fp8 flips a fifth of the
top-1 classes of a peaked head, far more than any fp8 model does, and a floor that high called a
model that changed 1 in 10 of its decisions OK. Judged against the returned dtype, compare says the
decisions changed and plan, by top-1 (the default for fp8: the KL floor of a returned fp32 output is
~0), keeps what gives them back, verified. Two forms: a small LM (rowwise scaling), a classifier of
100 classes (tensorwise)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class LM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 96) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids)
        return self.head(self.norm(h + self.mix(h)))


class Classifier(nn.Module):
    def __init__(self, d: int = 64, classes: int = 100) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.head = nn.Linear(256, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _lm() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    model = LM().eval()
    with torch.no_grad():
        model.head.weight.mul_(4.0)  # peaked next-token distributions, as after training
    return model, torch.randint(0, 256, (8, 64))


def _classifier() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(2)
    model = Classifier().eval()
    with torch.no_grad():
        model.head.weight.mul_(3.0)
    return model, torch.randn(512, 64)


@pytest.mark.parametrize(("make", "candidate"), [(_lm, "fp8-e4m3-rowwise"), (_classifier, "fp8-e4m3")])
def test_fp8_decisions_are_judged_against_the_returned_dtype_and_the_plan_gives_them_back(make, candidate):
    model, x = make()
    report = fpdoctor.compare(model, x, candidate=candidate).report
    decisions = report.data["decisions"]
    assert decisions["floor_format"] == "fp32" and decisions["floor_top1"] == 1.0, decisions
    assert decisions["top1"] < 0.95, decisions
    changed = report.by_name("decisions-changed")
    assert changed and "fp32 (what" in changed[0].message, [f.name for f in report.findings]

    model, x = make()
    planned = fpdoctor.plan(model, x, candidate=candidate).plan
    assert planned.metric == "top1" and planned.verified and "head" in planned.keep_fp32, planned
    code = planned.to_code()
    namespace: dict = {}
    exec(compile(code, "plan", "exec"), namespace)  # the printed code runs, and names a set
    assert namespace["KEEP_HIGH_PRECISION"] == set(planned.keep_fp32)
