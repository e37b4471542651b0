"""`fpdoctor watch` on one process, where the script's own loss code makes the loss exactly 0: a
mean over the training set computed as a sum divided by the set's size held in the logits' dtype
(120,000 is Inf in float16 under autocast). Every gradient is 0, nothing is NaN, and the reference
step, replayed from the gradients at the model's outputs, sees zeros too: TRN031 names it as a
warning (a loss switched off on purpose does the same), never OK, and sends the user to `trace`
with the script's own command, which names the line; a loss that is not 0 and hands the model no
gradient (1 - a share divided by that Inf, as a Dice loss is) is an error. The same script with
the size in fp32 trains, and in fp32 with the loss weighted 0 on purpose: no such finding."""

from __future__ import annotations

import pytest

from tests.integrations.test_watch import _report, _watch

SCRIPT = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
scaler = torch.amp.GradScaler("cpu")
n_train = 120_000  # the loss is a share of the whole set's, as the paper's objective writes it
g = torch.Generator().manual_seed(1)
for step in range(12):
    x = torch.randn(64, 12, generator=g)
    y = x[:, :1] * 2.0 - x[:, 1:2]
    with torch.autocast("cpu", dtype=torch.float16, enabled=sys.argv[1] != "off"):
        pred = model(x)
        half = sys.argv[1] in ("half", "ratio")
        size = torch.tensor(n_train, dtype=pred.dtype) if half else torch.tensor(float(n_train))
        weight = 0.0 if sys.argv[1] == "off" else 1000.0  # "off": a loss term switched off on purpose, in fp32
        loss = ((pred.float() - y) ** 2).sum() / size * weight
        if sys.argv[1] == "ratio":  # 1 - a share, as a Dice loss is: 1 exactly, and nothing moves
            loss = 1.0 - (pred.float() - y).abs().sum() / size
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
print("done", float(loss))
"""


@pytest.mark.parametrize("size", ["half", "ratio", "fp32", "off"])
def test_a_loss_the_script_makes_zero_on_one_process_is_named_never_ok(tmp_path, size):
    (tmp_path / "train.py").write_text(SCRIPT)
    run = _watch(tmp_path, "python", "train.py", size)
    report = _report(tmp_path)
    names = [f["name"] for f in report["findings"]]
    if size not in (
        "half",
        "ratio",
    ):  # the same run, trained; or its loss weighted 0 on purpose in fp32: no precision in it
        assert "gradients-all-zero" not in names, run.stdout + run.stderr
        return
    first = report["findings"][0]
    assert first["name"] == "gradients-all-zero", names
    if size == "ratio":  # a loss of 1 that hands the model no gradient is no loss switched off: an error
        assert report["verdict"] == "error" and first["severity"] == "error", run.stdout + run.stderr
        assert first["evidence"]["last_loss"] == 1.0 and "reaches the model's outputs as zero" in first["message"]
        return
    assert report["verdict"] == "warning", run.stdout + run.stderr
    assert first["evidence"]["steps_all_zero"] == [1, 10] and first["evidence"]["last_loss"] == 0.0
    assert "The loss itself is exactly 0" in first["message"] and "after DDP" not in first["message"]
    assert "`fpdoctor trace -- train.py half`" in first["fix"] and first["fix_trial"]["reason"], first


def test_a_nan_loss_over_zero_gradients_is_said_as_it_was(tmp_path) -> None:
    """A weighted loss in pure fp16 whose sum and normaliser both pass 65504: Inf / Inf is a NaN loss at
    every step, and its backward hands every output 0. TRN031 said "while the loss was finite" beside
    TRN001's NaN (the last finite loss was passed, and there was none)."""
    (tmp_path / "train.py").write_text(NAN_SCRIPT)
    run = _watch(tmp_path, "python", "train.py")
    report = _report(tmp_path)
    found = [f for f in report["findings"] if f["name"] == "gradients-all-zero"]
    assert len(found) == 1, run.stdout + run.stderr
    message = found[0]["message"]
    assert "and the loss was nan" in message and "was finite" not in message, message
    assert "Inf / Inf is the NaN" in message


NAN_SCRIPT = """
import torch
import torch.nn.functional as F
from torch import nn
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).half()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(12):
    x = torch.randn(16384, 16, generator=g).half()
    y = torch.randint(0, 10, (16384,), generator=g)
    w = (1 + 9 * torch.rand(16384, generator=g)).half()
    per = F.cross_entropy(model(x), y, reduction="none")
    loss = (w * per).sum() / w.sum()  # Inf / Inf: NaN
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
