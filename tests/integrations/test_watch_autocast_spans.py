"""`fpdoctor watch` on an autocast block left open across optimizer steps (TRN030): autocast casts each fp32
weight once per block, so a `with torch.autocast(...)` around the training loop runs every forward on the
weights of its first; the loss stays where it was and nothing is NaN. It was OK (or a flat loss with no
cause). The block is named by its line and the outputs' distance from the weights as they are; the fix as
printed (the block around the forward and the loss only) trains and is no finding, and so is a block that
ends every step with the backward and the step inside it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_fpdoctor

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)
images = torch.randn(512, 3, 8, 8)
labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 1].mean((1, 2)) > 0).long()
model = nn.Sequential(
    nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4),
)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
SETUP

def evaluate():
    with torch.no_grad():
        return F.cross_entropy(model(images), labels).item()

DECO
def fit(epochs):
    for epoch in range(epochs):
        for i in range(0, 512, 64):
            x, y = images[i:i + 64], labels[i:i + 64]
BODY

print(f"eval loss before {evaluate():.4f}")
OUTER
print(f"eval loss after {evaluate():.4f}")
"""
PLAIN = """\
            loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()"""
PER_STEP = """\
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()"""
AS_PRINTED = """\
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            loss.backward()
            opt.step()"""
SPANNING = 'with torch.autocast("cpu", dtype=torch.bfloat16):\n    fit(5)'
WARMED = PLAIN + "\n            sched.step()"  # the first step moves no weight: the cache is read all the same
IN_PLACE = PER_STEP.replace(
    "loss = F.cross_entropy(model(x).float(), y)",
    "out = model(x)\n                out /= 2.0\n                loss = F.cross_entropy(out.float(), y)",
)
WARM_UP = "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 20))  # lr 0 at the first step"
DECORATOR = '@torch.autocast("cpu", dtype=torch.bfloat16)'
CASES = {
    "spanning": (PLAIN, SPANNING, "", ""),
    "decorated": (PLAIN, "fit(5)", DECORATOR, ""),
    "warmed up from 0": (WARMED, SPANNING, "", WARM_UP),
    # a block per forward inside an outer autocast(enabled=False) around the loop: the cache lives as long
    # as the outermost block, and torch clears it only when that one exits
    "inside a disabled block": (AS_PRINTED, SPANNING.replace("dtype=torch.bfloat16", "enabled=False"), "", ""),
    "an output written in place": (IN_PLACE, "fit(5)", "", ""),
    "as printed": (AS_PRINTED, "fit(5)", "", ""),
    "a block per step": (PER_STEP, "fit(5)", "", ""),
    "cache off": (PLAIN, SPANNING.replace("bfloat16)", "bfloat16, cache_enabled=False)"), "", ""),
}


def _script(case: str) -> str:
    body, outer, decorator, setup = CASES[case]
    return SCRIPT.replace("BODY", body).replace("OUTER", outer).replace("DECO", decorator).replace("SETUP", setup)


def _watch(tmp_path: Path, case: str) -> tuple[dict, float, float]:
    """The report and the script's eval loss before and after training."""
    path = tmp_path / "train.py"
    path.write_text(_script(case))
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", "python", str(path))
    assert result.code in (0, 1), result.err
    found = dict(re.findall(r"eval loss (before|after) ([0-9.]+)", result.out))
    return json.loads(report.read_text()), float(found["before"]), float(found["after"])


@pytest.mark.parametrize("case", ["spanning", "decorated", "warmed up from 0", "inside a disabled block"])
def test_a_block_around_the_training_loop_is_named_by_its_line_first(tmp_path: Path, case: str) -> None:
    report, before, after = _watch(tmp_path, case)
    assert after > 0.95 * before, (before, after)  # the symptom: 5 epochs of Adam barely move the eval loss
    first = report["findings"][0]
    assert first["name"] == "autocast-spans-steps", [f["name"] for f in report["findings"]]
    assert report["verdict"] != "ok"
    body, outer, decorator, _ = CASES[case]
    text = _script(case)
    opened = decorator or (SPANNING.splitlines()[0] if outer == SPANNING else body.splitlines()[0].strip())
    line = 1 + [row.strip() for row in text.splitlines()].index(opened)
    assert first["where"]["line"].endswith(f"train.py:{line}"), first["where"]
    assert 'torch.autocast("cpu", dtype=torch.bfloat16)' in first["message"]
    assert ("off its function" in first["fix"]) == bool(decorator), first["fix"]
    assert first["evidence"]["outputs_relative_difference"] > 0.01, first["evidence"]
    assert first["fix_trial"]["status"] == "checked", first["fix_trial"]


@pytest.mark.parametrize("case", ["as printed", "a block per step", "cache off", "an output written in place"])
def test_a_block_that_ends_every_step_or_casts_afresh_is_no_finding(tmp_path: Path, case: str) -> None:
    report, before, after = _watch(tmp_path, case)
    assert after < 0.8 * before, (before, after)
    assert not [f for f in report["findings"] if f["name"] == "autocast-spans-steps"], report["findings"]
