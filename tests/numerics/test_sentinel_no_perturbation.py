"""A guarded run is bitwise the unguarded run on finite steps: parameters, buffers, losses, RNG."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor

CASES = {
    "adamw-foreach": {"opt": {"foreach": True}},
    "adamw-fused": {"opt": {"fused": True}},
    "adamw-fused-deferred": {"opt": {"fused": True}, "deferred": True},
    "bf16-autocast-gradscaler": {"opt": {"foreach": True}, "autocast": torch.bfloat16, "scaler": True},
    "fp16-autocast-gradscaler-fused": {"opt": {"fused": True}, "autocast": torch.float16, "scaler": True},
    # AdamW's exp_avg_sq of an fp16 model is fp16: 0.001 * g^2 lands among the subnormals, and the
    # update of the first layer is 8x the fp32 optimizer's; the reference step says so (TRN018)
    "fp16-model": {
        "opt": {"foreach": True, "eps": 1e-4},
        "model_dtype": torch.float16,
        "finds": ["update-departs-from-reference"],
    },
    "accumulate-3": {"opt": {"foreach": True}, "accumulate": 3},
}


def _run(case: dict, guarded: bool):
    torch.manual_seed(0)
    dtype = case.get("model_dtype", torch.float32)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **case["opt"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if case.get("scaler") else None
    accumulate = case.get("accumulate", 1)
    autocast = case.get("autocast")
    guard = None
    if guarded:
        guard = fpdoctor.Sentinel(
            model, opt, scaler=scaler, accumulate=accumulate, device_skip=bool(case.get("deferred"))
        )

    def step(x, y):
        if accumulate == 1:
            opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(x.to(dtype))
        loss = nn.functional.mse_loss(out.float(), y) / accumulate
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss

    g = torch.Generator().manual_seed(1)
    torch.manual_seed(7)  # dropout draws from the global generator
    losses = []
    for i in range(6):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        if guard is not None:
            losses.append(guard.step(step, x, y).detach())
            continue
        losses.append(step(x, y).detach())
        if (i + 1) % accumulate == 0:
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            if accumulate > 1:
                opt.zero_grad(set_to_none=True)
    if guard is not None:
        assert [f.name for f in guard.report.findings] == case.get("finds", []), guard.report.findings
    state = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    return losses, state, torch.get_rng_state()


@pytest.mark.parametrize("name", list(CASES))
def test_guarded_training_is_bitwise_unguarded_training(name):
    plain_losses, plain_state, plain_rng = _run(CASES[name], guarded=False)
    losses, state, rng = _run(CASES[name], guarded=True)
    assert all(torch.equal(a, b) for a, b in zip(plain_losses, losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(plain_state, state, strict=True))
    assert torch.equal(plain_rng, rng)
