"""A classifier whose fp16 logits are NaN on most rows: BatchNorm channels whose variance collapsed in
training (exported as 1e-8, 0 in fp16) divide by sqrt(eps) and, two such layers deep, the values pass
fp16's max. compare names the second BatchNorm and says its output does not fit fp16 (not that the
flushed variance alone breaks it: with it the output fits no better), and its fix keeps what reads that
output in fp32 too; plan judges the logits by their KL by default (their relative error is no measure
when they are NaN) and its code, as printed, restores the decisions."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


def _collapsed() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(),
        nn.Linear(64, 10),
    ).eval()  # fmt: skip
    g = torch.Generator().manual_seed(2)
    for bn in (model[1], model[4]):
        bn.running_var.copy_(torch.rand(64, generator=g) + 0.5)
        bn.running_var[torch.randperm(64, generator=g)[:8]] = 1e-8
    return model, 20 * torch.randn(64, 16, generator=g)


def _top1(model: nn.Module, x: torch.Tensor, exact: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).float().argmax(-1) == exact.argmax(-1)).float().mean())


def test_nan_logits_from_an_output_past_the_range_get_a_kl_plan_that_restores_the_decisions() -> None:
    model, x = _collapsed()
    with torch.no_grad():
        exact = model.double()(x.double())
    first = fpdoctor.compare(_collapsed()[0], x, candidate="fp16").report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "4", first.title
    # its running_var's 1e-8 entries flush beside entries near 1 (negligible): its output's range is the cause
    assert "alone breaks it" not in first.message and "with its output left in fp32" in first.fix, first.fix
    result = fpdoctor.plan(_collapsed()[0], x, candidate="fp16")
    assert result.plan.verified and "4" in result.plan.keep_fp32, result.plan
    assert dict(result.report.data["summary"])["plan metric"].startswith("KL")
    plain = _collapsed()[0].half()
    fixed = _collapsed()[0]
    exec(result.plan.to_code(), {"model": fixed})  # as printed
    assert _top1(plain, x.half(), exact) < 0.5 and _top1(fixed, x, exact) > 0.97


def test_a_floor_below_the_inputs_own_rounding_is_not_called_ill_conditioned() -> None:
    """Judged by the relative error, the tolerance (16x the noise floor of logits past fp16's max) is below
    what rounding the inputs costs, 0.96x their own rounding: out of reach, yet no amplification."""
    result = fpdoctor.plan(_collapsed()[0], _collapsed()[1], candidate="fp16", metric="rel")
    floor = next(f for f in result.report.findings if f.evidence.get("kind") == "input-rounding")
    assert floor.evidence["floor_rel"] < floor.evidence["input_rounding_rel"]
    assert "ill-conditioned" not in floor.message and "off by about 0.0%" not in floor.message, floor.message
