"""The training sentinel: counts, both replay verdicts, spikes, checkpoints, no perturbation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.training import findings as sentinel_findings


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return model, opt


def data(n: int = 6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def step_fn(model, opt):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return step


def test_a_one_off_fault_is_transient_and_skipped():
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt, reference_every=0)  # step_fn's calls counted: no reference step
    plain = step_fn(model, opt)
    calls = {"n": 0}

    def faulty(x, y):
        loss = plain(x, y)
        calls["n"] += 1
        if calls["n"] == 3:  # a bit flip in one gradient, once: the replay will not see it
            model[0].weight.grad[0, 0] = float("nan")
        return loss

    batches = data()
    for x, y in batches[:2]:
        guard.step(faulty, x, y)
    before = [p.detach().clone() for p in model.parameters()]
    guard.step(faulty, *batches[2])
    after = list(model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing reached the weights
    report = guard.report
    names = [f.name for f in report.findings]
    assert names == ["nonfinite-gradient", "transient-fault-suspected"]
    transient = report.by_name("transient-fault-suspected")[0]
    assert transient.where["step"] == 3 and transient.where["device"] == "cpu" and transient.where["host"]
    assert report.data["skipped_steps"] == 1 and report.data["nonfinite_steps"] == 1
    assert report.data["verdicts"] == {3: "transient-fault-suspected"}
    guard.step(faulty, *batches[3])  # training goes on
    assert guard.report.data["last_good_step"] == 4


def test_a_numerical_bug_reproduces_and_names_the_op():
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt)

    def bad(x, y):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = (out / (out - out)).mean()  # 0/0 every time
        loss.backward()
        return loss

    guard.step(bad, *data()[0])
    report = guard.report
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.where["op"] == "aten.div.Tensor" and verdict.where["phase"] == "forward"
    assert verdict.where["step"] == 1
    assert report.by_name("nonfinite-loss")
    assert report.exit_code == 1


def _scaled_step(model: nn.Module, opt: torch.optim.Optimizer, level: dict[str, float], *, zeroed: bool = False):  # type: ignore[no-untyped-def]
    """A step whose loss is the batch's MSE times `level["k"]` as it is when the step runs (`zeroed`: the
    model's output zeroed first)."""

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        out = model(x) * 0 if zeroed else model(x)
        loss = nn.functional.mse_loss(out, y) * level["k"]
        loss.backward()
        return loss

    return step


def _losses(levels: list[float]) -> fpdoctor.Report:
    """Steps whose loss is the same batch's times each level in turn (the model's output zeroed)."""
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt)
    x, y = data()[0]
    scale = {"k": 1.0}
    step = _scaled_step(model, opt, scale, zeroed=True)

    for level in levels:
        scale["k"] = level
        guard.step(step, x, y)
    return guard.report


FLAT = [1.0 + 0.01 * (i % 3) for i in range(12)]


def test_loss_spike():
    spikes = _losses([*FLAT, 50.0]).by_name("loss-spike")
    assert len(spikes) == 1 and spikes[0].where["step"] == 13


def test_a_jump_of_a_loss_converged_far_below_its_start_is_not_a_spike():
    """Converged from 2.4 to 3e-5, a batch at 2.4e-4 is 8x the recent mean and many sigmas off, and
    still noise (a warning with "clip the gradients" on a run that converged, as printed before)."""
    converged = [2.4, 1.0, 0.3] + [3e-5 * (1.0 + 0.01 * (i % 3)) for i in range(36)]  # the start out of the window
    assert not _losses([*converged, 2.4e-4]).by_name("loss-spike")
    assert _losses([*converged, 0.5]).by_name("loss-spike")  # back to a fifth of where it started: a spike
    # started at 1e4 (unscaled targets), converged to 1: a jump to 100 is a spike, far below the start
    from_far = [1e4, 300.0, 20.0] + [1.0 + 0.01 * (i % 3) for i in range(36)]
    assert _losses([*from_far, 100.0]).by_name("loss-spike")


def test_a_stall_called_on_the_first_steps_is_withdrawn_once_the_optimizer_ran_most_of_a_window():
    """Three NaN steps first: "the optimizer never ran" (training-stalled). One finite step after them
    does not make it wrong yet; a window mostly applied does, and then it leaves the report."""
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt)
    x, y = data()[0]
    level = {"k": math.nan}
    step = _scaled_step(model, opt, level)

    stalled = []
    for i in range(10):
        level["k"] = math.nan if i < 3 else 1.0
        guard.step(step, x, y)
        stalled.append(bool(guard.report.by_name("training-stalled")))
    assert stalled[2] and stalled[3], stalled  # called at step 3, still there after one finite step
    assert not stalled[-1], stalled  # steps 4-10 applied: no stall after all


def test_stalls_of_one_cause_in_several_episodes_are_one_finding_that_counts_them():
    """A run that stalls, recovers and stalls again three times for the same reason: one training-stalled
    finding (a report of six alike buried the cause), its episodes counted, the steps each began at."""
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt)
    x, y = data()[0]
    level = {"k": 1.0}
    step = _scaled_step(model, opt, level)

    for i in range(90):
        # NaN on steps 1-3 (a stall withdrawn once the optimizer ran), then on steps 16-30, 46-60, 76-90
        level["k"] = math.nan if i < 3 or i % 30 >= 15 else 1.0
        guard.step(step, x, y)
    stalls = guard.report.by_name("training-stalled")
    assert len(stalls) == 1, [f.message for f in stalls]
    assert stalls[0].evidence["episodes"] == 3 and "stalled so 3 times" in stalls[0].message, stalls[0].message


def test_checkpoint_of_the_last_good_step(tmp_path):
    model, opt = make()
    path = tmp_path / "last-good.pt"
    guard = fpdoctor.Sentinel(model, opt, checkpoint_path=str(path), checkpoint_every=2)
    step = step_fn(model, opt)
    for x, y in data(4):
        guard.step(step, x, y)
    state = torch.load(path, weights_only=True)
    assert state["step"] == 4 and set(state["model"]) == set(model.state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["last-good.pt"]  # no temporary file left behind


def test_the_sentinel_does_not_perturb_training():
    runs = []
    for guarded in (False, True):
        model, opt = make(seed=3)
        torch.manual_seed(7)  # dropout draws from the global generator
        step = step_fn(model, opt)
        guard = fpdoctor.Sentinel(model, opt)
        losses = []
        for x, y in data():
            if guarded:
                losses.append(guard.step(step, x, y).detach())
            else:
                losses.append(step(x, y).detach())
                opt.step()
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, p0), (l1, p1) = runs
    assert all(torch.equal(a, b) for a, b in zip(l0, l1, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(p0, p1, strict=True))


def test_validation():
    import pytest

    model, opt = make()
    with pytest.raises(ValueError, match="checkpoint_path"):
        fpdoctor.Sentinel(model, opt, checkpoint_every=5)


def test_transient_fault_names_the_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, opt = make()
        guard = fpdoctor.Sentinel(model, opt)
        plain = step_fn(model, opt)

        def once(x, y):
            loss = plain(x, y)
            if not hasattr(once, "done"):
                once.done = True
                model[0].bias.grad[0] = float("inf")
            return loss

        guard.step(once, *data()[0])
        finding = guard.report.by_name("transient-fault-suspected")[0]
        assert finding.where["rank"] == 0 and "rank 0" in finding.message
    finally:
        dist.destroy_process_group()


def test_the_report_keeps_a_bounded_timeline_with_every_event():
    from fpdoctor.numerics.training import sentinel as sentinel_module

    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt, reference_every=0)  # step_fn's calls counted: no reference step
    plain = step_fn(model, opt)
    calls = {"n": 0}

    def faulty(x, y):
        loss = plain(x, y)
        calls["n"] += 1
        if calls["n"] == 7:
            model[0].weight.grad[0, 0] = float("nan")
        return loss

    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        guard.step(faulty, torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
    full = guard.report.data["timeline"]
    assert full["step"] == list(range(1, 41)) and len(full["loss"]) == 40
    assert full["nonfinite"] == [7] and full["amp_skipped"] == [] and full["spikes"] == []
    thin = sentinel_findings.timeline(guard.history, guard.findings, 10)
    assert len(thin["step"]) <= 11 and 7 in thin["step"]  # thinned, but the bad step is kept
    assert sentinel_module.TIMELINE_POINTS >= 1000
    assert full["grad_norm_step"] == [1, 11, 21, 31] and "scale" not in full  # no GradScaler: no scale


def test_the_timeline_gradient_norm_is_the_unscaled_norm_clip_grad_norm_gives():
    """Every GRAD_NORM_EVERY-th step the timeline holds the gradients' total norm, as
    clip_grad_norm_ would compute it: after GradScaler's unscale, not the scaled one, and the
    scale beside it."""
    from fpdoctor.numerics.training.sentinel import GRAD_NORM_EVERY

    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    # step_fn's calls counted: no reference step
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler, reference_every=0)
    seen = {}

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        seen[len(seen) + 1] = float(torch.nn.utils.get_total_norm(grads)) / scaler.get_scale()
        return loss

    g = torch.Generator().manual_seed(5)
    for _ in range(GRAD_NORM_EVERY + 1):
        guard.step(step, torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g))
    timeline = guard.report.data["timeline"]
    assert timeline["grad_norm_step"] == [1, GRAD_NORM_EVERY + 1]
    for step_number, norm in zip(timeline["grad_norm_step"], timeline["grad_norm"], strict=True):
        assert norm == pytest.approx(seen[step_number], rel=1e-5)
    assert timeline["scale"][0] == 1024.0


def _spiking(after: float) -> fpdoctor.Report:
    """A flat loss, one step 50x at step 13, then 12 steps at `after` times the level."""
    return _losses([*FLAT, 50.0, *(after + 0.01 * (i % 3) for i in range(13, 25))])


def test_a_spike_the_loss_comes_back_from_is_noise_said_once_not_a_warning():
    report = _spiking(after=1.0)
    (spike,) = report.by_name("loss-spike")
    assert spike.severity is fpdoctor.Severity.INFO and spike.evidence["steps"] == [13], spike
    assert report.verdict == "ok", str(report)


def test_a_spike_the_loss_stays_up_after_is_a_warning():
    report = _spiking(after=3.0)
    (spike,) = report.by_name("loss-spike")
    assert spike.severity is fpdoctor.Severity.WARNING and spike.where["step"] == 13, spike
