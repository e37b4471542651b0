"""A flat window of a GradScaler run is put to the fp32 reference: the experiment's stand-in steps divide
the loss scale out of their gradients, as scaler.step() does (it said "not put to the reference: the
step ran through a GradScaler", and the run's OK covered a loss it had not judged). A run with nothing
to learn is flat in both arms: judged, and no finding; its losses are in the loss's units, not scaled."""

from __future__ import annotations

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(4096, 16)
y = torch.randn(4096, 1)  # nothing to learn: the loss is flat from the start
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(210):
    idx = torch.randint(0, 4096, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x[idx]).float(), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_a_flat_gradscaler_run_is_put_to_the_reference_in_the_losss_units(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert report["verdict"] == "ok", [f["name"] for f in report["findings"]]
    (judged,) = report["data"]["progress"]
    assert "not_tried" not in judged and judged["reference"] and judged["recipe"], judged
    assert 0.5 < judged["recipe"][0] < 2 and 0.5 < judged["reference"][0] < 2  # an MSE near 1, not 65536x it
