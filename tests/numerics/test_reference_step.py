"""The reference step: the Sentinel's first step computed again in fp32 (no autocast, no loss
scaling) from the same weights, batch and RNG, and the gradients compared per parameter.

Classes no rule names, each a run that trains badly while every NaN check says OK: clipping that
reads gradients still multiplied by the loss scale, gradients that flush to zero in fp16 without a
scaler. Healthy recipes (bf16 autocast, fp16 autocast with a GradScaler that unscales before it
clips, accumulation over micro-batches) get no finding. The user's gradients and objects are left
as the step made them.
"""

from __future__ import annotations

import copy
from collections import deque

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.observe.amp import grad_scaler_class
from fpdoctor.numerics.training import reference


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _findings(guard: fpdoctor.Sentinel) -> list[fpdoctor.Finding]:
    return guard.report.by_name("gradients-depart-from-reference")


def _clipped(unscale_first: bool) -> fpdoctor.Sentinel:
    """bf16 autocast, a GradScaler at 2**10 and clip_grad_norm_ in step_fn: before or after
    scaler.unscale_(optimizer); three steps under the Sentinel."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler_class()("cpu", init_scale=2.0**10)
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if unscale_first:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # otherwise it clips the scaled gradients
        return loss

    for i in range(3):
        guard.step(step, *_batch(i))
    return guard


def test_clipping_before_unscale_departs_at_the_optimizer_and_the_fix_is_checked() -> None:
    (found,) = _findings(_clipped(unscale_first=False))
    assert found.evidence["stage"] == "optimizer", found.message
    assert all(d["norm_ratio"] < 0.5 for d in found.evidence["departed"])
    assert "scaler.unscale_(optimizer)" in found.fix
    assert found.trial is not None and found.trial.after == 0, found.trial


def test_the_same_recipe_unscaling_first_is_no_departure() -> None:
    guard = _clipped(unscale_first=True)
    assert not _findings(guard), str(guard.report)
    assert guard._judge.reference_compared, "the first step was compared"
    assert guard._judge.reference_compared[0].not_compared is None


def test_fp16_gradients_that_flush_to_zero_depart_at_the_backward() -> None:
    """An fp16 model trained without a scaler: a loss scaled down by the user (a mean over a huge
    batch, here a factor 1e-6) makes gradients under fp16's smallest subnormal."""
    model = _model().half()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.half()).float(), y) * 1e-6
        loss.backward()
        return loss

    guard.step(step, *_batch())
    (found,) = _findings(guard)
    assert found.evidence["stage"] == "backward", found.message
    assert any(d["zeros"] >= 0.5 for d in found.evidence["departed"])
    assert "GradScaler" in found.fix


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_healthy_recipes_and_accumulation_get_no_finding_and_keep_their_gradients(dtype: torch.dtype) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = grad_scaler_class()("cpu", enabled=dtype == torch.float16)
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler, accumulate=2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        return loss

    unwatched = copy.deepcopy(model)
    unwatched_opt = torch.optim.AdamW(unwatched.parameters(), lr=1e-3)
    unwatched_scaler = grad_scaler_class()("cpu", enabled=dtype == torch.float16)
    for seed in (1, 2):
        guard.step(step, *_batch(seed))
        x, y = _batch(seed)
        with torch.autocast("cpu", dtype=dtype):
            loss = nn.functional.cross_entropy(unwatched(x), y)
        unwatched_scaler.scale(loss).backward()
    unwatched_scaler.step(unwatched_opt)
    unwatched_scaler.update()
    assert not _findings(guard), str(guard.report)
    compared = guard._judge.reference_compared
    assert compared and compared[0].not_compared is None and compared[0].rows["optimizer"]
    # the optimizer took the step's own gradients: the weights are an unwatched step's, bit for bit
    for a, b in zip(unwatched.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("every", "expected"), [(3, [1, 1, 1, 2, 3, 4, 4, 4]), (0, [1, 2, 3, 4])])
def test_a_reference_step_runs_step_fn_twice_more_and_reference_every_0_turns_it_off(
    every: int, expected: list[int]
) -> None:
    """Steps 1 and 4 (every 3rd from the first) run step_fn three times: the step, its recipe on
    copies, the reference."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt, reference_every=every)
    calls: list[int] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(guard._judge.steps)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for seed in range(4):
        guard.step(step, *_batch(seed))
    assert calls == expected
    with pytest.raises(ValueError, match="reference_every"):
        fpdoctor.Sentinel(_model(), None, reference_every=-1)


def test_gradients_too_small_for_an_fp32_product_keep_their_direction() -> None:
    """A converged run's gradients of 1e-28: their product underflows fp32, their cosine is 1."""
    from fpdoctor.numerics.training.reference import _row

    g = torch.tensor([-2.7e-28])
    row = _row("bias", "backward", g.clone(), g.clone())
    assert row is not None and row.ratio == 1.0 and row.cosine == pytest.approx(1.0)


def test_the_default_period_stretches_until_the_reference_step_costs_its_share_and_a_given_one_is_kept() -> None:
    """The reference step's own measured cost paces it: with the default period, the next one
    waits until its cost is under reference.SHARE of the steps between; a period given is kept."""
    assert reference.paced(reference.EVERY, cost=0.05, step_time=0.001) == 10_000  # 50 steps' time / 0.5%
    assert reference.paced(reference.EVERY, cost=0.001, step_time=0.001) == reference.EVERY  # cheap: 500
    assert reference.paced(3, cost=0.05, step_time=0.001) == 3  # the user's period
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)  # the default period

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for seed in range(3):
        guard.step(step, *_batch(seed))
    judge = guard._judge
    assert [c.step for c in judge.reference_compared] == [1]
    assert judge._reference_cost > 0 and len(judge._step_times) == 2  # measured, its own time left out
    judge._reference_cost, judge._step_times = 0.05, deque([0.001] * 8)  # a reference step of 50 steps' time
    assert not judge.reference_due(501)
    assert not judge.reference_due(10_000) and judge.reference_due(10_001)
    (line,) = [text for key, text in guard.report.data["summary"] if key == "reference step"]
    assert "paced to one every 10000 steps" in line and "0.5%" in line, line
    assert guard.report.data["reference_step"]["paced"]["every"] == 10_000
