"""A churn classifier under fp16 autocast with a GradScaler whose binary cross-entropy is written by
hand on the model's sigmoid: confident, p rounds to 1 in fp16, log(1 - p) is -inf, and 0 * -inf is
NaN. `fpdoctor watch` names the log first with F.binary_cross_entropy_with_logits in place of the
per-element expression (the reduction after it kept, so that the line still gives one loss); the NaN
made of that -inf takes the same fix, not one of its own that contradicts it; the replay's verdict
says the traced step named the op; the stall says how many of the run's steps were skipped, not only
its last episode's. Written as printed, the script trains."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
w = torch.randn(24, generator=g)
x = torch.randn(4096, 24, generator=g)
y = (x @ w > 0).float()
x = x + 0.6 * torch.sign(x @ w)[:, None] * w / w.norm()  # churners and stayers far apart
model = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 1))
opt = torch.optim.Adam(model.parameters(), lr=5e-2)
scaler = torch.amp.GradScaler("cpu")
for step in range(50):
    idx = torch.randint(0, 4096, (128,), generator=g)
    with torch.autocast("cpu", dtype=torch.float16):
        p = model(x[idx]).squeeze(-1).sigmoid()
        loss = -(y[idx] * p.log() + (1 - y[idx]) * (1 - p).log()).sum() / idx.numel()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("loss", loss.item())
"""
# the fix as printed: the logits, and the per-element form in place of the expression, its reduction kept
FIXED = SCRIPT.replace("p = model(x[idx]).squeeze(-1).sigmoid()", "z = model(x[idx]).squeeze(-1)").replace(
    "-(y[idx] * p.log() + (1 - y[idx]) * (1 - p).log()).sum()",
    "F.binary_cross_entropy_with_logits(z, y[idx], reduction='none').sum()",
)


def test_a_cross_entropy_by_hand_gets_one_fix_for_its_inf_and_its_nan_and_it_trains(tmp_path):
    script = tmp_path / "churn.py"
    script.write_text(SCRIPT)
    findings = report_of(tmp_path, "watch", "--", "python", str(script))["findings"]
    inf, nan = (f for f in findings if f["name"] == "nonfinite-produced")
    assert findings[0] is inf and inf["title"].startswith("first Inf"), [(f["code"], f["title"]) for f in findings]
    assert "binary_cross_entropy_with_logits(z, y, reduction='none') in place of the per-element" in inf["fix"]
    assert "(the reduction after it, .mean() or .sum(), stays as it is)" in inf["fix"], inf["fix"]
    # the check replaced the half that broke, said so beside a fix that names the whole form
    assert "(the half that broke here; the other half takes the same form)" in inf["fix_trial"]["changed"]
    assert nan["title"].startswith("first NaN") and nan["fix"].startswith("the first Inf's fix"), nan["fix"]
    assert nan["fix_trial"] == inf["fix_trial"] and inf["fix"] in nan["fix"]
    verdict = next(f for f in findings if f["name"] == "deterministic-nonfinite")
    assert "no op named" not in verdict["title"] and "named by the step traced at step" in verdict["title"]
    stall = next(f for f in findings if f["name"] == "training-stalled")
    said = re.search(r"(\d+) of the last (\d+) optimizer steps.*; (\d+) of the run's 50 steps", stall["message"])
    assert said and int(said[1]) < int(said[3]), stall["message"]  # the run's skips, beyond this episode's
    assert "which names no op in the model" in stall["message"], stall["message"]  # as the replay's verdict says
    fixed = tmp_path / "fixed.py"
    fixed.write_text(FIXED)
    out = subprocess.run([sys.executable, str(fixed)], capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.split()[-1]) < 0.05, out.stdout
