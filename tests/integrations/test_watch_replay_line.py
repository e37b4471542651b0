"""A replay names the line where the step's forward ran: an nn.Sequential's ops have no line of the
user's inside the model, and the replay, decided at the optimizer's step, runs under that step's line
(`scaler.step(opt)`). The findings name the forward's line (`model(x)`), where the fix goes."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

# fp16 autocast on the CPU with a GradScaler; one raw feature near 4e4 in a few rows: the cast of the
# first layer's input overflows at the forward's line, every step
SCRIPT = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")


def batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g)
    x[:, 3] = 40000.0 + 15000.0 * x[:, 3]
    return x, y


for step in range(6):
    x, y = batch(step)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x), y)  # FORWARD
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)  # STEP
    scaler.update()
"""


def test_the_replayed_ops_of_a_sequential_are_at_the_forwards_line_not_the_steps(tmp_path: Path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    lines = SCRIPT.splitlines()
    forward = next(i for i, line in enumerate(lines, 1) if line.endswith("# FORWARD"))
    step = next(i for i, line in enumerate(lines, 1) if line.endswith("# STEP"))
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    replayed = next(f for f in report["findings"] if f["name"] == "deterministic-nonfinite")
    assert f"train.py:{forward} in" in replayed["evidence"]["location"]
    assert f"train.py:{forward}" in replayed["fix"]
    said = " ".join(f["message"] + f["fix"] for f in report["findings"])
    assert f"train.py:{step}" not in said
