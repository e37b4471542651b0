"""The sentinel under torch.amp.GradScaler (fp16 autocast on the CPU): overflow is the scaler's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.observe import amp


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
    # expected under a scaler: no NaN finding, no replay; the batch scaled to overflow is a loss spike
    assert [f.name for f in report.findings] == ["loss-spike"]
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
    # the replay's verdict (the cause) ahead of the step's own check (the symptom it explains)
    assert [f.name for f in report.findings][:2] == ["deterministic-nonfinite", "nonfinite-loss"]
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
    # what the gradients held, as the replay saw it, or "non-finite" (found_inf tells no more): never a guess
    assert collapse[0].evidence["kind"] in ("nan", "+inf", "-inf", "non-finite"), collapse[0].evidence
    replayed = report.by_name("deterministic-nonfinite")
    if replayed and replayed[0].evidence.get("kind") in ("nan", "+inf", "-inf"):
        assert collapse[0].evidence["kind"] == replayed[0].evidence["kind"]
    assert report.data["amp"]["skipped_steps"] == 5
    summary = dict(report.data["summary"])
    assert summary["non-finite steps"].endswith("(the GradScaler's overflow skips apart: below)"), summary
    assert not report.by_name("nonfinite-gradient")


def test_scaler_needs_the_optimizer():
    model, _, scaler = _setup()
    with pytest.raises(ValueError, match="optimizer"):
        fpdoctor.Sentinel(model, scaler=scaler)
    with pytest.raises(ValueError, match="GradScaler"):
        fpdoctor.Sentinel(model, torch.optim.SGD(model.parameters()), scaler=object())


def test_the_finite_check_is_exact_without_the_fused_amp_kernel(monkeypatch):
    from fpdoctor.numerics.observe.gradcheck import nonfinite_flag

    def missing(*args, **kwargs):
        raise NotImplementedError("no kernel for this backend")

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", missing)
    cpu = torch.device("cpu")
    finite = [torch.full((4,), 60000.0, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16), torch.ones(2)]
    assert nonfinite_flag(finite, cpu).item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        grads = [*finite, torch.tensor([1.0, bad], dtype=torch.float16)]
        assert nonfinite_flag(grads, cpu).item() == 1.0
    assert nonfinite_flag([], cpu).item() == 0.0


def test_the_finite_check_takes_mixed_dtypes_in_one_call_and_sparse_gradients_by_their_values():
    from fpdoctor.numerics.observe.gradcheck import grad_norm, nonfinite_flag

    cpu = torch.device("cpu")
    finite = [torch.ones(2), torch.ones(3, dtype=torch.bfloat16), torch.full((4,), 60000.0, dtype=torch.float16)]
    assert nonfinite_flag(finite, cpu).item() == 0.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert nonfinite_flag([*finite, torch.tensor([1.0, bad], dtype=torch.bfloat16)], cpu).item() == 1.0
        sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, bad], (4,))  # nn.Embedding(sparse=True)'s kind
        assert nonfinite_flag([*finite, sparse], cpu).item() == 1.0
    sparse = torch.sparse_coo_tensor([[0, 2]], [3.0, 4.0], (4,))
    assert nonfinite_flag([*finite, sparse], cpu).item() == 0.0
    # the norm of every gradient, in float32: finite fp16 values whose squares overflow fp16 do not make it Inf
    expected = torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in finite] + [torch.tensor([3.0, 4.0])]))
    assert torch.allclose(grad_norm([*finite, sparse], cpu), expected)


def test_the_scaler_spy_falls_back_to_the_cuda_grad_scaler_and_leaves_it_as_it_was(monkeypatch):
    import torch.amp
    import torch.cuda.amp

    monkeypatch.delattr(torch.amp, "GradScaler")  # as before torch 2.3
    cls = torch.cuda.amp.GradScaler
    found: list = []
    with amp.spy(found):
        assert "scale" in vars(cls)
    assert "scale" not in vars(cls)  # inherited again, as it was


def test_a_spy_that_cannot_start_never_reaches_the_users_step(monkeypatch):
    def unavailable():
        raise ImportError("cannot import name 'GradScaler'")

    monkeypatch.setattr(amp, "grad_scaler_class", unavailable)
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    guard.step(step, torch.randn(8, 4))
    assert guard.steps == 1 and guard.last_good_step == 1
    assert [f.name for f in guard.report.findings] == ["sentinel-error"]
