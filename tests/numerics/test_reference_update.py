"""The reference step's update stages: the update the optimizer made of the gradients it received
(`intended`) and the update the weights kept by the next step (`kept`), each against the update
the same optimizer makes of the fp32 reference step's gradients (numerics/training/reference_update.py).

Each departing run below has gradients that agree with the reference's (no TRN015): only the
update says the step is lost, and the finding locates it at the stage where the runs part. The
healthy recipes get no finding, compare both stages, and end with the weights, optimizer state and
RNG of a plain run without fpdoctor, bit for bit.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.observe.amp import grad_scaler_class

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4))


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def _found(report: fpdoctor.Report) -> list[fpdoctor.Finding]:
    return report.by_name("update-departs-from-reference")


def _guarded(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    *,
    autocast: torch.dtype | None = None,
    after: Callable[[int], None] | None = None,
    **sentinel: Any,
) -> fpdoctor.Report:
    guard = fpdoctor.Sentinel(model, opt, **sentinel)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        return loss

    for i in range(STEPS):
        guard.step(step, *_batch(i))
        if after is not None:
            after(i)
    return guard.report


def test_bf16_weights_whose_updates_round_away_depart_at_the_intended_stage_and_fp32_copies_are_checked() -> None:
    """bf16 weights under AdamW at lr 1e-5: each update is under half the spacing of a weight of
    ~0.1 (2^-11), so the optimizer's own step leaves them as they were; the gradients agree."""
    model = _model().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    guard = fpdoctor.Sentinel(model, opt, check_updates=0)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x.bfloat16()).float(), y)
        loss.backward()
        return loss

    for i in range(STEPS):
        guard.step(step, *_batch(i))
    report = guard.report
    assert report.by_name("gradients-depart-from-reference") == [], str(report)
    (found,) = _found(report)
    assert found.evidence["stage"] == "intended" and found.evidence["step"] == 1, found.message
    assert "bfloat16 weights" in found.evidence["optimizer"]
    weights = [d for d in found.evidence["departed"] if d["parameter"].endswith("weight")]
    assert weights and all(d["zeros"] > 0.5 and d["norm_ratio"] < 0.5 for d in weights)
    assert all(d["reference_update_to_weight"] > 2 * d["update_to_weight"] for d in weights)
    assert found.trial is not None and found.trial.tried and found.trial.after == 0, found.trial
    assert "master weights" in found.fix


def test_a_weight_decay_applied_again_after_the_step_departs_at_the_kept_stage_and_names_the_call() -> None:
    """AdamW decays the weights itself; the loop decays them again, without the learning rate
    (`p.mul_(1 - wd)`): the weights keep 10x-15x the optimizer's update, in another direction."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def decay_again(i: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 - 0.1)  # the line the finding names
        opt.zero_grad(set_to_none=False)  # writes the gradients in place: not what the finding names

    line = decay_again.__code__.co_firstlineno + 3
    report = _guarded(model, opt, autocast=torch.bfloat16, after=decay_again)
    assert report.by_name("gradients-depart-from-reference") == []
    (found,) = _found(report)
    assert found.evidence["stage"] == "kept", found.message
    assert found.evidence["written_kind"] == "weights"
    (call,) = found.evidence["written_by"]
    assert call["call"] == "mul_" and call["line"] == line and call["file"] == __file__
    assert set(call["targets"]) == {n for n, _ in model.named_parameters()}
    assert all(v["norm_ratio"] > 2 for v in found.evidence["kept_vs_intended"].values())
    assert f"{__file__}:{line}" in found.message and f"{__file__}:{line}" in found.fix
    assert found.trial is not None and found.trial.before == found.evidence["departed_count"]
    assert found.trial.after == 0
    assert sys.getprofile() is None


def test_an_update_shrunk_by_an_optimizer_hook_departs_at_the_kept_stage_and_names_the_hook() -> None:
    """A step post-hook of the user's optimizer shrinks every weight by 10% (a decay meant for one
    layer, hooked on the whole optimizer): the weights keep another update, and the finding names the
    hook's line. (A hook that only clamps the weights is a constraint: see the weight-clipping test.)"""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def shrink(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.mul_(0.9)  # the line the finding names

    line = shrink.__code__.co_firstlineno + 4
    handle = opt.register_step_post_hook(shrink)
    try:
        report = _guarded(model, opt)
    finally:
        handle.remove()
    (found,) = _found(report)
    assert found.evidence["stage"] == "kept", found.message
    calls = {(c["call"], c["line"]) for c in found.evidence["written_by"]}
    assert ("mul_", line) in calls, found.evidence["written_by"]
    assert found.evidence["departed_count"] >= 2


def test_a_learning_rate_applied_twice_by_a_step_pre_hook_departs_at_the_kept_stage_and_names_the_hook() -> None:
    """A step pre-hook multiplies the gradients by a warm-up factor the scheduler already puts in
    the learning rate (here 10x): the gradients step_fn hands on agree with the reference's, the
    optimizer's own step from them too; the weights keep 10x its update."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def warm_up(optimizer: Any, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad.mul_(10.0)  # the line the finding names

    line = warm_up.__code__.co_firstlineno + 3
    handle = opt.register_step_pre_hook(warm_up)
    try:
        report = _guarded(model, opt)
    finally:
        handle.remove()
    assert report.by_name("gradients-depart-from-reference") == []
    (found,) = _found(report)
    assert found.evidence["stage"] == "kept" and found.evidence["written_kind"] == "gradients"
    assert all(abs(d["norm_ratio"] - 10) < 0.5 for d in found.evidence["departed"])
    (call,) = found.evidence["written_by"]
    assert (call["call"], call["line"]) == ("mul_", line)
    assert set(call["targets"]) == {f"{n}.grad" for n, _ in model.named_parameters()}


def test_an_update_zeroed_by_restoring_a_frozen_layer_departs_at_the_kept_stage() -> None:
    """The loop "freezes" the first layer by copying its saved weights back after each step
    (instead of leaving it out of the optimizer): the weights keep none of its update, and
    the finding names the copy; the other layer keeps its update."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    frozen = [p.detach().clone() for p in model[0].parameters()]

    def restore(i: int) -> None:
        with torch.no_grad():
            for p, saved in zip(model[0].parameters(), frozen, strict=True):
                p.data.copy_(saved)  # through .data: a tensor of its own, the same storage

    report = _guarded(model, opt, autocast=torch.bfloat16, after=restore)
    (found,) = _found(report)
    assert found.evidence["stage"] == "kept"
    assert {d["parameter"] for d in found.evidence["departed"]} == {"0.weight", "0.bias"}
    assert all(d["norm_ratio"] == 0 for d in found.evidence["departed"])
    (call,) = found.evidence["written_by"]
    assert call["call"] == "copy_" and set(call["targets"]) == {"0.weight", "0.bias"}


def _state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


RECIPES = {
    "fp32": {"opt": {}, "autocast": None},
    "bf16-autocast": {"opt": {}, "autocast": torch.bfloat16},
    "fp16-autocast-gradscaler": {"opt": {}, "autocast": torch.float16, "scaler": True},
    "fused-adamw": {"opt": {"fused": True}, "autocast": torch.bfloat16},
    "foreach-adamw": {"opt": {"foreach": True}, "autocast": torch.bfloat16},
    "accumulation": {"opt": {}, "autocast": torch.bfloat16, "accumulate": 2},
    "clipping": {"opt": {}, "autocast": torch.float16, "scaler": True, "clip": 0.05},
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_healthy_recipes_compare_both_update_stages_and_keep_a_plain_runs_numbers(name: str) -> None:
    recipe = RECIPES[name]
    autocast: torch.dtype | None = recipe["autocast"]
    accumulate: int = recipe.get("accumulate", 1)
    clip: float | None = recipe.get("clip")

    def run(watched: bool) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, fpdoctor.Report | None]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, **recipe["opt"])
        scaler = grad_scaler_class()("cpu", init_scale=2.0**10) if recipe.get("scaler") else None
        guard = fpdoctor.Sentinel(model, opt, scaler=scaler, accumulate=accumulate) if watched else None

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if accumulate == 1:
                opt.zero_grad()
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = nn.functional.cross_entropy(model(x).float(), y) / accumulate
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if clip is not None:
                if scaler is not None:
                    scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            return loss

        torch.manual_seed(7)
        for i in range(STEPS * accumulate):
            if guard is not None:
                guard.step(step, *_batch(i))
                continue
            step(*_batch(i))  # the plain loop does what the Sentinel does after step_fn
            if (i + 1) % accumulate == 0:
                if scaler is not None:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                if accumulate > 1:
                    opt.zero_grad(set_to_none=True)
        rng = torch.get_rng_state()
        return model, opt, rng, guard.report if guard is not None else None

    plain_model, plain_opt, plain_rng, _ = run(watched=False)
    model, opt, rng, report = run(watched=True)
    assert report is not None
    assert _found(report) == [] and report.by_name("gradients-depart-from-reference") == [], str(report)
    assert report.data["reference_step"]["update_steps"] == [1], report.data["reference_step"]
    assert report.data["reference_step"]["worst"]["cosine"] > 0.9
    assert "what the weights kept of it at step(s) 1" in report.data["judged"]
    # the observer changed none of the user's numbers and left nothing behind
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(_state(plain_opt), _state(opt), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(plain_rng, rng)
    assert set(opt.state) == set(model.parameters())
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in plain_opt.param_groups]
    assert sys.getprofile() is None


def test_the_kept_stage_is_judged_when_the_report_is_read_and_a_skipped_step_is_not_compared() -> None:
    """One step only: the report takes the weights as they are. A GradScaler that skips the first
    step (its loss scale overflows fp16) leaves no update to compare, and says so."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    guard.step(step, *_batch(0))
    assert sys.getprofile() is not None  # watching what writes the weights until the next step
    report = guard.report
    assert sys.getprofile() is None
    assert report.data["reference_step"]["update_steps"] == [1] and _found(report) == []

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler_class()("cpu", init_scale=2.0**30)
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)

    def scaled(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        return loss

    before = copy.deepcopy(model.state_dict())
    guard.step(scaled, *_batch(0))
    report = guard.report
    assert _found(report) == []
    judged = report.data["reference_step"]
    assert judged["update_steps"] == [] and "not finite" in judged["update_not_compared"]["1"]
    assert "the update not compared: the step's gradients are not finite" in report.data["judged"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the scaler skipped it


def test_updates_too_small_for_fp32_squares_keep_their_direction() -> None:
    """A converged run's updates of 1e-22: their squares underflow fp32, their cosine is still 1,
    and an update 1.5x the reference's is 1.5x."""
    from fpdoctor.numerics.training.reference_update import _update_rows

    ref = {"a": torch.full((64,), 1e-22), "b": torch.full((4,), -1e-21)}
    weights = {"a": torch.ones(64), "b": torch.ones(4)}
    rows = {d.name: d for d in _update_rows("kept", {"a": ref["a"] * 1.5, "b": ref["b"]}, ref, weights)}
    assert rows["a"].ratio == pytest.approx(1.5) and rows["a"].cosine == pytest.approx(1.0)
    assert rows["b"].ratio == pytest.approx(1.0) and rows["b"].cosine == pytest.approx(1.0)
    assert not any(d.departs() for d in rows.values())
    assert rows["a"].to_weight == pytest.approx(1.5e-22 * 8 / 8)  # |u| = 1.5e-22 * 8, |w| = 8


class _Needs(torch.optim.SGD):
    """An optimizer of the user's whose constructor takes an argument of its own."""

    def __init__(self, params: Any, factor: float) -> None:
        super().__init__(params, lr=0.01 * factor)


def test_an_optimizer_that_cannot_be_copied_leaves_the_update_uncompared_and_says_why() -> None:
    model = _model()
    opt = _Needs(model.parameters(), 2.0)
    report = _guarded(model, opt)
    assert _found(report) == [] and report.by_name("sentinel-error") == []
    why = report.data["reference_step"]["update_not_compared"]["1"]
    assert why.startswith("the optimizer could not be stepped on copies: TypeError"), why
    assert report.data["reference_step"]["compared_steps"] == [1]
    assert sys.getprofile() is None


def test_a_cause_seen_again_at_a_later_reference_step_is_one_finding_with_its_count() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def decay_again(i: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.9)

    guard = fpdoctor.Sentinel(model, opt, reference_every=2)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for i in range(4):  # reference steps 1 and 3, each judged when the next begins
        guard.step(step, *_batch(i))
        decay_again(i)
    (found,) = _found(guard.report)
    assert found.evidence["occurrences"] == 2 and found.evidence["steps"] == [1, 3]


def test_a_report_read_on_another_thread_takes_the_profile_function_off_the_training_thread() -> None:
    import threading

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    guard.step(step, *_batch(0))
    assert sys.getprofile() is not None
    reader = threading.Thread(target=lambda: guard.report)
    reader.start()
    reader.join(timeout=60)
    len([1])  # any call on this thread: the profile function sees it stopped and takes itself off
    assert sys.getprofile() is None


def test_a_weight_clipping_of_the_recipe_holds_the_reference_too_and_is_no_departure() -> None:
    """A WGAN critic: after each step the loop clips every weight to [-0.01, 0.01] (`p.data.clamp_`),
    as the recipe says; most weights sit at the bounds. The reference's weights are held by the same
    bounds before the kept stage is compared: no finding, and the OK line says the bounds were applied."""
    model = _model()
    opt = torch.optim.RMSprop(model.parameters(), lr=5e-3)

    def clip(i: int) -> None:
        for p in model.parameters():
            p.data.clamp_(-0.01, 0.01)  # the critic's weight clipping

    line = clip.__code__.co_firstlineno + 2
    clip(-1)
    report = _guarded(model, opt, after=clip)
    assert _found(report) == [], str(report)
    assert report.by_name("gradients-depart-from-reference") == []
    held = report.data["reference_step"]["constrained"]
    assert set(held) == {n for n, _ in model.named_parameters()}
    assert f"`clamp_` at {__file__}:{line}" in held["0.weight"]
    assert "held within bounds by your code" in dict(report.data["summary"])["reference step"]


def test_a_clamp_that_is_not_the_only_write_is_not_taken_for_a_constraint() -> None:
    """The loop decays the weights again and then clamps them: the decay changes the update, so the
    parameter is not replayed as bounded, and the kept stage still departs, naming the decay."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def decay_and_clamp(i: int) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 - 0.1)
                p.clamp_(-10.0, 10.0)

    report = _guarded(model, opt, autocast=torch.bfloat16, after=decay_and_clamp)
    (found,) = _found(report)
    assert found.evidence["stage"] == "kept"
    assert {c["call"] for c in found.evidence["written_by"]} == {"mul_", "clamp_"}
    assert "constrained" not in report.data["reference_step"]
