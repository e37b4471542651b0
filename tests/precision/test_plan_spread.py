"""plan keeps a module only where its effect exceeds the run-to-run spread over the input sets."""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.plan import plan as planning
from fpdoctor.precision.plan.metric import Measured

BASE = [0.010, 0.021, 0.012, 0.018]  # the end-to-end error per input set with `a` alone in fp32
NOISE = [1.3, 0.7, 1.2, 0.8]  # what keeping `b` too multiplies it by: up on two sets, down on two


def _model_and_sets() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(a=nn.Linear(8, 8), b=nn.Linear(8, 8)))
    return model, [torch.randn(4, 8) for _ in BASE]


def _measured(sets: list[torch.Tensor]):
    def final_error(model, inputs, candidate, keep, **kwargs):
        if candidate != "fp16":
            return Measured(1e-4)  # the reference's own error, and the input rounding floor
        k = next(i for i, s in enumerate(sets) if s is inputs)
        if "a" not in keep:
            return Measured(1.0)
        return Measured(BASE[k] * (NOISE[k] if "b" in keep else 1.0))

    return final_error


def test_a_module_whose_effect_is_within_the_spread_is_not_kept(monkeypatch):
    model, sets = _model_and_sets()
    monkeypatch.setattr(planning, "_measured", _measured(sets))
    result = fpdoctor.plan(model, sets, candidate="fp16", tolerance=0.02)
    assert result.plan.verified and result.plan.keep_fp32 == ["a"]
    summary = dict(result.report.data["summary"])
    assert "noise, not an effect" in summary["why not `b`"]
    assert "beyond their run-to-run spread" in summary["why `a`"]


def test_one_input_set_says_the_spread_is_not_measured(monkeypatch):
    model, sets = _model_and_sets()
    monkeypatch.setattr(planning, "_measured", _measured(sets))
    result = fpdoctor.plan(model, sets[1], candidate="fp16", tolerance=0.02)
    assert sorted(result.plan.keep_fp32) == ["a", "b"]
    summary = dict(result.report.data["summary"])
    assert all("the evidence is one input set" in summary[f"why `{m}`"] for m in ("a", "b"))
