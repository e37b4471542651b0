"""`fpdoctor watch` on gradient accumulation that unscales on every micro-batch (TRN021): the
GradScaler's calls in the wrong order make no NaN and skip nothing, yet the optimizer steps on the
last micro-batch alone. The finding is measured on a reference step, and its fix, applied as
printed (the lines it names moved out of the loop, or deleted), makes the script OK."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")

# a regression MLP with 3 micro-batches a step; the step inside the loop, on the last micro-batch
STEP_IN_LOOP = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(3072, 24)
y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(3072, 1)
model = nn.Sequential(nn.Linear(24, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU(), nn.Linear(128, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(24):
    for k in range(3):
        idx = torch.randint(0, 3072, (64,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x[idx]), y[idx]) / 3
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        if k == 2:
            scaler.step(opt)
        scaler.update()
    opt.zero_grad(set_to_none=True)
"""

# a classifier whose step is after the loop: the unscale_ and an update() in it, another update() after the step
STEP_AFTER_LOOP = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(1)
centers = torch.randn(8, 32) * 1.2
labels = torch.randint(0, 8, (4096,))
data = centers[labels] + torch.randn(4096, 32)
net = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 8))
optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
amp_scaler = torch.amp.GradScaler("cpu")


def train_step(chunks):
    for xb, yb in chunks:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(net(xb), yb) / len(chunks)
        amp_scaler.scale(loss).backward()
        amp_scaler.unscale_(optimizer)
        amp_scaler.update()
    amp_scaler.step(optimizer)
    amp_scaler.update()
    optimizer.zero_grad()


for step in range(24):
    idx = torch.randint(0, 4096, (3, 16))
    train_step([(data[i], labels[i]) for i in idx])
"""


def _watch(tmp_path: Path, script: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "watch", "-o", str(tmp_path / "report.json"), "--", "python", str(script)],
        check=False, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert run.returncode in (0, 1), run.stderr
    return json.loads((tmp_path / "report.json").read_text())


def _spans(text: str) -> list[tuple[int, int]]:
    """`line 5 (...)`, `lines 7-8 (...)` in a fix's text, in order."""
    return [(int(a), int(b or a)) for a, b in re.findall(r"lines? (\d+)(?:-(\d+))? \(`", text)]


def _apply(script: Path, fix: str) -> None:
    """The fix as printed: the lines it moves put after the loop it names, dedented to the loop's own
    level, in the order printed; the lines it deletes deleted."""
    lines = script.read_text().splitlines()
    moving, _, deleting = fix.partition(", and delete ")
    moving, _, loop_text = moving.partition(" out of the loop at ")
    loop = int(re.match(r"line (\d+)", loop_text).group(1))
    moved = _spans(moving.partition(" move ")[2])
    loop_indent = len(lines[loop - 1]) - len(lines[loop - 1].lstrip())
    end = loop  # the loop's last line: the last line after it indented deeper than the loop
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > loop_indent):
        end += 1
    block = []
    for a, b in moved:
        chunk = lines[a - 1 : b]
        strip = len(chunk[0]) - len(chunk[0].lstrip()) - loop_indent
        block += [line[strip:] for line in chunk]
    gone = {n for a, b in [*moved, *_spans(deleting)] for n in range(a, b + 1)}
    out = [line for n, line in enumerate(lines[:end], 1) if n not in gone] + block + lines[end:]
    script.write_text("\n".join(out) + "\n")


@pytest.mark.parametrize("case", ["step_in_loop", "step_after_loop"])
def test_unscaling_every_micro_batch_is_an_error_measured_on_a_reference_step_and_its_fix_works_as_printed(
    tmp_path, case
):
    source = {"step_in_loop": STEP_IN_LOOP, "step_after_loop": STEP_AFTER_LOOP}[case]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    report = _watch(tmp_path, script)
    first = report["findings"][0]
    assert first["name"] == "unscaled-then-accumulated" and first["severity"] == "error", [
        f["name"] for f in report["findings"]
    ]
    evidence = first["evidence"]
    assert evidence["step"] == 1 and evidence["unscale_calls"] == 3 and evidence["backwards_after_unscale"] == 2
    assert evidence["update_calls_before_step"] >= 2, evidence
    # measured: the optimizer's gradients point elsewhere than the fp32 step's; the sum unscaled once does not
    trial = first["fix_trial"]
    assert trial["status"] == "checked" and trial["before"] < 0.9 and trial["after"] > 0.99, trial
    fix = first["fix"]
    if case == "step_in_loop":
        assert "scaler.unscale_(opt)" in fix and "lines 19-20 (`if k == 2:` and what it holds)" in fix, fix
        assert "out of the loop at line 12 (`for k in range(3):`)" in fix and "delete" not in fix, fix
    else:  # the update() in the loop deleted: moved before the step it would reset the scaler's unscale_
        assert "amp_scaler.unscale_(optimizer)" in fix and "delete line 20 (`amp_scaler.update()`)" in fix, fix
        # the step after the loop unscales once more what the last unscale_ left: 1/65536 of the size
        assert evidence["norm_taken_over_fixed"] < 1e-3, evidence
    _apply(script, fix)
    fixed = _watch(tmp_path, script)
    assert fixed["verdict"] == "ok", [(f["name"], f["message"][:200]) for f in fixed["findings"]]
