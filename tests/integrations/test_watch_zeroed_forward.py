"""`fpdoctor watch` on gradients that are 0 because the forward made their values 0: a hand-written
RMSNorm under fp16 autocast whose squares pass fp16's max (Inf, then rsqrt's 0), the loss scaled by a
GradScaler. The reference step finds every gradient 0 where fp32's are not; its fix said "scale the
loss (torch.amp.GradScaler) or raise the scale", which the script does and which changes nothing. A
loss already scaled rules out an underflow: the fix sends to `trace`, which names the op."""

from __future__ import annotations

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(16, 64), RMSNorm(64), nn.Linear(64, 2))
with torch.no_grad():
    model[0].weight.mul_(2000.0)  # a wide stream: its squares pass fp16's max
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    idx = torch.randint(0, 2048, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_gradients_the_forward_zeroed_under_a_scaled_loss_send_to_trace_not_to_the_scale(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    watched = report_of(tmp_path, "watch", "--", "python", str(path))
    first = watched["findings"][0]
    assert first["name"] == "gradients-depart-from-reference", [f["name"] for f in watched["findings"]]
    assert first["evidence"]["stage"] == "backward" and first["evidence"]["departed"][0]["zeros"] == 1
    assert "scale the loss" not in first["fix"] and first["fix"].startswith("Run `fpdoctor trace`"), first["fix"]
    # as printed: trace names the square that overflows and its fix
    traced = report_of(tmp_path, "trace", "--", str(path))
    names = [f["name"] for f in traced["findings"]]
    assert names[0] == "nonfinite-zeroed" and traced["findings"][0]["where"]["op"].startswith("aten.pow"), names
    # x.pow(2) on a line that also holds rsqrt: a large base's advice, not a negative power's zero
    assert "node of degree 0" not in traced["findings"][0]["fix"], traced["findings"][0]["fix"]


# a loss weighted 1e-9, fp16 autocast, the GradScaler at 65536: its gradients flush even scaled
TOO_SMALL = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 64)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
for step in range(12):
    idx = torch.randint(0, 2048, (256,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x[idx]).float(), y[idx]) * 1e-9
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""


def test_gradients_too_small_even_scaled_keep_the_advice_to_raise_the_scale(tmp_path):
    """The scaled reference gradients are below fp16's smallest normal: an underflow, and a larger scale
    is its fix (init_scale=2**40 makes the run OK)."""
    path = tmp_path / "train.py"
    path.write_text(TOO_SMALL)
    first = report_of(tmp_path, "watch", "--", "python", str(path))["findings"][0]
    assert first["name"] == "gradients-depart-from-reference" and "raise the scale" in first["fix"], first["fix"]
    path.write_text(TOO_SMALL.replace('GradScaler("cpu")', 'GradScaler("cpu", init_scale=2.0**40)'))
    assert report_of(tmp_path, "watch", "--", "python", str(path))["verdict"] == "ok"
