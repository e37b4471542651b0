"""A learning rate too high, met after a change of precision: the loss climbs, the weights grow
step after step, and the first op to overflow is in fp16 or bf16. The cause is the rate, not the
format: `trace` names the updates that grew the weights (over several steps, steps counted as the
training log counts them, a GradScaler's skipped steps too) ahead of the overflow, whose own fix
becomes the rate's; `watch` says the same at the replayed step and tries lower rates from the
climb, where a GradScaler's skipped first step kept no state. Two classes of recipe: SGD with
momentum under fp16 autocast and a GradScaler (a transformer LM), and SGD with Nesterov under bf16
autocast without one (a regression MLP). Each printed rate, applied as printed, trains."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.trace.recipes import BLOWUP_STEPS, _blowup
from tests.conftest import run_fpdoctor, run_python

LM = """
import sys
import torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
torch.manual_seed(0)
V, D, T = 256, 64, 32
class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        layer = nn.TransformerEncoderLayer(D, 4, 4 * D, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(D, V)
    def forward(self, x):
        return self.head(self.enc(self.emb(x)))
model = LM()
opt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[1]), momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
data = torch.randint(0, V, (64, T + 1))
losses, largest = [], []  # the largest weight after each step, up to the first non-finite loss
for step in range(STEPS):
    i = (step * 8) % 56
    x, y = data[i:i + 8, :-1], data[i:i + 8, 1:]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
    if torch.isfinite(loss) and len(losses) == len([v for v in losses if v == v and abs(v) != float("inf")]):
        largest.append(max(float(p.detach().abs().max()) for p in model.parameters()))
print("LOSSES", losses[0], losses[-1])
print("GROWTH", largest[-1] / largest[0] if largest else 0.0)
"""

REGRESSION = """
import sys
import torch, torch.nn as nn
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(512, 8)
y = (x @ torch.randn(8, 1)) * 3 + 0.5 * torch.randn(512, 1)
model = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=float(sys.argv[1]), momentum=0.9, nesterov=True)
losses = []
for step in range(STEPS):
    i = (step * 64) % 512
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pred = model(x[i:i + 64])
    loss = ((pred.float() - y[i:i + 64]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if not torch.isfinite(loss):
        break
print("LOSSES", losses[0], losses[-1])
"""


# the two recipes, each with its run's length and the rate too high for it
CASES = pytest.mark.parametrize(
    ("source", "steps", "bad_lr"),
    [(LM, 60, 3.0), (REGRESSION, 40, 0.02)],
    ids=["lm-fp16-grad-scaler", "regression-bf16"],
)


def _script(tmp_path: Path, source: str, steps: int) -> Path:
    path = tmp_path / "train.py"
    path.write_text(source.replace("STEPS", str(steps)))
    return path


def _fpdoctor(tmp_path: Path, command: str, script: Path, lr: float) -> list[dict]:
    out = tmp_path / f"{command}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run_fpdoctor(command, "--format", "json", "-o", str(out), "--", str(script), str(lr), cwd=tmp_path, env=env)
    return json.loads(out.read_text())["findings"]


def _losses(script: Path, lr: float) -> tuple[float, float]:
    run = run_python(str(script), str(lr), timeout=120)
    line = next(x for x in run.stdout.splitlines() if x.startswith("LOSSES"))
    first, last = map(float, line.split()[1:])
    return first, last


def test_a_bad_batch_then_a_zero_division_is_not_blamed_on_the_rate():
    """A spike from one batch of outlier targets, then a 0/0 in the loss code on an empty mask
    (review54): the lower rates tried from the spike settle like the run's, so the replayed verdict
    stays the division's own, with its guard."""
    torch.manual_seed(0)
    w_true = torch.randn(8, 1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    guard = fpdoctor.Sentinel(model, opt)

    def step_fn(x, y, mask):
        opt.zero_grad()
        loss = ((model(x) - y).pow(2).squeeze(1) * mask).sum() / mask.sum()
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for step in range(1, 66):
        x = torch.randn(64, 8, generator=g)
        y, mask = x @ w_true + 0.05 * torch.randn(64, 1, generator=g), torch.ones(64)
        if step == 61:
            y = y + 20.0  # a bad batch
        if step == 62:
            mask = torch.zeros(64)  # no valid rows
        guard.step(step_fn, x, y, mask)
    (verdict,) = guard.report.by_name("deterministic-nonfinite")
    assert "loss climbed" not in verdict.message and verdict.fix.startswith("guard the denominator"), verdict.fix


def test_growth_over_a_few_updates_is_a_blowup_and_healthy_growth_is_not():
    # momentum at a rate too high: x2 to x20 a step, a hundredfold in 4 updates
    assert _blowup([4.3, 4.3, 4.3, 4.3, 9.5, 97.0, 185.0, 3624.0]) == (3, 7, 4.3, 3624.0)
    assert _blowup([1.0, 1.0, 200.0]) == (1, 2, 1.0, 200.0)  # in one step, as before
    assert _blowup([1.0, 1.0, math.inf]) == (1, 2, 1.0, math.inf)
    # a zero-initialised model grows from its first update, not from 0
    assert _blowup([0.0, 1e-3, 2e-3, 5e-3, 0.2]) is None
    # a slow rise over many steps (fine-tuning that grows the weights 100x over 60 steps)
    assert _blowup([1.0 * 1.08**k for k in range(60)]) is None
    # the same hundredfold within the window is one
    assert _blowup([1.0 * 1.3**k for k in range(BLOWUP_STEPS)]) is not None


@CASES
def test_trace_names_the_updates_that_grew_the_weights_ahead_of_the_overflow(tmp_path, source, steps, bad_lr):
    script = _script(tmp_path, source, steps)
    if source is LM:  # the premise, on this CPU's arithmetic: the weights grow 100x before the loss overflows
        run = run_python(str(script), str(bad_lr), timeout=120)
        growth = float(next(x for x in run.stdout.splitlines() if x.startswith("GROWTH")).split()[1])
        if growth < 100:
            pytest.skip(f"on this CPU's arithmetic the weights grow {growth:.3g}x before the loss overflows, not 100x")
    found = _fpdoctor(tmp_path, "trace", script, bad_lr)
    first = found[0]
    assert first["name"] == "update-blew-up", [f["name"] for f in found]
    ev = first["evidence"]
    assert ev["growth"] > 100 and ev["optimizer_step"] - ev["from_step"] >= 2  # over several updates
    # the rate lowered by the growth factor at least, said as one figure (never "10x-100x" beside a 174x growth)
    assert f"the weights grew {ev['growth']:.3g}x: by that factor at least" in first["fix"], first["fix"]
    # every later overflow's fix is the rate's, not a precision change at the op
    later = [f for f in found[1:] if f["name"] in ("nonfinite-produced", "grad-scaler-stalled")]
    assert later and all(f["fix"].startswith("Lower the learning rate") for f in later)
    assert all(f["evidence"]["step"] > ev["optimizer_step"] for f in later)
    # steps as the training log counts them: the GradScaler's skipped steps too
    stalled = [f for f in found if f["name"] == "grad-scaler-stalled"]
    assert bool(stalled) == (source is LM)  # the GradScaler's run stalls; the bf16 one has no scaler
    if stalled:
        assert stalled[0]["evidence"]["step"] == ev["optimizer_step"] + 1


@CASES
def test_watch_puts_the_climb_first_and_the_lower_rate_it_checked_trains_as_printed(tmp_path, source, steps, bad_lr):
    script = _script(tmp_path, source, steps)
    found = _fpdoctor(tmp_path, "watch", script, bad_lr)
    first = found[0]
    assert first["name"] in ("training-stalled", "deterministic-nonfinite"), [f["name"] for f in found]
    assert "loss climbed before" in first["message"] and "the precision is what fails" not in first["message"]
    assert first["fix"].startswith("Lower the learning rate to ")
    verdicts = [f for f in found if f["name"] == "deterministic-nonfinite"]
    assert verdicts and all("no precision change is the fix" in f["message"] for f in verdicts)
    assert all(f["fix"].startswith("Lower the learning rate") for f in found if f["name"] == "nonfinite-produced")
    tried = next(f["evidence"]["lr_tried"] for f in found if "lr_tried" in f["evidence"])
    assert tried["fix_lr"] is not None and tried["fix_lr"] < bad_lr
    # the rate as printed: the run stays finite and learns
    start, end = _losses(script, tried["fix_lr"])
    assert math.isfinite(end) and end < start
    _, bad = _losses(script, bad_lr)
    assert not math.isfinite(bad)
