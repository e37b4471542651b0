"""The sentinel under torch.amp.GradScaler (fp16 autocast on the CPU): overflow is the scaler's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _setup(seed: int = 0, init_scale: float = 2.0**12):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    return model, opt, scaler


def _batches():
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]
    # loss ~1e6 is finite in fp32, its gradients times 4096 are not in fp16: an overflowing batch
    batches[2] = (batches[2][0] * 1000, batches[2][1])
    return batches


def _scaled_step(model, opt, scaler):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        return loss

    return step


@pytest.mark.parametrize("declared", [True, False], ids=["scaler=", "found-in-step_fn"])
def test_an_overflowing_batch_is_an_amp_skip_and_training_goes_on(declared):
    model, opt, scaler = _setup()
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler) if declared else fpdoctor.Sentinel(model, opt)
    step = _scaled_step(model, opt, scaler)
    batches = _batches()
    for x, y in batches[:2]:
        guard.step(step, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    guard.step(step, *batches[2])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    for x, y in batches[3:]:
        guard.step(step, x, y)
    report = guard.report
    assert report.findings == []  # expected under a scaler: no NaN finding, no replay
    assert report.data["skipped_steps"] == 0 and report.data["nonfinite_steps"] == 0
    amp = report.data["amp"]
    assert amp["skipped_steps"] == 1 and amp["skip_rate"] == pytest.approx(1 / 5)
    assert amp["scale"] == scaler.get_scale() == 2.0**11
    assert report.data["last_good_step"] == 5

    # bitwise what the same loop does with the scaler and no sentinel
    ref, ref_opt, ref_scaler = _setup()
    ref_step = _scaled_step(ref, ref_opt, ref_scaler)
    for x, y in batches:
        ref_step(x, y)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters(), strict=True))


def test_a_nonfinite_loss_under_a_scaler_is_still_a_nonfinite_loss():
    model, opt, scaler = _setup()
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)
    step = _scaled_step(model, opt, scaler)
    x, y = _batches()[0]
    x = x.clone()
    x[0, 0] = float("nan")
    guard.step(step, x, y)
    report = guard.report
    assert [f.name for f in report.findings][:2] == ["nonfinite-loss", "deterministic-nonfinite"]
    assert report.data["skipped_steps"] == 1 and report.data["amp"]["skipped_steps"] == 0


def test_a_collapsing_scale_is_the_finding():
    model, opt, scaler = _setup(init_scale=4.0)
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)
    x = torch.full((8, 8), 300.0)

    def step(x):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() * 3000.0).mean()  # finite; its gradients overflow fp16 even at scale 1/8
        scaler.scale(loss).backward()
        return loss

    for _ in range(5):
        guard.step(step, x)
    report = guard.report
    collapse = report.by_name("amp-scale-collapse")
    assert len(collapse) == 1  # once per collapse, not once per step
    assert collapse[0].where["step"] == 3 and collapse[0].evidence["scale"] == 0.5
    assert report.data["amp"]["skipped_steps"] == 5
    assert not report.by_name("nonfinite-gradient")


def test_scaler_needs_the_optimizer():
    model, _, scaler = _setup()
    with pytest.raises(ValueError, match="optimizer"):
        fpdoctor.Sentinel(model, scaler=scaler)
    with pytest.raises(ValueError, match="GradScaler"):
        fpdoctor.Sentinel(model, torch.optim.SGD(model.parameters()), scaler=object())
