"""A GradScaler that calibrates down at the start and settles: regression targets in the tens of
thousands make gradients past fp16's range at scale 1, so the scaler skips ~20 steps on its way to a
scale below 1 and then steps on every batch. The early findings (a replayed overflow, the scale
falling) were errors on a run that trained as it would in fp32; read again at the end they are the
scaler calibrating, said as information with the scale it settled at. A run whose scaler never
settles keeps them as errors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


def _train(steps: int) -> fpdoctor.ScriptWatch:
    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = x[:, :3].sum(1, keepdim=True) * 3000 + 20000  # targets in their own units
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    scaler = torch.amp.GradScaler("cpu")
    with fpdoctor.watch(reference_every=0) as w:
        for _ in range(steps):
            idx = torch.randint(0, 4096, (128,))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x[idx]).float(), y[idx])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return w


def test_a_scaler_that_settles_after_calibrating_down_is_no_error():
    report = _train(400).report
    assert report.findings and report.verdict == "ok", [(f.name, f.severity) for f in report.findings]
    assert all(f.title.startswith("Early in the run, then the scale settled at 0.125") for f in report.findings)
    assert "targets in large units" in report.findings[0].message


def test_early_scaler_findings_stay_errors_where_the_run_is_too_short_to_settle():
    report = _train(60).report
    assert report.verdict == "error", [(f.name, f.severity) for f in report.findings]


def test_a_nan_made_early_from_finite_values_is_no_calibration_however_the_scale_settles():
    """A distance by hand, sqrt of a sum of squares, whose first 20 batches pair items with themselves:
    sqrt's backward at 0 is NaN, the scaler skips those steps and its scale falls, then the run steps on
    every batch. A NaN made from finite values is a bug at any scale: the findings stay errors."""
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = torch.optim.Adam(enc.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with fpdoctor.watch(reference_every=0) as w:
        for step in range(260):
            a = torch.randn(64, 8)
            b = a.clone() if step < 20 else torch.randn(64, 8)  # the same items paired: distance 0
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                d = ((enc(a) - enc(b)).float() ** 2).sum(-1).sqrt()
                loss = (d - 1.0).pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert w.report.verdict == "error", [(f.name, f.severity) for f in w.report.findings]
    assert not any(f.title.startswith("Early in the run") for f in w.report.findings)
