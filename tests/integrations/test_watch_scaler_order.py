"""`fpdoctor watch` on gradient accumulation that unscales on every micro-batch (TRN021): the
GradScaler's calls in the wrong order make no NaN and skip nothing, yet the optimizer steps on the
last micro-batch alone. The finding is measured on a reference step, and its fix, applied as
printed (the lines it names moved out of the loop, or deleted), makes the script OK."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from tests.conftest import report_of

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
    return report_of(tmp_path, "watch", "--", "python", str(script))


def _spans(text: str) -> list[tuple[int, int]]:
    """`line 5 (...)`, `lines 7-8 (...)` in a fix's text, in order."""
    return [(int(a), int(b or a)) for a, b in re.findall(r"lines? (\d+)(?:-(\d+))? \(`", text)]


def _apply(script: Path, fix: str) -> None:
    """The fix as printed: the lines it moves put just before the step's line, at its indentation, in the
    order printed; the update() it moves put just after it; the lines it deletes deleted."""
    lines = script.read_text().splitlines()
    moving, _, deleting = fix.partition("; delete ")
    moving = moving.partition(" move ")[2]
    before_text, _, rest = moving.partition(" to just before ")
    step = int(re.match(r"line (\d+)", rest).group(1))
    after_text = rest.partition(", and ")[2].partition(" to just after it")[0]
    indent = lines[step - 1][: len(lines[step - 1]) - len(lines[step - 1].lstrip())]

    def chunk(spans: list[tuple[int, int]]) -> list[str]:
        out = []
        for a, b in spans:
            part = lines[a - 1 : b]
            own = len(part[0]) - len(part[0].lstrip())
            out += [indent + line[own:] for line in part]
        return out

    moved, after = _spans(before_text), _spans(after_text)
    gone = {n for a, b in [*moved, *after, *_spans(deleting)] for n in range(a, b + 1)}
    out = []
    for n, line in enumerate(lines, 1):
        if n == step:
            out += [*chunk(moved), line, *chunk(after)]
        elif n not in gone:
            out.append(line)
    script.write_text("\n".join(out) + "\n")


# one loop, the step in an `if` every third micro-batch (unscale_ and clip on every micro-batch)
ONE_LOOP = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(2)
x = torch.randn(3072, 24)
y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(3072, 1)
model = nn.Sequential(nn.Linear(24, 128), nn.SiLU(), nn.Linear(128, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
scaler = torch.amp.GradScaler("cpu")
for i in range(72):
    idx = torch.randint(0, 3072, (32,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x[idx]), y[idx]) / 3
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    if (i + 1) % 3 == 0:
        scaler.step(opt)
        opt.zero_grad()
    scaler.update()
"""

# two losses, the unscale_ and clip between their backwards: the second's gradients stay scaled
BETWEEN_LOSSES = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(3)
x = torch.randn(2048, 24)
y = torch.sin(x[:, :4].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(24, 96), nn.SiLU(), nn.Linear(96, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for step in range(24):
    idx = torch.randint(0, 2048, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x[idx])
        fit = F.mse_loss(out, y[idx])
        reg = 0.1 * out.float().abs().mean()
    scaler.scale(fit).backward(retain_graph=True)
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
    scaler.scale(reg).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""

# the unscale_ and clip in an `if` that they fill, in the micro-batch loop, an update() on each micro-batch
IN_AN_IF = STEP_IN_LOOP.replace(
    "        scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)\n",
    "        if clip:\n            scaler.unscale_(opt)\n"
    "            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)\n",
).replace("scaler = torch.amp.GradScaler", "clip = True\nscaler = torch.amp.GradScaler")

CASES = {"step_in_loop": STEP_IN_LOOP, "step_after_loop": STEP_AFTER_LOOP, "one_loop": ONE_LOOP,
         "between_losses": BETWEEN_LOSSES, "in_an_if": IN_AN_IF}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_unscaling_before_the_last_backward_is_an_error_measured_on_a_reference_step_and_its_fix_works_as_printed(
    tmp_path, case
):
    source = CASES[case]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source))
    report = _watch(tmp_path, script)
    first = report["findings"][0]
    assert first["name"] == "unscaled-then-accumulated" and first["severity"] == "error", [
        f["name"] for f in report["findings"]
    ]
    evidence, trial, fix = first["evidence"], first["fix_trial"], first["fix"]
    assert evidence["lines_read"] and " to just before line " in fix, fix
    # measured: what the optimizer took departs from the fp32 step's, the micro-batches unscaled once do not
    assert trial["status"] == "checked", trial
    if trial["metric"].startswith("worst cosine"):
        assert trial["before"] < 0.9 and trial["after"] > 0.99, trial
    else:
        assert not 0.5 <= trial["before"] <= 2 and 0.5 <= trial["after"] <= 2, trial
    if case == "step_in_loop":  # the step in `if k == 2:`: unscale_ and clip go there, the update after it
        assert evidence["unscale_calls"] == 3 and evidence["backwards_after_unscale"] == 2, evidence
        assert "line 17 (`scaler.unscale_(opt)`), line 18" in fix and "to just before line 20" in fix, fix
        assert "and line 21 (`scaler.update()`) to just after it" in fix, fix
    elif case == "step_after_loop":  # an update() already follows the step: the loop's is deleted
        assert "delete line 20 (`amp_scaler.update()`)" in fix, fix
        # the update() after the last unscale_ reset the scaler: scaler.step unscaled it all once more
        assert evidence["taken_norm"] < 1e-3, evidence
    elif case == "between_losses":  # one unscale_, the second backward's gradients left scaled
        assert evidence["backwards_after_last_unscale"] == 1 and "still multiplied by the scale" in first["message"]
        assert trial["before"] > 100, trial
    elif case == "in_an_if":  # the `if` they fill moved whole
        assert "(`if clip:` and what it holds)" in fix, fix
    _apply(script, fix)
    fixed = _watch(tmp_path, script)
    assert fixed["verdict"] == "ok", [(f["name"], f["message"][:200]) for f in fixed["findings"]]
    assert fixed["data"]["steps"] == report["data"]["steps"], "the fix keeps every optimizer step"


# right: the AMP recipe; a step the script skips (a spike guard) and clears, with zero_grad to None or to 0
RIGHT = STEP_IN_LOOP.replace(
    "        scaler.unscale_(opt)\n        torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)\n"
    "        if k == 2:\n            scaler.step(opt)\n        scaler.update()\n",
    "",
).replace(
    "    opt.zero_grad(set_to_none=True)\n",
    "    scaler.unscale_(opt)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)\n"
    "    if step != 4:  # a spike guard skips this one\n        scaler.step(opt)\n    scaler.update()\n"
    "    opt.zero_grad(set_to_none=NONE)\n",
)


@pytest.mark.parametrize("to_none", [True, False])
def test_a_step_skipped_by_the_script_after_its_unscale_is_not_a_mix(tmp_path, to_none):
    assert "scaler.unscale_(opt)\n    torch" in RIGHT  # the replacements took
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(RIGHT.replace("NONE", str(to_none))))
    report = _watch(tmp_path, script)
    assert report["verdict"] == "ok", [(f["name"], f["message"][:200]) for f in report["findings"]]


# the scaled loss made and left unused: the backward of the loss itself, then the scaler's step
NOT_SCALED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = torch.amp.GradScaler("cpu")
for step in range(40):
    idx = torch.randint(0, 2048, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x[idx]), y[idx])
    scaled = scaler.scale(loss)
    loss.backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
"""


def test_a_backward_of_the_loss_scale_was_given_is_named_and_the_fix_as_printed_is_ok(tmp_path):
    """Was OK, no findings: the reference step agrees with the backward, whose gradients are right until
    scaler.step() divides them by 65536."""
    path = tmp_path / "train.py"
    path.write_text(NOT_SCALED)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    first = report["findings"][0]
    lines = NOT_SCALED.splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == "loss.backward()")
    assert first["name"] == "loss-not-scaled", [f["name"] for f in report["findings"]]
    assert first["evidence"]["location"].endswith(f"train.py:{line}") and first["evidence"]["scale"] == 65536
    assert first["evidence"]["occurrences"] == 40
    assert "`scaler.scale(loss).backward()`" in first["fix"]
    assert first["severity"] == "error" and "Every update of SGD is 1/65536" in first["message"]
    # under AdamW the factor divides out but near its eps: said so, a warning
    adamw = NOT_SCALED.replace(
        "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)", "torch.optim.AdamW(model.parameters())"
    )
    path.write_text(adamw)
    adaptive = report_of(tmp_path, "watch", "--", "python", str(path))["findings"][0]
    assert adaptive["name"] == "loss-not-scaled" and adaptive["severity"] == "warning", adaptive
    assert (
        "AdamW divides by the gradients' running size" in adaptive["message"]
        and "1/65536 of" not in adaptive["message"]
    )
    # as printed
    path.write_text(NOT_SCALED.replace("    loss.backward()\n", "    scaler.scale(loss).backward()\n"))
    fixed = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not [f for f in fixed["findings"] if f["name"] == "loss-not-scaled"], fixed["findings"]
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]
