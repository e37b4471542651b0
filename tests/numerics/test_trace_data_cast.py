"""Data past fp16's range cast by the script (model.half(), then x.half() of readings in large units:
pressures in pascals, prices in dollars): the cast makes Inf, and the fix "compute the cast in fp32"
leaves a float16 model fitted to or reading values of that size, which overflows at the next op
(trial134: the targets kept in fp32, NaN at step 2). The fix is to bring the values into range before
the cast; trace says so, and says why keeping the cast wide alone is not the fix. Applied as printed
(standardised with the training set's statistics), the run trains."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


def _readings(rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    pressure = 101325.0 + 800.0 * torch.randn(rows, 4, generator=g)  # Pa: four stations
    rain = ((101325.0 - pressure.mean(1, keepdim=True)) / 800.0).clamp_min(0)  # mm, from the pressure drop
    return pressure, rain


def _train(standardise: bool, traced: bool = False):
    torch.manual_seed(0)
    x, y = _readings()
    mean, std = x.mean(), x.std()
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []
    trace = fpdoctor.Trace(model) if traced else None
    with trace if trace is not None else torch.enable_grad():
        for step in range(30):
            rows = slice(32 * (step % 8), 32 * (step % 8 + 1))
            xb = ((x[rows] - mean) / std).half() if standardise else x[rows].half()
            loss = ((model(xb).float() - y[rows]) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
    return losses, trace.report if trace is not None else None


def test_readings_past_fp16_cast_by_the_script_get_the_rescale_as_the_fix_and_it_trains() -> None:
    losses, report = _train(standardise=False, traced=True)
    assert not math.isfinite(losses[0]), losses[:3]  # the premise: Inf from the first step
    assert report is not None
    first = report.findings[0]
    assert first.name == "nonfinite-produced" and "_to_copy" in first.title, (first.title, str(report))
    assert first.fix.startswith("Bring the values cast at "), first.fix
    assert "Keeping the cast in fp32 alone is not the fix" in first.fix and "Standardise" in first.fix
    assert first.trial is not None and not first.trial.tried and "units" in first.trial.reason
    fixed, _ = _train(standardise=True)
    assert all(math.isfinite(v) for v in fixed) and fixed[-1] < 0.5 * fixed[0], fixed
