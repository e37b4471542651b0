"""A learning rate raised by its scheduler past what the model tolerates (a warm-up with no cap):
the rate at the blow-up is not the lr the optimizer was built with, so "lower the learning rate"
reads as "lower the lr you passed", which is already low. trace and watch name the scheduler, its
function's line and how far it raised the rate, and the fix caps the schedule's factor; applied as
printed (the function's return wrapped in min(cap, ...)), the run trains. A scheduler that never
raises the rate is not named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from fpdoctor.numerics.observe import lr_schedule
from tests.conftest import report_of

# a regression MLP, SGD with momentum at lr 0.05, warmed up by a LambdaLR whose factor never stops
# growing (2% a step, without bound): the loss climbs and goes non-finite well before step 300, on any CPU's arithmetic
# (a linear climb to lr 1.5 left it finite on some: its ReLUs died first)
UNCAPPED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
def warmup(step):
    return 1.02 ** step
sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
for step in range(300):
    idx = torch.randint(0, 2048, (64,))
    loss = F.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
print("FINAL", loss.item())
"""


def _run(tmp_path: Path, command: str, script: Path) -> dict:
    argv = ("--", str(script)) if command == "trace" else ("--", "python", str(script))
    return report_of(tmp_path, command, *argv)


def _capped(script: Path, fix: str) -> None:
    """The fix as printed: the function's return at the line it names wrapped in min(cap, ...)."""
    line, cap = re.search(r"Cap the LambdaLR's factor at line (\d+) at ([0-9.e+-]+) \(min\(", fix).groups()
    lines = script.read_text().splitlines()
    start = int(line)
    at = next(n for n in range(start, len(lines)) if lines[n].strip().startswith("return "))
    indent, value = lines[at].split("return ", 1)
    lines[at] = f"{indent}return min({cap}, {value})"
    script.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("command", ["trace", "watch"])
def test_a_rate_raised_by_an_uncapped_schedule_names_the_schedule_and_its_cap_works_as_printed(tmp_path, command):
    script = tmp_path / "train.py"
    script.write_text(UNCAPPED)
    report = _run(tmp_path, command, script)
    first = report["findings"][0]
    expected = "update-blew-up" if command == "trace" else "training-stalled"
    assert first["name"] == expected, [f["name"] for f in report["findings"]]
    message, fix = first["message"], first["fix"]
    assert (
        "not the lr=0.05 the optimizer was built with: its LambdaLR (its function at line 10: `def warmup(step):`)"
        in (message)
    ), message
    assert fix.startswith("Cap the LambdaLR's factor at line 10 at "), fix
    if command == "watch":  # tried: the watch replays the model alone, so the loss is not what it claims
        trial = first["fix_trial"]
        assert trial["status"] == "checked" and trial["metric"] == "the gradients over 16 steps", trial
        assert "loss from climbing" not in message and "kept their gradients finite" in trial["after"], trial
        # the replay's verdict after a climb prints the rate's fix, not the loss code's
        verdict = next(f for f in report["findings"] if f["name"] == "deterministic-nonfinite")
        assert verdict["fix"] == fix, verdict["fix"]
    _capped(script, fix)
    fixed = _run(tmp_path, command, script)
    assert fixed["verdict"] == "ok", [(f["name"], f["message"][:160]) for f in fixed["findings"]]


def test_only_a_scheduler_that_raised_the_rate_is_named():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    assert lr_schedule.find(opt, 0.5) is None  # no scheduler: the rate is the one it was built with
    cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=100)  # starts at max_lr / 25
    found = lr_schedule.find(opt, 1.0)
    assert found is not None and found.kind == "OneCycleLR" and found.where is None
    assert found.factor == pytest.approx(25.0) and found.fix(0.1).startswith("Set the OneCycleLR so that the rate")
    del cycle
    other = torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.1)
    torch.optim.lr_scheduler.CosineAnnealingLR(other, T_max=10)
    assert lr_schedule.find(other, 0.1) is None  # a schedule that only lowers it


def test_a_scheduler_that_only_lowers_the_rate_is_not_named_beside_one_that_raised_it():
    """ChainedScheduler(ExponentialLR, an uncapped warm-up): the warm-up is named, not the decay; a rate
    raised by hand under a StepLR names no scheduler."""
    opt = torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.05)
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.99)
    warm = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)
    chained = torch.optim.lr_scheduler.ChainedScheduler([decay, warm])
    found = lr_schedule.find(opt, 0.5)
    assert found is not None and found.kind == "LambdaLR" and found.where is not None, found
    del chained, decay, warm
    by_hand = torch.optim.SGD(nn.Linear(4, 1).parameters(), lr=0.05)
    torch.optim.lr_scheduler.StepLR(by_hand, step_size=10, gamma=0.5)
    by_hand.param_groups[0]["lr"] = 0.5
    assert lr_schedule.find(by_hand, 0.5) is None
