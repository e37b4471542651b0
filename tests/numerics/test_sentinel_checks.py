"""The sentinel's check and bookkeeping: fp16 gradients, BatchNorm buffers, checkpoints, its own
errors, the spike history, gradient accumulation, the deferred device-side decision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _plain_step(model, opt, loss_fn=nn.functional.mse_loss):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    return step


def test_finite_fp16_gradients_whose_norm_overflows_fp16_are_finite():
    # fp16 gradients of 2048 each: every value is finite, their norm (131072) is not in fp16
    torch.manual_seed(0)
    model = nn.Linear(64, 64).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    x = torch.full((8, 64), 2.0, dtype=torch.float16)

    def step(x):
        opt.zero_grad(set_to_none=True)
        out = model(x).float()
        loss = (out * 1024.0).sum() / 8
        loss.backward()
        return loss

    guard = fpdoctor.Sentinel(model, opt)
    before = model.weight.detach().clone()
    guard.step(step, x)
    grad = model.weight.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    assert torch.isinf(torch._foreach_norm([grad])[0])  # a norm in the gradient's own dtype overflows
    report = guard.report
    assert report.findings == [] and report.data["skipped_steps"] == 0
    assert not torch.equal(before, model.weight)  # the optimizer stepped


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = fpdoctor.Sentinel(model, opt, replay=False)
    step = _plain_step(model, opt)
    g = torch.Generator().manual_seed(1)
    good = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(3)]
    for x, y in good[:2]:
        guard.step(step, x, y)
    bn = model[1]
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    bad_x = good[2][0].clone()
    bad_x[3, 1] = float("nan")
    guard.step(step, bad_x, good[2][1])
    assert guard.report.data["skipped_steps"] == 1
    for k, v in bn.state_dict().items():
        assert torch.equal(v, state[k]), k  # running_mean/var and num_batches_tracked untouched
    guard.step(step, *good[2])
    assert bool(torch.isfinite(bn.running_mean).all()) and int(bn.num_batches_tracked) == 3


def test_an_unwritable_checkpoint_is_a_finding_not_an_exception(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "missing-dir" / "last-good.pt"
    guard = fpdoctor.Sentinel(model, opt, checkpoint_path=str(path), checkpoint_every=1)
    step = _plain_step(model, opt)
    for _ in range(3):
        guard.step(step, torch.randn(2, 4), torch.randn(2, 1))
    report = guard.report
    assert report.data["steps"] == 3 and report.data["last_good_step"] == 3
    failed = report.by_name("checkpoint-failed")
    assert len(failed) == 1 and "FileNotFoundError" in failed[0].message  # once, not once per step
    assert failed[0].evidence["path"] == str(path)
    assert f"the directory {path.parent} does not exist" in failed[0].message  # not a temporary file's name
    assert ".fpdoctor-ckpt" not in failed[0].message
    assert dict(report.data["summary"])["last-good checkpoint"] == "none written"  # never claims a missing file
    assert report.data["checkpoint_step"] is None


def test_own_errors_are_reported_once_and_keep_nan_out_of_the_spike_history():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    guard = fpdoctor.Sentinel(model, opt)
    x, y = torch.randn(2, 4), torch.randn(2, 1)
    scale = {"k": 1.0, "none": False}

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x) * 0, y) * scale["k"]
        loss.backward()
        return None if scale["none"] else loss

    for i in range(10):
        scale["k"] = 1.0 + 0.01 * (i % 3)
        guard.step(step, x, y)
    scale["none"] = True  # two steps whose loss the sentinel cannot read
    guard.step(step, x, y)
    guard.step(step, x, y)
    scale["none"], scale["k"] = False, 50.0
    guard.step(step, x, y)
    report = guard.report
    errors = report.by_name("sentinel-error")
    assert len(errors) == 1 and errors[0].severity.value == "warning"
    assert not report.by_name("known-issue")
    spikes = report.by_name("loss-spike")
    assert len(spikes) == 1 and spikes[0].where["step"] == 13


def test_gradient_accumulation_steps_every_n_and_replays_the_bad_micro_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(8)]

    def micro(m):
        def step(x, y):
            loss = nn.functional.mse_loss(m(x), y) / 4
            loss.backward()
            return loss

        return step

    guard = fpdoctor.Sentinel(model, opt, accumulate=4)
    for x, y in batches:
        guard.step(micro(model), x, y)
    for i, (x, y) in enumerate(batches):  # the same accumulation by hand
        micro(ref)(x, y)
        if i % 4 == 3:
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert guard.report.data["steps"] == 2 and guard.report.data["micro_batches"] == 8

    # a NaN in the third micro-batch of the third window: skipped, replayed, named
    before = [p.detach().clone() for p in model.parameters()]
    bad = [(x.clone(), y) for x, y in batches[:4]]
    bad[2][0][1, 1] = float("nan")
    for x, y in bad:
        guard.step(micro(model), x, y)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    report = guard.report
    verdict = report.by_name("deterministic-nonfinite")[0]
    # counted from 1, as steps are: the third micro-batch is 3
    assert verdict.where["step"] == 3 and verdict.evidence["micro_batch"] == 3
    assert report.by_name("nonfinite-loss")[0].evidence["micro_batch"] == 3
    assert "(micro-batch 3)" in report.by_name("nonfinite-loss")[0].message
    assert all(p.grad is None for p in model.parameters())  # the next window starts from zero


def test_deferred_device_skip_replays_the_bad_step_on_its_own_batch_and_weights():
    # the GPU path, forced on the CPU: the fused optimizer skips on the flag, the host looks later
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    guard = fpdoctor.Sentinel(model, opt, device_skip=True)
    step = _plain_step(model, opt)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)) for _ in range(4)]
    guard.step(step, *batches[0])
    before = [p.detach().clone() for p in model.parameters()]
    x_bad = batches[1][0].clone()
    x_bad[0, 0] = float("inf")
    guard.step(step, x_bad, batches[1][1])
    assert guard._pending is not None  # not decided yet: nothing was read back
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # skipped on device
    assert int(opt.state[model[0].weight]["step"]) == 1
    guard.step(step, *batches[2])  # decides step 2 first: replayed on its own batch
    report = guard.report
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.where["step"] == 2
    assert report.data["skipped_steps"] == 1 and report.data["last_good_step"] == 3
    assert int(opt.state[model[0].weight]["step"]) == 2


def test_a_step_fn_that_raises_does_not_count_as_a_micro_batch():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt, accumulate=2)
    calls = {"n": 0}

    def step(x):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("the user's own bug")
        loss = model(x).sum()
        loss.backward()
        return loss

    x = torch.ones(2, 4)
    guard.step(step, x)
    with pytest.raises(KeyError):  # the user's error reaches the user
        guard.step(step, x)
    before = model.weight.detach().clone()
    guard.step(step, x)  # the window's second micro-batch: now the optimizer steps
    assert not torch.equal(before, model.weight)
    assert guard.report.data["steps"] == 1 and guard.report.findings == []


def test_batchnorm_statistics_stay_finite_when_the_very_first_step_is_skipped():
    # the first step is the one that shows which buffers a forward changes; skipped, it still must
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt, replay=False)
    step = _plain_step(model, opt)
    bad, y = torch.full((8, 4), float("nan")), torch.zeros(8, 1)
    for x in (bad, torch.randn(8, 4), torch.randn(8, 4)):
        guard.step(step, x, y)
    before = model[1].running_mean.clone(), model[1].running_var.clone()
    guard.step(step, bad, y)
    assert guard.skipped == 2
    assert torch.equal(model[1].running_mean, before[0]) and torch.equal(model[1].running_var, before[1])


def test_an_all_negative_infinity_gradient_is_minus_inf():
    from fpdoctor.numerics.observe.gradcheck import tensor_kind
    from fpdoctor.numerics.training.distributed import BucketWatch

    minus = torch.full((3,), float("-inf"))
    assert tensor_kind(minus) == "-inf"
    assert tensor_kind(torch.tensor([float("-inf"), float("inf")])) == "+inf"
    assert tensor_kind(torch.tensor([1.0, float("nan"), float("-inf")])) == "nan"
    assert tensor_kind(torch.ones(3)) is None
    model = nn.Linear(3, 1)
    watch = BucketWatch(model)
    low, high = torch.aminmax(minus)
    watch._records = [(0, [model.weight], low, high)]
    assert watch.local_faults() == [{"bucket": 0, "kind": "-inf", "parameters": ["weight"]}]
