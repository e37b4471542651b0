"""`fpdoctor watch` on a loss scale written by hand (`(loss * 1024).backward()`, no GradScaler) that
the script never divides out of the gradients (TRN036): the reference step divides the scale out of
both runs, so the backward agrees with fp32 and the gradients the optimizer took are 1024x the
reference's. The finding is first, its fix applied as printed makes the script train as fp32 does,
and a scale the script does divide out (or one Adam divides out by itself) is no finding."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fpdoctor.numerics.training import loss_factors
from tests.conftest import report_of

# pure fp16 classifier, SGD with momentum, the loss multiplied by 1024 before its backward
SCALED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
centers = torch.randn(10, 32) * 0.4
labels = torch.randint(0, 10, (2048,))
feats = centers[labels] + torch.randn(2048, 32)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)).half()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
LOSS_SCALE = 1024.0
for step in range(12):
    idx = torch.randint(0, 2048, (128,))
    loss = F.cross_entropy(model(feats[idx].half()).float(), labels[idx])
    opt.zero_grad()
    (loss * LOSS_SCALE).backward()
    opt.step()
print(f"final loss {loss.item():.4f}")
"""

# bf16 autocast, two micro-batches a step, each `loss / 2 * 65536`; the weights' gradients divided back by a
# loop that forgets the biases
MISSED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(3)
x = torch.randn(1024, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
SCALE = 2.0**16
for step in range(10):
    for k in range(2):
        idx = torch.randint(0, 1024, (64,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(net(x[idx]).float(), y[idx])
        (loss / 2 * SCALE).backward()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("weight"):
                p.grad /= SCALE
    optimizer.step()
    optimizer.zero_grad()
"""

# fp16 autocast with a GradScaler, 4 micro-batches a step, the loss divided by 4 in its function and again at the
# backward; an unscale_ and a clip (that does not bind) between the backward and the step
TWICE = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(1)
ACCUM = 4
x = torch.randn(4096, 32)
y = (x @ torch.randn(32, 6)).argmax(1)
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 6))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")


def compute_loss(xb, yb):
    with torch.autocast("cpu", dtype=torch.float16):
        return F.cross_entropy(model(xb), yb) / ACCUM


for step in range(12):
    for k in range(ACCUM):
        idx = torch.randint(0, 4096, (32,))
        loss = compute_loss(x[idx], y[idx])
        scaler.scale(loss / ACCUM).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
print(f"final loss {loss.item() * ACCUM:.4f}")
"""


def _watch(tmp_path: Path, source: str, name: str = "train") -> tuple[Path, dict]:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(source))
    return script, report_of(tmp_path, "watch", "--", "python", str(script))


def _first(report: dict) -> dict:
    return report["findings"][0]


def _final_loss(script: Path) -> float:
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True)
    return float(re.search(r"final loss (\S+)", out.stdout).group(1))


def test_a_loss_scale_never_divided_out_is_first_and_its_printed_fix_trains_as_fp16_unscaled(tmp_path):
    script, report = _watch(tmp_path, SCALED)
    first = _first(report)
    assert first["name"] == "loss-scale-not-undone" and first["severity"] == "error"
    assert first["where"]["step"] == 1
    ev = first["evidence"]
    assert ev["scale"] == 1024 and ev["still_scaled_count"] == ev["compared"] == 4
    assert ev["location"].endswith("train.py:16")
    # the update as taken is ~1024x the reference's; divided, it is the reference's
    upd = ev["update_to_weight"]
    assert upd["as_taken"] > 300 * upd["reference"] and upd["divided"] == pytest.approx(upd["reference"], rel=0.05)
    trial = first["fix_trial"]
    assert trial["status"] == "checked" and trial["before"] == 4 and trial["after"] == 0
    fix = first["fix"]
    assert "just before the optimizer's step (line 17 of train.py: `opt.step()`)" in fix
    code = re.search(r"`(for p in \[p for g in opt\.param_groups .*?: p\.grad\.div_\(1024\))`", fix).group(1)
    assert "GradScaler" not in fix  # fp16 weights: GradScaler's unscale_ refuses their gradients
    # applied as printed: the line before the step, at its indentation
    fixed = SCALED.replace("    opt.step()\n", f"    {code}\n    opt.step()\n")
    fixed_script, after = _watch(tmp_path, fixed, "fixed")
    assert not [f for f in after["findings"] if f["name"] == "loss-scale-not-undone"]
    reference = SCALED.replace("    (loss * LOSS_SCALE).backward()\n", "    loss.backward()\n")
    ref_script = tmp_path / "fp16_unscaled.py"
    ref_script.write_text(textwrap.dedent(reference))
    assert not torch.isfinite(torch.tensor(_final_loss(script)))  # the scaled run blows up
    assert _final_loss(fixed_script) == pytest.approx(_final_loss(ref_script), rel=1e-3)


def test_a_division_that_misses_the_biases_names_them(tmp_path):
    _, report = _watch(tmp_path, MISSED)
    first = _first(report)
    assert first["name"] == "loss-scale-not-undone"
    ev = first["evidence"]
    assert ev["scale"] == 65536 and sorted(ev["still_scaled"]) == ["0.bias", "2.bias", "4.bias"]
    assert ev["compared"] == 6
    assert "misses `0.bias`, `2.bias`, `4.bias`" in first["fix"] and "in place of its division" in first["fix"]
    assert first["fix_trial"]["before"] >= 1 and first["fix_trial"]["after"] == 0
    # the NaN steps the blown-up weights make later follow it, with its fix and its trial
    followers = [f for f in report["findings"][1:] if f["name"] in ("nonfinite-produced", "deterministic-nonfinite")]
    assert followers and all(f["fix"].startswith("As loss-scale-not-undone says") for f in followers), followers
    assert "`for p in [p for g in optimizer.param_groups" in first["fix"]  # the optimizer as the script names it


@pytest.mark.parametrize(
    "change",
    [
        # the scale divided out by the script before the step
        ("    opt.step()\n", "    for p in model.parameters():\n        p.grad.div_(LOSS_SCALE)\n    opt.step()\n"),
        # fp32 weights under Adam, which divides the factor out by itself: its update agrees with the reference's
        (
            ".half()\nopt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
            "\nopt = torch.optim.Adam(model.parameters(), lr=1e-3)",
        ),
        # a loss weight is no loss scale
        ("LOSS_SCALE = 1024.0", "LOSS_SCALE = 10.0"),
        # fp16 weights under Adam, whose eps is 0 in fp16: its update fails on the reference's gradients too, and
        # dividing the scale out does not bring it back (fp16-adam-eps is the cause)
        ("torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)", "torch.optim.Adam(model.parameters(), lr=1e-3)"),
        # a learning rate divided by the scale: the updates are of the size meant
        ("lr=0.05, momentum=0.9)", "lr=0.05 / 1024, momentum=0.9)"),
        # a summed loss written as the mean times the batch size (a power of two), with a learning rate for it
        ("LOSS_SCALE = 1024.0", "LOSS_SCALE = 1024.0\nopt.param_groups[0]['lr'] = 2e-4"),
    ],
    ids=["divided", "adam", "weight", "adam-fp16", "lr-compensated", "summed"],
)
def test_no_finding_where_the_scale_is_divided_out_or_is_no_scale(tmp_path, change):
    old, new = change
    assert old in SCALED
    changed = SCALED.replace(old, new)
    if "2e-4" in new:
        changed = changed.replace("    (loss * LOSS_SCALE).backward()", "    (loss * idx.shape[0]).backward()")
    _, report = _watch(
        tmp_path, changed if ".half()\n" in changed else changed.replace("feats[idx].half()", "feats[idx]")
    )
    assert not [f for f in report["findings"] if f["name"] == "loss-scale-not-undone"]
    assert 1 in report["data"]["reference_step"]["compared_steps"]  # judged, not skipped


def test_the_factors_are_read_from_the_backwards_root():
    w = torch.ones(4, requires_grad=True)
    loss = (w * w).sum()
    other = (w * 2).sum()
    of, F = loss_factors.of_root, loss_factors.Factors
    assert of(loss * 1024) == F(1024.0, ())
    assert of(loss * 1024 / 4) == F(1024.0, (4.0,))  # an accumulation's division beside it
    assert of(loss / 4 * 2.0**16) == F(2.0**16, (4.0,))
    assert of(loss / 8 / 8) == F(None, (8.0, 8.0))
    assert of(loss * 0.25) == F(None, (4.0,))
    assert of((loss + other) / 2 / 2) == F(None, (2.0,))  # the mean of two losses is no division of its own
    assert of(loss * 10) is None and of(loss * 64) is None  # a loss weight; below 128
    assert of(loss) is None
    assert of(loss * w.sum()) is None  # a product with a value that has a gradient


def test_a_step_says_a_scale_where_every_backward_has_it_and_twice_where_each_divides_by_k_squared():
    at = ("train.py", 9, "loss.backward()")
    F, of = loss_factors.Factors, loss_factors.of_step
    scaled, twice = F(1024.0, ()), F(None, (4.0, 4.0))
    assert of([(scaled, at)], scaler=False) == loss_factors.StepFactors(1024.0, None, at)
    assert of([(scaled, at)], scaler=True) is None  # a GradScaler's own multiplier
    assert of([(scaled, at), (None, None)], scaler=False) is None
    assert of([(twice, at)] * 4, scaler=False) == loss_factors.StepFactors(None, 4, at)
    assert of([(twice, at)] * 2, scaler=False) is None  # two divisions by 4 with 2 micro-batches
    assert of([(F(None, (16.0,)), at)] * 4, scaler=False) is None  # one division by 16: a sum normalised by hand
    assert of([(F(None, (4.0,)), at)] * 4, scaler=False) is None  # the mean


def test_a_loss_divided_by_the_micro_batch_count_twice_is_named_and_its_fix_as_printed_steps_as_the_mean(tmp_path):
    _, report = _watch(tmp_path, TWICE)
    first = _first(report)
    assert first["name"] == "loss-divided-twice" and first["where"]["step"] == 1
    ev = first["evidence"]
    assert ev["micro_batches"] == 4 and ev["divisor"] == 16 and ev["location"].endswith("train.py:23")
    upd = ev["update_to_weight"]
    assert upd["divided_once"] == pytest.approx(4 * upd["as_taken"], rel=0.05)  # SGD at its first step
    assert first["fix_trial"]["status"] == "checked"
    assert "Divide the loss by 4 once: it reaches the backward at line 23 of train.py divided by 16" in first["fix"]
    # as printed: one of the two divisions dropped (the loop's); the same loop written with the mean is OK
    fixed = TWICE.replace("scaler.scale(loss / ACCUM).backward()", "scaler.scale(loss).backward()")
    _, after = _watch(tmp_path, fixed, "fixed")
    assert not [f for f in after["findings"] if f["name"] == "loss-divided-twice"]


@pytest.mark.parametrize(
    "change",
    [
        # Adam divides the factor out by itself
        ("torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)", "torch.optim.Adam(model.parameters(), 1e-3)"),
        # a clip that binds sets the gradients' size whatever the loss's factor
        ("clip_grad_norm_(model.parameters(), 100.0)", "clip_grad_norm_(model.parameters(), 1e-3)"),
    ],
    ids=["adam", "clip-binds"],
)
def test_no_divided_twice_finding_where_the_update_does_not_follow_the_factor(tmp_path, change):
    old, new = change
    assert old in TWICE
    _, report = _watch(tmp_path, TWICE.replace(old, new))
    assert not [f for f in report["findings"] if f["name"] == "loss-divided-twice"]


# a pure fp16 CNN, SGD with Nesterov momentum and weight decay, two micro-batches a step each divided by 2 and
# scaled by 4096: the division goes after the last backward, where a division after each one would divide the
# first micro-batch's gradients twice
ACCUMULATED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(512, 3, 16, 16)
y = (x.mean((1, 2, 3)) > 0).long() + 2 * (x[:, 0].mean((1, 2)) > 0).long()
net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                    nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4)).half()
sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
SCALE = 2 ** 12
for step in range(10):
    for k in range(2):
        idx = torch.randint(0, 512, (32,))
        loss = F.cross_entropy(net(x[idx].half()).float(), y[idx]) / 2
        (loss * SCALE).backward()
    sgd.step()
    sgd.zero_grad()
print(f"final loss {loss.item():.6f}")
"""


def test_with_micro_batches_the_printed_division_goes_before_the_step_and_trains_as_unscaled(tmp_path):
    script, report = _watch(tmp_path, ACCUMULATED)
    first = _first(report)
    assert first["name"] == "loss-scale-not-undone" and first["evidence"]["scale"] == 4096
    code = re.search(r"`(for p in \[p for g in sgd\.param_groups .*?: p\.grad\.div_\(4096\))`", first["fix"]).group(1)
    assert "just before the optimizer's step (line 17 of train.py: `sgd.step()`)" in first["fix"], first["fix"]
    fixed = tmp_path / "fixed.py"
    fixed.write_text(textwrap.dedent(ACCUMULATED.replace("    sgd.step()\n", f"    {code}\n    sgd.step()\n")))
    unscaled = tmp_path / "unscaled.py"
    unscaled.write_text(textwrap.dedent(ACCUMULATED.replace("(loss * SCALE).backward()", "loss.backward()")))
    assert not torch.isfinite(torch.tensor(_final_loss(script)))
    assert _final_loss(fixed) == pytest.approx(_final_loss(unscaled), rel=1e-3)
