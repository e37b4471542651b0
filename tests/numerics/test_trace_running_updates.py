"""An in-place running update outside the optimizer that a low-precision tensor rounds away: an
EMA of the weights kept in bf16 (decay 0.998: each step's change is below half a bf16 spacing, and
the EMA model never leaves its first weights), a running statistic in fp16 with momentum 0.001
(lerp_). trace said OK on both; it now names the line (TRN010, a running update) with the share of
the exact update lost and the fix checked (an fp32 copy keeps it). An EMA in fp32, and a bf16
accumulator whose steps are large, are not named."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fpdoctor


def _train_with_ema(dtype: torch.dtype, decay: float = 0.998) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 1))
    ema = copy.deepcopy(model).to(dtype).requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with fpdoctor.Trace(model) as tr:
        for _ in range(4):
            x = torch.randn(32, 16)
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
                    pe.mul_(decay).add_(p.to(pe.dtype), alpha=1 - decay)  # the EMA update
    assert tr.report is not None
    return tr.report


EMA_LINE = _train_with_ema.__code__.co_firstlineno + 13


def test_an_ema_of_the_weights_kept_in_bf16_is_named_with_its_line_and_the_fix_checked() -> None:
    report = _train_with_ema(torch.bfloat16)
    (found,) = [f for f in report.findings if f.evidence.get("kind") == "running-update"]
    assert found.name == "update-rounded-away" and found.evidence["location"].endswith(f":{EMA_LINE}"), found
    assert min(found.evidence["lost"]) > 0.9, found.evidence
    assert "fp32" in found.fix
    assert found.trial is not None and found.trial.tried, found.trial
    assert report.verdict != "ok"


def test_an_ema_in_fp32_is_not_named() -> None:
    report = _train_with_ema(torch.float32)
    assert not [f for f in report.findings if f.evidence.get("kind") == "running-update"], str(report)


@pytest.mark.parametrize(("momentum", "named"), [(0.001, True), (0.5, False)])
def test_a_running_statistic_in_fp16_is_named_only_where_its_steps_round_away(momentum: float, named: bool) -> None:
    torch.manual_seed(0)
    stat = torch.full((256,), 3.0, dtype=torch.float16)
    with fpdoctor.Trace() as tr:
        for _ in range(4):
            batch_mean = (3.5 + 0.05 * torch.randn(256)).half()  # the batch means: near the running one
            stat.lerp_(batch_mean, momentum)  # the running mean a normalisation keeps
    assert tr.report is not None
    found = [f for f in tr.report.findings if f.evidence.get("kind") == "running-update"]
    assert bool(found) is named, str(tr.report)
