"""The trace on a GPU: CUDA tensors take the deferred check (their values read a batch of ops at a
time, not after each op). A NaN made by an op is still named as that op with the user's line; a
healthy bf16 step says OK; an fp16 overflow under autocast and a GradScaler is the scaler's skip."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from tests.numerics import test_trace_deferred as deferred

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the deferred check")


def test_a_nan_made_on_the_gpu_is_named_with_its_op_and_line() -> None:
    model = deferred._log_model().cuda()  # the deferred check's own case, on the device it is for
    with fpdoctor.trace(model) as tr:
        model(torch.randn(8, 16, device="cuda")).sum().backward()
    first = tr.report.findings[0]
    assert first.name == "nonfinite-produced", str(tr.report)
    assert first.where["op"].startswith("aten.log"), first.where
    assert first.where["module"] == "2", first.where
    assert first.evidence["location"] == f"{deferred.__file__}:{deferred.LOG_LINE} in forward", first.evidence


def test_a_healthy_bf16_step_on_the_gpu_is_ok() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda")
    with fpdoctor.trace(model) as tr:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
    assert tr.report.verdict == "ok", str(tr.report)


def test_an_fp16_overflow_under_a_gradscaler_on_the_gpu_is_the_scalers_skip() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    x, y = torch.randn(8, 16, device="cuda") * 3e4, torch.randn(8, 1, device="cuda")  # past fp16's max in the GEMM
    with fpdoctor.trace(model) as tr:
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    names = [f.name for f in tr.report.findings]
    assert names, str(tr.report)
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the scaler skipped the step
