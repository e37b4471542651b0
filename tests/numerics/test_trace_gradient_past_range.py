"""A gradient past float16's range in a model held in fp16: a hand-written static loss scale
(`(loss * 4096).backward()`) on a regression whose loss is in the tens. The op that makes the
parameter's gradient is non-finite only in fp16, but computed in fp32 its result is past fp16's
range still, and the gradient of an fp16 parameter is stored in fp16: the fix is a smaller
gradient (GradScaler, a smaller scale, fp32 parameters, bf16), never "compute the op in fp32"."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from tests.conftest import traced_script


def test_a_gradient_of_an_fp16_parameter_past_its_range_is_not_fixed_by_a_wider_op():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(256, 16).half()
    y = (40.0 + 10.0 * torch.randn(256, 1)).half()  # targets in raw units: the loss is in the thousands
    with fpdoctor.trace(model) as t:
        loss = ((model(x).float() - y.float()) ** 2).mean()
        opt.zero_grad()
        (loss * 4096).backward()  # a static loss scale, written by hand
        for p in model.parameters():
            p.grad.div_(4096)
        opt.step()
    first = t.report.findings[0]
    assert first.where.get("phase") == "backward", [(f.code, f.title, f.where) for f in t.report.findings]
    assert "makes a gradient past float16's range" in first.fix and "is no fix" in first.fix, first.fix
    assert "GradScaler" in first.fix and not first.fix.startswith("Compute"), first.fix


# a rare-event detector trained under fp16 autocast with a GradScaler, features in raw units, a sigmoid focal loss
# written from probabilities: once the scale has fallen, log's backward (1 / pt, pt near 0) is past fp16's range
FOCAL = """
import torch
from torch import nn
torch.manual_seed(0)
centers = torch.randn(2, 20) * 1.2


def sample(n, gen):
    y = torch.multinomial(torch.tensor([0.97, 0.03]), n, replacement=True, generator=gen)
    x = centers[y] + torch.randn(n, 20, generator=gen)
    flip = torch.rand(n, generator=gen) < 0.02
    return x * 15.0, torch.where(flip, torch.randint(0, 2, (n,), generator=gen), y)


def focal_loss(logit, target, alpha=0.25, gamma=2.0):
    p = torch.sigmoid(logit)
    t = target.to(p.dtype)
    pt = p * t + (1 - p) * (1 - t)
    at = alpha * t + (1 - alpha) * (1 - t)
    return -(at * (1 - pt) ** gamma * torch.log(pt)).mean()


model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
opt = torch.optim.Adam(model.parameters(), lr=2e-3)
scaler = torch.amp.GradScaler("cpu")
gen = torch.Generator().manual_seed(1)
for step in range(300):
    x, y = sample(256, gen)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = focal_loss(model(x).squeeze(-1), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_a_gradient_of_an_fp16_activation_past_its_range_is_not_fixed_by_a_wider_op(tmp_path):
    """log's backward divides by pt, an fp16 activation: computed in fp32 the gradient is still past fp16's
    range, and autograd casts it back to pt's dtype where it reaches the ops that made pt. "Compute that line
    in fp32" (checked on the op alone) left the run as it was; bf16's range holds it."""
    _, findings = traced_script(tmp_path, "focal", FOCAL)
    first = findings[0]
    assert first["where"]["phase"] == "backward" or "backward" in first["message"], first
    assert "aten.div.Tensor" in first["fix"] and "makes a gradient past float16's range" in first["fix"], first["fix"]
    assert "is no fix" in first["fix"] and not first["fix"].startswith("Compute"), first["fix"]
    assert "bf16" in first["fix"] and first["fix_trial"]["status"] == "checked", first
