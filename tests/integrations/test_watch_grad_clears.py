"""`fpdoctor watch` on a zero_grad() between the backward and the optimizer's step (TRN022): the
optimizer steps on no gradient, the loss is flat, and nothing is NaN or skipped. The finding names
the zero_grad() line; applied as printed (that line moved to where the step begins), the script
trains and is OK. Healthy orders get no finding: zero_grad before the forward, after the step,
a GAN's clear of the other network's gradients between a backward and a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import report_of

# a regression MLP; zero_grad of the optimizer (to None) or of the model (to zeros) after the backward
CLEARED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
first = None
for step in range(60):
    idx = torch.randint(0, 2048, (64,))
    loss = F.mse_loss(model(x[idx]), y[idx])
    loss.backward()
    CLEAR
    opt.step()
    first = first if first is not None else loss.item()
print(f"loss {first:.4f} -> {loss.item():.4f}")
"""

# a GAN-like loop: the generator's backward writes the discriminator's gradients too, which are cleared
# before the generator's step; each optimizer's own gradients are cleared before its backward
HEALTHY_GAN = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for step in range(40):
    real = torch.randn(64, 2) * 0.5 + 2.0
    fake = G(torch.randn(64, 8))
    opt_d.zero_grad()
    d_loss = bce(D(real), torch.ones(64, 1)) + bce(D(fake.detach()), torch.zeros(64, 1))
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = bce(D(fake), torch.ones(64, 1))
    g_loss.backward()
    D.zero_grad()  # the generator's backward wrote D's gradients: cleared, not G's
    opt_g.step()
"""


def _watch(tmp_path: Path, script: str) -> dict:
    path = tmp_path / "train.py"
    path.write_text(script)
    return report_of(tmp_path, "watch", "--", "python", str(path))


@pytest.mark.parametrize(
    ("clear", "gradients"), [("opt.zero_grad()", "None"), ("model.zero_grad(set_to_none=False)", "zero")]
)
def test_a_zero_grad_between_backward_and_step_is_named_and_its_fix_trains(tmp_path, clear, gradients):
    script = CLEARED.replace("CLEAR", clear)
    report = _watch(tmp_path, script)
    first = report["findings"][0]  # before: OK, no findings, on a run whose loss never moved
    assert first["name"] == "gradients-cleared", [f["name"] for f in report["findings"]]
    line = next(i for i, text in enumerate(script.splitlines(), 1) if text.strip() == clear)
    assert first["evidence"]["location"].endswith(f"train.py:{line}") and first["evidence"]["gradients"] == gradients
    assert first["evidence"]["occurrences"] == 60
    assert f"move line {line} of " in first["fix"] and "to where a step begins, before the forward" in first["fix"]
    # as printed: that line moved to where the step begins
    lines = script.splitlines()
    moved = lines[: line - 1] + lines[line:]
    begin = next(i for i, text in enumerate(moved) if "idx = torch.randint" in text)
    moved.insert(begin, "    " + clear)
    fixed = _watch(tmp_path, "\n".join(moved) + "\n")
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]


def test_the_usual_orders_get_no_gradients_cleared(tmp_path):
    after_step = CLEARED.replace("    CLEAR\n", "").replace("    opt.step()\n", "    opt.step()\n    opt.zero_grad()\n")
    for script in (after_step, HEALTHY_GAN):
        report = _watch(tmp_path, script)
        assert not [f for f in report["findings"] if f["name"] == "gradients-cleared"], report["findings"]
