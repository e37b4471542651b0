"""A square root of a negative value in the branch a torch.where does not select (the "where trap": the
forward is finite, its gradient NaN): trace's title says the input is outside the op's domain, not
that the math overflows or divides by zero, and its fix (the clamp inside the branch) applies."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import run_fpdoctor

SCRIPT = """
import torch
from torch import nn

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x = torch.randn(64, 4)
y = x[:, :1].abs()
for step in range(20):
    pred = net(x)
    gap = pred - y
    loss = torch.where(gap > 0, gap.sqrt(), -gap).mean()  # a root penalty above, linear below
    opt.zero_grad()
    loss.backward()
    opt.step()
print(float(loss.detach()))
"""


def test_a_root_of_a_negative_value_is_named_outside_its_domain_and_its_clamp_applies(tmp_path: Path) -> None:
    script = tmp_path / "hinge.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    first = json.loads(report.read_text())["findings"][0]
    assert "aten.sqrt.default is non-finite in fp64 too: an input outside its domain" in first["title"], first
    assert first["fix"].startswith("clamp the argument at zero and add the format's eps (torch.sqrt(")
    # as printed, inside the branch
    fixed = tmp_path / "fixed.py"
    fixed.write_text(
        script.read_text().replace("gap.sqrt()", "torch.sqrt(gap.clamp_min(0) + torch.finfo(gap.dtype).eps)")
    )
    out = subprocess.run([sys.executable, str(fixed)], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() != "nan", out.stdout


def test_watch_names_the_where_trap_among_what_makes_a_finite_loss_gradient_nan(tmp_path: Path) -> None:
    script = tmp_path / "hinge.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = tmp_path / "report.json"
    run_fpdoctor("watch", "-o", str(report), "--", sys.executable, str(script))
    findings = json.loads(report.read_text())["findings"]
    replayed = next(f for f in findings if f["name"] == "deterministic-nonfinite")
    assert "a log or sqrt of a value out of its domain in a torch.where branch" in replayed["message"]
