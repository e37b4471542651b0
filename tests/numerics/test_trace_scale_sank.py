"""A GradScaler that skips now and then (a glitch in every third batch overflows fp16), never many
steps in a row, yet sinks its scale below 1: trace says the scale sank and by how much it shrinks
the gradients, not that the optimizer stopped running."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import run_fpdoctor

SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(60):
    x = torch.randn(32, 8)
    if step % 3 == 2:
        x[0, 0] = 7e4  # a sensor glitch: past fp16's range in the first layer
    y = x[:, :1].clamp(-3, 3)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = ((net(x) - y) ** 2).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_sparse_skips_that_sink_the_scale_are_told_as_a_sunk_scale(tmp_path: Path) -> None:
    script = tmp_path / "glitch.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    run_fpdoctor("trace", "-o", str(report), "--", str(script))
    stalled = next(f for f in json.loads(report.read_text())["findings"] if f["name"] == "grad-scaler-stalled")
    assert "and its scale sank to" in stalled["title"] and "-fold" in stalled["title"], stalled["title"]
    assert "the optimizer stopped running" not in stalled["title"]
    assert stalled["evidence"]["longest_skip_run"] == 1
