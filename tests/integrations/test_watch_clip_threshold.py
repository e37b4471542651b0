"""`fpdoctor watch` on a clip whose max_norm is far below the gradients' norm (1e-3 typed for 1.0):
every update shrinks by that factor under SGD, nothing is NaN. With the GradScaler recipe done right
(unscale_ before the clip) the report blamed the loss scale and printed "call scaler.unscale_ before
clip_grad_norm_", which the script already did, with a check that assumed it; without a scaler it said
OK. The clip is named by its threshold; max_norm 1.0, and an adaptive optimizer (Adam divides the
factor out), are no finding."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import report_of

# a small CNN on synthetic images, SGD with momentum; the clip's threshold is MAX_NORM
SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(512, 1, 12, 12)
y = (x[:, 0, :6].mean((1, 2)) > 0).long()
model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(800, 2))
opt = OPTIMIZER
scaler = torch.amp.GradScaler("cpu", enabled=SCALED)
for step in range(40):
    idx = torch.randint(0, 512, (64,))
    with torch.autocast("cpu", dtype=torch.float16 if SCALED else torch.bfloat16):
        loss = F.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=MAX_NORM)
    scaler.step(opt)
    scaler.update()
"""
SGD = "torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)"


def _watch(tmp_path: Path, *, scaled: bool, max_norm: str, optimizer: str = SGD) -> dict:
    path = tmp_path / "train.py"
    script = SCRIPT.replace("OPTIMIZER", optimizer).replace("SCALED", str(scaled)).replace("MAX_NORM", max_norm)
    path.write_text(script)
    return report_of(tmp_path, "watch", "--", "python", str(path))


@pytest.mark.parametrize("scaled", [True, False], ids=["fp16-grad-scaler", "bf16"])
def test_a_clip_far_below_the_gradients_norm_is_named_by_its_threshold(tmp_path: Path, scaled: bool) -> None:
    report = _watch(tmp_path, scaled=scaled, max_norm="1e-3")
    first = report["findings"][0]
    assert first["name"] == "gradients-depart-from-reference" and first["evidence"]["stage"] == "optimizer"
    assert "a clip of their total norm" in first["message"] and "to 0.001" in first["message"], first["message"]
    assert first["fix"].startswith("Raise") and "max_norm" in first["fix"] and "unscale_" not in first["fix"]
    assert first["title"].startswith("The optimizer took gradients clipped"), first["title"]  # not "in fp32"
    assert first["fix_trial"]["status"] == "not-tried"  # the threshold is the script's: not claimed as checked
    fixed = _watch(tmp_path, scaled=scaled, max_norm="1.0")  # as printed
    assert not [f for f in fixed["findings"] if f["name"] == "gradients-depart-from-reference"], fixed["findings"]


def test_an_adaptive_optimizer_under_the_same_clip_is_no_finding(tmp_path: Path) -> None:
    report = _watch(tmp_path, scaled=True, max_norm="1e-3", optimizer="torch.optim.AdamW(model.parameters(), lr=1e-3)")
    assert not [f for f in report["findings"] if f["name"] == "gradients-depart-from-reference"], report["findings"]


def test_a_threshold_passed_by_name_is_raised_where_it_is_set(tmp_path: Path) -> None:
    """max_norm=args.max_grad_norm (a flag's default of 1e-3): the call is not where the value is set."""
    script = (
        SCRIPT.replace("OPTIMIZER", SGD)
        .replace("SCALED", "False")
        .replace("MAX_NORM", "args.max_grad_norm")
        .replace("    scaler.scale(loss).backward()\n    scaler.unscale_(opt)\n", "    loss.backward()\n")
        .replace("    scaler.step(opt)\n    scaler.update()\n", "    opt.step()\n")
    )
    path = tmp_path / "train.py"
    path.write_text("import argparse\nargs = argparse.Namespace(max_grad_norm=1e-3)\n" + script)
    first = report_of(tmp_path, "watch", "--", "python", str(path))["findings"][0]
    assert "the value of `args.max_grad_norm` there: raise it where it is set" in first["fix"], first["fix"]
