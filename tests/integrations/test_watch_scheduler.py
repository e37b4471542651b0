"""`fpdoctor watch` on a learning-rate scheduler stepped once per micro-batch (TRN026): with gradient
accumulation, `scheduler.step()` next to the backward runs a schedule sized in optimizer steps k
times too fast; it ends after 1/k of the run and the rate stays at its end (before: OK). A scheduler
stepped once per optimizer step, and one sized in micro-batches and stepped per micro-batch, are no
finding; the fix as printed (the step moved next to the optimizer's) is OK."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import report_of

# a small regression net, 4 micro-batches per optimizer step, under bf16 autocast
SCRIPT = """
import math
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.sin(x[:, :4].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
STEPS, MICRO = 60, 4
SCHEDULER
for step in range(STEPS):
    for micro in range(MICRO):
        idx = torch.randint(0, 2048, (32,))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.mse_loss(model(x[idx]).float(), y[idx]) / MICRO
        loss.backward()
        MICRO_STEP
    opt.step()
    opt.zero_grad()
    OPT_STEP
"""

LINEAR = "sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.02, total_iters=SIZE)"
COSINE_TO_FLOOR = (
    "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.02, 0.5 * (1 + math.cos(math.pi * s / SIZE))) "
    "if s < SIZE else 0.02)"
)


def _watch(tmp_path: Path, scheduler: str, size: str, per_micro_batch: bool) -> dict:
    path = tmp_path / "train.py"
    step = "sched.step()"
    script = SCRIPT.replace("SCHEDULER", scheduler.replace("SIZE", size))
    script = script.replace("MICRO_STEP", step if per_micro_batch else "pass")
    path.write_text(script.replace("OPT_STEP", "pass" if per_micro_batch else step))
    return report_of(tmp_path, "watch", "--", "python", str(path))


@pytest.mark.parametrize("scheduler", [LINEAR, COSINE_TO_FLOOR], ids=["LinearLR", "LambdaLR"])
def test_a_scheduler_stepped_per_micro_batch_is_named_and_its_fix_is_ok(tmp_path: Path, scheduler: str) -> None:
    report = _watch(tmp_path, scheduler, "STEPS", per_micro_batch=True)
    (found,) = [f for f in report["findings"] if f["name"] == "scheduler-per-micro-batch"]
    evidence = found["evidence"]
    assert (evidence["scheduler_steps"], evidence["optimizer_steps"], evidence["per_step"]) == (240, 60, 4)
    assert evidence["ended_at_optimizer_step"] <= 15, evidence  # the schedule's 60 steps, 4 a step
    assert "move it out of the micro-batch loop, next to the optimizer's step()" in found["fix"]
    fixed = _watch(tmp_path, scheduler, "STEPS", per_micro_batch=False)  # as printed
    assert not [f for f in fixed["findings"] if f["name"] == "scheduler-per-micro-batch"], fixed["findings"]


def test_a_schedule_sized_in_micro_batches_is_no_finding(tmp_path: Path) -> None:
    for scheduler in (LINEAR, COSINE_TO_FLOOR):
        report = _watch(tmp_path, scheduler, "STEPS * MICRO", per_micro_batch=True)
        assert not [f for f in report["findings"] if f["name"] == "scheduler-per-micro-batch"], scheduler


def test_a_warm_up_sized_in_micro_batches_is_no_finding(tmp_path: Path) -> None:
    """A linear warm-up over 100 micro-batches, stepped per micro-batch (right): it ends at optimizer step
    25 of 60 and leaves the rate at its peak, where a decay that ended there would hold it at its floor."""
    warmup = "sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.01, end_factor=1.0, total_iters=SIZE)"
    report = _watch(tmp_path, warmup, "100", per_micro_batch=True)
    assert not [f for f in report["findings"] if f["name"] == "scheduler-per-micro-batch"], report["findings"]
