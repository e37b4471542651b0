"""`fpdoctor watch` on a GradScaler made inside the step function (TRN029): each step starts at the
init scale and the scaler that would have halved it is thrown away, so most steps are skipped and
the scale reads its init value at every step. The findings blamed the model (an overflow no scale
cures, a scale 'collapsing' that never moved); the scaler made anew is named first, and the fix as
printed (one scaler, before the loop) trains with few skips and no such finding."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F

def train_step(model, opt, x, y):
    SCALER_IN_STEP
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x), y, reduction="sum")  # summed over the batch: large gradients
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()

torch.manual_seed(0)
x = torch.randn(512, 12)
y = x[:, :3].sum(1, keepdim=True) * 40
model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
SCALER_ONCE
for step in range(40):
    idx = torch.randint(0, 512, (128,))
    train_step(model, opt, x[idx], y[idx])
"""
MADE = 'scaler = torch.amp.GradScaler("cpu")'


def _watch(tmp_path: Path, in_step: bool) -> dict:
    path = tmp_path / "train.py"
    once = "" if in_step else MADE
    script = SCRIPT.replace("SCALER_IN_STEP", MADE if in_step else "global scaler").replace("SCALER_ONCE", once)
    path.write_text(script)
    return report_of(tmp_path, "watch", "--", "python", str(path))


def test_a_scaler_made_in_the_step_is_named_first_and_one_made_once_is_no_finding(tmp_path: Path) -> None:
    report = _watch(tmp_path, in_step=True)
    first = report["findings"][0]
    assert first["name"] == "grad-scaler-rebuilt", [f["name"] for f in report["findings"]]
    assert first["evidence"]["scalers"] == first["evidence"]["steps"] == 40
    assert first["evidence"]["skipped_steps"] >= 30 and first["evidence"]["init_scale"] == 65536.0
    fixed = _watch(tmp_path, in_step=False)  # as printed: one scaler, made before the loop
    assert not [f for f in fixed["findings"] if f["name"] == "grad-scaler-rebuilt"], fixed["findings"]
    assert fixed["data"]["amp"]["skipped_steps"] < 20, fixed["data"]["amp"]


def test_trace_of_a_scaler_made_in_the_step_leads_its_fix_with_the_scale_that_never_came_down(tmp_path: Path) -> None:
    """Under `trace` the skipped steps' overflow was said to be "non-finite at every scale it tried (65536)",
    one scale; the fix leads with the scaler that never lowered it."""
    from tests.conftest import traced_script

    script = SCRIPT.replace("SCALER_IN_STEP", MADE).replace("SCALER_ONCE", "").replace("range(40)", "range(12)")
    _, found = traced_script(tmp_path, "train", script)
    stalled = next(f for f in found if f["name"] == "grad-scaler-stalled")
    assert stalled["fix"].startswith("The scale stayed at 65536 over all 12 steps"), stalled["fix"][:300]
    assert "a GradScaler made anew each step" in stalled["fix"]
