"""The reference step on a GPU: the same step from the same weights, batch and RNG in fp32 on the
device, the update stages on copies there. A healthy bf16-autocast step with fused AdamW is
compared and says so; bf16 weights whose updates round away are told once, at the optimizer's own
step, with the master-weights fix checked on fp32 copies."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the reference step there")


def _run(device: str, *, bf16_weights: bool) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 8)).to(device)
    if bf16_weights:
        model = model.bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5 if bf16_weights else 1e-3, fused=device == "cuda")
    guard = fpdoctor.Sentinel(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=not bf16_weights):
            out = model(x.to(next(model.parameters()).dtype))
        loss = nn.functional.cross_entropy(out.float(), y)
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(64, 32, generator=g), torch.randint(0, 8, (64,), generator=g)
        guard.step(step, x.to(device), y.to(device))
    return guard.report


def test_a_healthy_bf16_autocast_step_on_the_gpu_is_compared_with_its_reference() -> None:
    report = _run("cuda", bf16_weights=False)
    assert report.verdict == "ok", str(report)
    ref = report.data["reference_step"]
    assert ref["compared_steps"] == [1] and ref["update_steps"] == [1], ref


def test_bf16_weights_on_the_gpu_whose_updates_round_away_are_told_once_and_checked() -> None:
    report = _run("cuda", bf16_weights=True)
    found = [f for f in report.findings if f.name in ("update-rounded-away", "update-departs-from-reference")]
    assert len(found) == 1, str(report)  # one cause, one finding
    assert found[0].trial is not None and found[0].trial.tried and found[0].trial.after == 0, found[0].trial
