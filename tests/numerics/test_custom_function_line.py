"""An op run inside a custom torch.autograd.Function's backward is the user's own code: trace names
its line in that backward, not the forward's line that the autograd node was made at. A softplus
whose backward writes the sigmoid as exp(x) / (1 + exp(x)) makes inf / inf = NaN in fp16 under
autocast, and every step is skipped; the fix names the exp's line, and applied there as printed
(its operand .float()), the run trains."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

SOFTPLUS = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
class Softplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.softplus(x)
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        e = torch.exp(x)
        return g * e / (1 + e)
class Act(nn.Module):
    def forward(self, x):
        return Softplus.apply(x)
X = torch.randn(2048, 32) * torch.linspace(1, 20, 32)
Y = (X[:, :4].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(32, 128), Act(), nn.Linear(128, 2))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(30):
    idx = torch.randint(0, 2048, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(X[idx]), Y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("SCALE", scaler.get_scale())
"""


def _trace(tmp_path: Path, script: Path) -> dict:
    return report_of(tmp_path, "trace", "--", str(script))


def test_an_op_in_a_custom_functions_backward_is_named_at_its_own_line_and_the_fix_there_works(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SOFTPLUS)
    lines = SOFTPLUS.splitlines()
    exp_line = next(n for n, text in enumerate(lines, 1) if "torch.exp(x)" in text)
    report = _trace(tmp_path, script)
    first = report["findings"][0]
    assert f"train.py:{exp_line} in backward" in first["message"], first["message"]
    assert f"train.py:{exp_line} in fp32" in first["fix"], first["fix"]
    script.write_text(SOFTPLUS.replace("e = torch.exp(x)", "e = torch.exp(x.float())"))
    fixed = _trace(tmp_path, script)
    assert not [f for f in fixed["findings"] if f["severity"] == "error"], [f["name"] for f in fixed["findings"]]
