"""A plan under KL for logits whose format is the limit: an intent classifier over 400 intents whose
head adds a large shared offset to every score (60: softmax ignores it, bf16 holds scores there to
0.25), so rounding the exact output to bf16 alone flips a quarter of its decisions
(output-too-coarse). The KL floor of that format let a plan keep nothing and call it verified with
the decisions still flipped; the floor of logits kept wider (the head fed features rounded to bf16)
makes the plan keep the head, returning fp32, which holds the decisions, as `--metric top1` does."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _intents() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 96), nn.LayerNorm(96), nn.Linear(96, 400))
    with torch.no_grad():
        model[4].bias.add_(60.0)  # a large shared offset (softmax ignores it): bf16 holds scores near 60 to 0.25
    return model.eval(), torch.randn(256, 48)


def _top1(model: nn.Module, x: torch.Tensor, exact: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).float().argmax(-1) == exact.argmax(-1)).float().mean())


def test_a_kl_plan_keeps_the_head_whose_output_format_flips_the_decisions() -> None:
    model, x = _intents()
    with torch.no_grad():
        exact = model.double()(x.double())
    model, x = _intents()
    result = fpdoctor.plan(model, x, candidate="bf16", metric="kl")
    assert result.report.by_name("output-too-coarse"), [f.name for f in result.report.findings]
    assert result.plan.verified and result.plan.keep_fp32 == ["4"] and result.plan.fp32_outputs == ["4"]
    summary = dict(result.report.data["summary"])
    assert "logits kept wider" in summary["target"] and "too coarse" not in summary["verified"]
    plain = _intents()[0].to(torch.bfloat16)
    fixed = _intents()[0]
    exec(result.plan.to_code(), {"model": fixed})  # as printed
    assert _top1(plain, x.to(torch.bfloat16), exact) < 0.8 and _top1(fixed, x, exact) > 0.97  # 71% -> 98%
