"""`fpdoctor watch` on param groups that cannot train: one left at lr 0 (TRN023), part of the model
never moves, the loss falls slower, nothing is NaN. A warmup from 0 for every group, and a cosine
schedule that ends at 0, are no finding; the fix as printed (the group given its rate) is OK."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import report_of

# an encoder and a head in two groups; the encoder's rate is written 0.0 by mistake
SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(1024, 20)
y = (x[:, :5].sum(1) > 0).long()
encoder = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
head = nn.Linear(64, 2)
model = nn.Sequential(encoder, head)
opt = torch.optim.AdamW([{"params": encoder.parameters(), "lr": ENCODER_LR}, {"params": head.parameters()}], lr=3e-3)
SCHEDULE
for step in range(50):
    idx = torch.randint(0, 1024, (64,))
    opt.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    opt.step()
    STEP
"""


def _watch(tmp_path: Path, lr: str, schedule: str = "", step: str = "") -> dict:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.replace("ENCODER_LR", lr).replace("SCHEDULE", schedule).replace("STEP", step))
    return report_of(tmp_path, "watch", "--", "python", str(path))


def test_a_param_group_left_at_lr_0_is_named_with_its_parameters(tmp_path):
    report = _watch(tmp_path, "0.0")  # before: OK, no findings
    (found,) = [f for f in report["findings"] if f["name"] == "lr-zero-group"]
    assert found["evidence"]["groups"] == [0] and found["evidence"]["count"] == 4
    assert found["evidence"]["parameters"][:2] == ["0.0.weight", "0.0.bias"]
    fixed = _watch(tmp_path, "1e-3")  # as printed: the group given its rate
    assert not [f for f in fixed["findings"] if f["name"] == "lr-zero-group"] and fixed["verdict"] == "ok"


def test_a_warmup_from_0_and_a_schedule_that_ends_at_0_are_no_finding(tmp_path):
    warmup = "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 10))"
    cosine = "sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=50)"
    # the encoder held at 0 for 10 steps, then warmed up and annealed to 0 again: it trained in between
    held = (
        "sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.0 if s < 10 or s >= 49 else 1.0, lambda s: 1.0])"
    )
    for schedule in (warmup, cosine, held):
        report = _watch(tmp_path, "1e-3", schedule, "sched.step()")
        assert not [f for f in report["findings"] if f["name"] == "lr-zero-group"], schedule
    frozen = "encoder.requires_grad_(False)"  # frozen on purpose, its group at lr 0 too
    report = _watch(tmp_path, "0.0", frozen)
    assert not [f for f in report["findings"] if f["name"] == "lr-zero-group"], report["findings"]


def test_a_weight_decay_that_holds_the_weights_at_0_is_named_and_its_fix_trains(tmp_path):
    """AdamW(weight_decay=1e2) meant as 1e-2: lr x weight_decay = 0.3, the weights lose 30% a step to the
    decay and stay near 0; nothing is NaN (before: OK). The usual 0.01 is no finding."""
    script = SCRIPT.replace('opt = torch.optim.AdamW([{"params": encoder.parameters(), "lr": ENCODER_LR}, '
                            '{"params": head.parameters()}], lr=3e-3)',
                            "opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=WD)")  # fmt: skip
    path = tmp_path / "train.py"
    path.write_text(script.replace("WD", "1e2").replace("SCHEDULE", "").replace("STEP", ""))
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    (found,) = [f for f in report["findings"] if f["name"] == "weight-decay-too-strong"]
    assert found["evidence"]["per_step"] == 0.3 and "(100 may be 0.01 mistyped)" in found["fix"], found["fix"]
    path.write_text(script.replace("WD", "1e-2").replace("SCHEDULE", "").replace("STEP", ""))  # as printed
    fixed = report_of(tmp_path, "watch", "--", "python", str(path))
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]
    # a warmup from 0 reads lr 0 at the first step: the decay is judged at the peak it reaches
    warm = "sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 10))"
    path.write_text(script.replace("WD", "1e2").replace("SCHEDULE", warm).replace("STEP", "sched.step()"))
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert [f for f in report["findings"] if f["name"] == "weight-decay-too-strong"], report["findings"]
    # weight_decay 1 at lr 1e-2 (AdamW's weights settle near 1): no finding
    path.write_text(
        script.replace("lr=3e-3, weight_decay=WD", "lr=1e-2, weight_decay=1.0")
        .replace("SCHEDULE", "")
        .replace("STEP", "")
    )
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not [f for f in report["findings"] if f["name"] == "weight-decay-too-strong"], report["findings"]


def test_a_schedulers_factor_of_0_for_one_group_is_named_at_its_function(tmp_path):
    """A LambdaLR per group whose encoder warmup is written with `//`: 0 for the whole run; the finding
    names the scheduler's function for that group, and with `/` (as printed) the run is OK."""
    schedule = "sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: (s + 1) // 100, lambda s: 1.0])"
    report = _watch(tmp_path, "1e-3", schedule, "sched.step()")
    (found,) = [f for f in report["findings"] if f["name"] == "lr-zero-group"]
    line = next(i for i, text in enumerate(SCRIPT.splitlines(), 1) if text.strip() == "SCHEDULE")
    assert f"the LambdaLR's factor for group 0 is 0 (its function at line {line} of " in found["fix"], found["fix"]
    fixed = _watch(tmp_path, "1e-3", schedule.replace("(s + 1) // 100", "min(1.0, (s + 1) / 100)"), "sched.step()")
    assert not [f for f in fixed["findings"] if f["name"] == "lr-zero-group"] and fixed["verdict"] == "ok"
