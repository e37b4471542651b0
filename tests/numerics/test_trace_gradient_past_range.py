"""A gradient past float16's range in a model held in fp16: a hand-written static loss scale
(`(loss * 4096).backward()`) on a regression whose loss is in the tens. The op that makes the
parameter's gradient is non-finite only in fp16, but computed in fp32 its result is past fp16's
range still, and the gradient of an fp16 parameter is stored in fp16: the fix is a smaller
gradient (GradScaler, a smaller scale, fp32 parameters, bf16), never "compute the op in fp32"."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


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
