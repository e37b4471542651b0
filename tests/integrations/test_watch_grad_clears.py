"""`fpdoctor watch` on a zero_grad() between the backward and the optimizer's step (TRN022): the
optimizer steps on no gradient, the loss is flat, and nothing is NaN or skipped. The finding names
the zero_grad() line; applied as printed (that line moved to where the step begins), the script
trains and is OK. Healthy orders get no finding: zero_grad before the forward, after the step,
a GAN's clear of the other network's gradients between a backward and a step."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import report_of, run_fpdoctor, run_python

# a regression MLP; zero_grad of the optimizer (to None) or of the model (to zeros) after the backward
CLEARED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
first = None
for step in range(60):
    idx = torch.randint(0, 2048, (64,))
    loss = F.mse_loss(model(x[idx]), y[idx])
    loss.backward()
    CLEAR
    opt.step()
    first = first if first is not None else loss.item()
print(f"loss {first:.4f} -> {loss.item():.4f}")
"""

# a GAN-like loop: the generator's backward writes the discriminator's gradients too, which are cleared
# before the generator's step; each optimizer's own gradients are cleared before its backward
HEALTHY_GAN = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for step in range(40):
    real = torch.randn(64, 2) * 0.5 + 2.0
    fake = G(torch.randn(64, 8))
    opt_d.zero_grad()
    d_loss = bce(D(real), torch.ones(64, 1)) + bce(D(fake.detach()), torch.zeros(64, 1))
    d_loss.backward()
    opt_d.step()
    opt_g.zero_grad()
    g_loss = bce(D(fake), torch.ones(64, 1))
    g_loss.backward()
    D.zero_grad()  # the generator's backward wrote D's gradients: cleared, not G's
    opt_g.step()
"""


def _watch(tmp_path: Path, script: str) -> dict:
    path = tmp_path / "train.py"
    path.write_text(script)
    return report_of(tmp_path, "watch", "--", "python", str(path))


@pytest.mark.parametrize(
    ("clear", "name", "gradients"),
    [
        ("opt.zero_grad()", "gradients-cleared", "None"),
        ("model.zero_grad(set_to_none=False)", "gradients-cleared", "zero"),
        ("for p in model.parameters(): p.grad = None", "gradients-cleared", "None"),  # no zero_grad() to see
        ("for p in model.parameters(): p.grad.zero_()", "gradients-depart-from-reference", None),  # zeros in place
    ],
)
def test_gradients_cleared_between_backward_and_step_are_named_and_the_fix_trains(tmp_path, clear, name, gradients):
    script = CLEARED.replace("CLEAR", clear)
    report = _watch(tmp_path, script)
    first = report["findings"][0]  # before: OK, no findings (or a clip blamed), on a run whose loss never moved
    assert first["name"] == name, [f["name"] for f in report["findings"]]
    line = next(i for i, text in enumerate(script.splitlines(), 1) if text.strip() == clear)
    step = line + 1
    if gradients is not None:
        assert first["evidence"]["location"].endswith(f"train.py:{line}"), first["evidence"]
        assert first["evidence"]["gradients"] == gradients and first["evidence"]["occurrences"] == 60
    assert re.match(
        rf"move line {line} of \S*train.py(, with its body,)? from between loss.backward\(\) and the optimizer's step",
        first["fix"],
    )
    # as printed: that line moved to just after the step
    lines = script.splitlines()
    moved = [*lines[: line - 1], lines[step - 1], lines[line - 1], *lines[step:]]
    fixed = _watch(tmp_path, "\n".join(moved) + "\n")
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]


# gradient accumulation whose zero_grad() sits inside the micro-batch loop, after each backward, and in a
# helper called there: the step takes the last micro-batch's gradients at most
ACCUMULATED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)


def log_norms(m):
    norm = sum(float(p.grad.norm()) for p in m.parameters() if p.grad is not None)
    m.zero_grad()
    return norm


for step in range(30):
    for k in range(4):
        idx = torch.randint(0, 2048, (32,))
        (F.cross_entropy(model(x[idx]), y[idx]) / 4).backward()
    log_norms(model)
    opt.step()
"""


def test_a_zero_grad_in_a_helper_is_named_with_the_call_that_runs_it(tmp_path):
    report = _watch(tmp_path, ACCUMULATED)
    first = report["findings"][0]
    lines = ACCUMULATED.splitlines()
    inner = next(i for i, text in enumerate(lines, 1) if text.strip() == "m.zero_grad()")
    call = next(i for i, text in enumerate(lines, 1) if text.strip() == "log_norms(model)")
    assert first["name"] == "gradients-cleared" and first["evidence"]["location"].endswith(f":{inner}")
    assert first["evidence"]["called_from"].endswith(f":{call}"), first["evidence"]
    assert first["fix"].startswith(f"take the model.zero_grad() at line {inner} of "), first["fix"]
    assert f"out of log_norms(), which line {call} calls between loss.backward()" in first["fix"], first["fix"]


# two heads on a shared trunk, one optimizer each, one task per batch: every optimizer steps every
# iteration, the head whose task the batch lacks with no gradient (torch skips it); frozen later, the trunk too
MULTI_HEAD = """
import torch
from torch import nn
torch.manual_seed(0)
trunk = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
heads = nn.ModuleList([nn.Linear(32, 1), nn.Linear(32, 1)])
model = nn.ModuleDict({"trunk": trunk, "heads": heads})
opts = [torch.optim.SGD(list(trunk.parameters()), lr=0.01)] + [torch.optim.SGD(h.parameters(), lr=0.01) for h in heads]
for step in range(40):
    task = step % 2
    x = torch.randn(32, 8)
    for o in opts:
        o.zero_grad()
    heads[task](trunk(x)).pow(2).mean().backward()
    for o in opts:
        o.step()
    if step == 20:
        trunk.requires_grad_(False)
"""


def test_the_usual_orders_get_no_gradients_cleared(tmp_path):
    after_step = CLEARED.replace("    CLEAR\n", "").replace("    opt.step()\n", "    opt.step()\n    opt.zero_grad()\n")
    for script in (after_step, HEALTHY_GAN, MULTI_HEAD):
        report = _watch(tmp_path, script)
        assert not [f for f in report["findings"] if f["name"] == "gradients-cleared"], report["findings"]


def test_the_watchs_zero_grad_keeps_torchs_signature(tmp_path):
    """accelerate reads Optimizer.zero_grad's parameters for set_to_none: a wrapper without them made
    `opt.zero_grad(set_to_none=True)` raise under the watch."""
    script = (
        "import inspect, torch\n"
        "print(list(inspect.signature(torch.optim.Optimizer.zero_grad).parameters))\n"
        "print(list(inspect.signature(torch.nn.Module.zero_grad).parameters))\n"
    )
    path = tmp_path / "sig.py"
    path.write_text(script)
    plain = run_python(str(path), check=True).stdout
    watched = run_fpdoctor("watch", "--", sys.executable, str(path)).out
    assert plain.strip() and plain.strip() in watched, (plain, watched)


# the pre-AMP recipe: an fp16 model, fp32 master copies stepped by the optimizer and copied back; one batch
# holds an Inf. The optimizer holds no parameter of the model: it was left unwatched and the run said OK
MASTERS = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1)).half()
masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
opt = torch.optim.SGD(masters, lr=0.01)
for step in range(30):
    x = torch.randn(64, 8)
    if step == 12:
        x[3, 0] = float("inf")
    model.zero_grad(set_to_none=True)
    (F.mse_loss(model(x.half()).float(), x[:, :1]) * 128).backward()
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float() / 128
    opt.step()
    with torch.no_grad():
        for m, p in zip(masters, model.parameters()):
            p.copy_(m)
    print(step, max(float(m.grad.abs().max()) for m in masters))  # the script reads its gradients after the step
"""


def test_an_optimizer_over_master_weights_is_watched_and_its_gradients_stay_the_scripts(tmp_path):
    report = _watch(tmp_path, MASTERS)
    assert report["verdict"] == "error", [f["name"] for f in report["findings"]]  # before: OK, steps 0
    assert report["data"]["steps"] == 30 and report["data"]["nonfinite_steps"] >= 1
    assert not [f for f in report["findings"] if f["name"] == "uncaught-exception"], report["findings"]


def test_master_weights_are_matched_to_the_network_a_backward_reached_not_a_twin(tmp_path):
    """A target network of the same shapes runs first, detached: the master copies are the online
    network's, whose backward ran; matched to the target, no reference step ran, and none said why."""
    script = (
        MASTERS.replace(
            "model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1)).half()\n",
            "target = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1)).half()\n"
            "model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1)).half()\n",
        )
        .replace(
            "    model.zero_grad(set_to_none=True)\n",
            "    model.zero_grad(set_to_none=True)\n    anchor = target(x.half()).detach()\n",
        )
        .replace('x[3, 0] = float("inf")', "pass")
    )
    report = _watch(tmp_path, script)
    compared = report["data"]["reference_step"]
    assert compared.get("compared_steps") == [1, 10], compared


# gradient accumulation with zero_grad() inside the micro-batch loop, before each backward: every step
# takes the last micro-batch's gradient alone, finite and of the right size, so a reference step of it agrees
INSIDE_THE_LOOP = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(40):
    idx = torch.randint(0, 2048, (4 * 16,))
    for k in range(4):
        opt.zero_grad()
        part = idx[k * 16:(k + 1) * 16]
        loss = F.mse_loss(model(x[part]), y[part]) / 4
        loss.backward()
    opt.step()
"""

# adversarial training: the input's gradient from one backward makes the example, the model's gradients of
# it are cleared, and the adversarial loss's backward (another statement) is the one the step takes
ADVERSARIAL = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    idx = torch.randint(0, 2048, (64,))
    xb = x[idx].clone().requires_grad_(True)
    F.cross_entropy(model(xb), y[idx]).backward()
    adv = (xb + 0.05 * xb.grad.sign()).detach()
    opt.zero_grad()
    F.cross_entropy(model(adv), y[idx]).backward()
    opt.step()
"""


def test_a_zero_grad_inside_the_micro_batch_loop_is_named_and_the_fix_as_printed_is_ok(tmp_path):
    """Was OK, no findings: the reference step recomputes the step from what the optimizer took."""
    report = _watch(tmp_path, INSIDE_THE_LOOP)
    first = report["findings"][0]
    lines = INSIDE_THE_LOOP.splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == "opt.zero_grad()")
    assert first["name"] == "gradients-cleared", [f["name"] for f in report["findings"]]
    # every step but the first (a step the script skipped, then cleared, is not one: two in a row are)
    assert first["evidence"]["location"].endswith(f":{line}") and first["evidence"]["occurrences"] == 39
    assert first["evidence"]["backward_passes"] == 4 and first["evidence"]["cleared_before_the_step"] == 3
    assert first["fix"].startswith(f"move line {line} of ") and "out of the micro-batch loop" in first["fix"]
    # as printed: once per optimizer step, just after the step
    at_step = next(i for i, text in enumerate(lines, 1) if text.strip() == "opt.step()")
    moved = [t for i, t in enumerate(lines, 1) if i != line]
    moved.insert(at_step - 1, "    opt.zero_grad()")
    fixed = _watch(tmp_path, "\n".join(moved) + "\n")
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]


def test_a_backward_for_an_inputs_gradient_cleared_before_the_real_one_is_not_named(tmp_path):
    report = _watch(tmp_path, ADVERSARIAL)
    assert not [f for f in report["findings"] if f["name"] == "gradients-cleared"], report["findings"]


# per-sample gradient norms measured in a loop of their own (cleared after each), then the batch's loss,
# another statement, is the backward the step takes
PER_SAMPLE = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = (x[:, :3].sum(1) > 0).long()
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(40):
    idx = torch.randint(0, 2048, (64,))
    norms = []
    for i in idx[:4]:
        F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        norms.append(float(sum(p.grad.norm() for p in model.parameters())))
        opt.zero_grad()
    F.cross_entropy(model(x[idx]), y[idx]).backward()
    opt.step()
    opt.zero_grad()
"""


# zero_grad() where the iteration begins, and a spike guard that skips one step: that step's gradients are
# cleared by the next iteration's zero_grad(), once
SKIPPED_ONCE = CLEARED.replace("    CLEAR\n    opt.step()\n", "    if step != 7:\n        opt.step()\n").replace(
    "    idx = torch.randint(0, 2048, (64,))\n", "    opt.zero_grad()\n    idx = torch.randint(0, 2048, (64,))\n"
)


def test_per_sample_gradients_or_a_skipped_step_cleared_at_the_same_statement_are_not_named(tmp_path):
    assert "if step != 7:" in SKIPPED_ONCE and "    opt.zero_grad()\n    idx" in SKIPPED_ONCE
    for script in (PER_SAMPLE, SKIPPED_ONCE):
        report = _watch(tmp_path, script)
        assert not [f for f in report["findings"] if f["name"] == "gradients-cleared"], report["findings"]


# PCGrad-style multi-task: one backward per task (the same statement, in a loop), each task's gradient kept
# and cleared, then the combined gradient put on .grad and stepped
PER_TASK = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
ys = [torch.tanh(x[:, k:k+3].sum(1, keepdim=True)) for k in range(3)]
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
params = list(model.parameters())
for step in range(30):
    idx = torch.randint(0, 2048, (64,))
    out = model(x[idx])
    task_grads = []
    for t in range(3):
        opt.zero_grad()
        F.mse_loss(out[:, t:t+1], ys[t][idx]).backward(retain_graph=True)
        task_grads.append([p.grad.clone() for p in params])
    for i, p in enumerate(params):
        p.grad = sum(g[i] for g in task_grads)
    opt.step()
"""

# zero_grad() where the iteration begins; a spike guard skips every other step for a while
SKIPPED_OFTEN = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(2048, 16)
y = torch.tanh(x[:, :3].sum(1, keepdim=True))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(30):
    opt.zero_grad()
    idx = torch.randint(0, 2048, (64,))
    F.mse_loss(model(x[idx]), y[idx]).backward()
    if 10 <= step < 16 and step % 2 == 0:
        continue
    opt.step()
"""

# the discriminator's update has the micro-batch bug, the generator's step (another optimizer) is healthy
GAN_MICRO_BATCHES = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
D = nn.Sequential(nn.Linear(2, 32), nn.ReLU(), nn.Linear(32, 1))
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for step in range(30):
    for k in range(4):
        opt_d.zero_grad()
        real = torch.randn(16, 2) * 0.5 + 2.0
        fake = G(torch.randn(16, 8)).detach()
        (bce(D(real), torch.ones(16, 1)) + bce(D(fake), torch.zeros(16, 1))).div(4).backward()
    opt_d.step()
    opt_g.zero_grad()
    bce(D(G(torch.randn(64, 8))), torch.ones(64, 1)).backward()
    opt_g.step()
"""


def test_gradients_combined_by_the_script_or_steps_a_guard_skips_often_are_no_micro_batches(tmp_path):
    for script in (PER_TASK, SKIPPED_OFTEN):
        report = _watch(tmp_path, script)
        assert not [f for f in report["findings"] if f["name"] == "gradients-cleared"], report["findings"]


def test_one_optimizers_micro_batch_clears_are_named_beside_a_healthy_other(tmp_path):
    report = _watch(tmp_path, GAN_MICRO_BATCHES)
    first = report["findings"][0]
    assert first["name"] == "gradients-cleared" and first["evidence"]["backward_passes"] == 4, report["findings"]
