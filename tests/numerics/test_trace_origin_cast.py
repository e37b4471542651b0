"""An fp16 exp that underflows to 0 ahead of the division it feeds (a Gaussian NLL's variance under
fp16 autocast): trace names the exp as the origin, checked with its lines in fp32, and says how to
put them in fp32: the operands cast, since an autocast-disabled region leaves a tensor already in
float16 as it is (applied so, the run fails as before)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.conftest import run_fpdoctor

SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
with torch.no_grad():
    net[2].bias[1] = -19.0  # log-variance of near noise-free targets
opt = torch.optim.SGD(net.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
x = torch.randn(64, 4)
y = x[:, :1] * 0.5
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        out = net(x)
    mu, logvar = out[:, :1], out[:, 1:]
    var = logvar.exp()
    loss = 0.5 * ((y - mu) ** 2 / var + logvar).mean()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_an_origin_upstream_in_fp16_is_fixed_by_casting_its_operands_not_by_autocast_off(tmp_path: Path) -> None:
    script = tmp_path / "nll.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    first = json.loads(report.read_text())["findings"][0]
    assert first["name"] == "nonfinite-produced" and "aten.exp" in first["fix"], first
    assert first["fix"].startswith("Change the origin, not the op that showed it: aten.exp.default at ")
    assert "cast the operands (.float()) and the result back: an autocast-disabled region alone leaves" in first["fix"]
    assert "already in float16" in first["fix"]
