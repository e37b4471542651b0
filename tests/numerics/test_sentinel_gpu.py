"""On a GPU with a fused optimizer the guarded step never makes the host wait for the device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: device-side skipping and the asynchronous flag read"
)


@needs_cuda
@pytest.mark.parametrize("scaled", [False, True], ids=["fused-adamw", "fused-adamw-fp16-gradscaler"])
def test_guarded_steps_with_a_fused_optimizer_do_not_synchronise(scaled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cuda") if scaled else None
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)
    assert guard.device_skip
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaled):
            loss = nn.functional.mse_loss(model(x).float(), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    for _ in range(3):  # warm-up: the first steps learn which buffers change (one read, once)
        guard.step(step, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(5):
            guard.step(step, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    bad = x.clone()
    bad[0, 0] = float("nan")
    guard.step(step, bad, y)
    report = guard.report  # decides the last step: replayed on its own batch and weights
    assert report.by_name("deterministic-nonfinite")[0].where["step"] == 9
    assert report.data["skipped_steps"] == 1 and report.data["last_good_step"] == 8
