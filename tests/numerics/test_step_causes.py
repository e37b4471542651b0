"""One finding per cause, and a run that stops learning said as such: the step judge behind every
training front end, driven here through `fpdoctor.Sentinel`.

Each case is a training failure of a class users meet: an op that overflows fp16 on every step, a
learning rate that drives the loss up before it goes non-finite, a GradScaler calibrating from its
first scale (healthy), a GradScaler the user steps outside the guard."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.training import judge as step_judge


def _names(report) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in report.findings:
        out[f.name] = out.get(f.name, 0) + 1
    return out


def _fp16_overflow_every_step(steps: int) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = fpdoctor.Sentinel(model, opt)

    def step(x, y):
        opt.zero_grad()
        loss = (model(x.half() * 3000).float() - y).pow(2).mean()  # the backward's mm overflows fp16
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        guard.step(step, torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
    return guard.report


def test_a_cause_repeated_on_every_step_is_one_finding_with_its_count_and_replays_stop(monkeypatch):
    replays = []
    real = step_judge.replay
    monkeypatch.setattr(step_judge, "replay", lambda *a, **k: replays.append(1) or real(*a, **k))
    report = _fp16_overflow_every_step(12)
    names = _names(report)
    assert names["nonfinite-gradient"] == 1 and names["deterministic-nonfinite"] == 1
    gradient = report.by_name("nonfinite-gradient")[0]
    assert gradient.evidence["occurrences"] == 12
    assert gradient.evidence["first_step"] == 1 and gradient.evidence["last_step"] == 12
    assert "The same on 12 optimizer steps" in gradient.message
    assert len(replays) == step_judge.REPLAYS_PER_CAUSE  # the rest are counted under the cause, not replayed
    assert report.data["skipped_steps"] == 12
    assert set(report.data["not_replayed"]) == set(range(step_judge.REPLAYS_PER_CAUSE + 1, 13))
    # the reproduced steps' finding says the rest were counted under it (its "same on N" counts replays only)
    (verdict,) = report.by_name("deterministic-nonfinite")
    rest = 12 - step_judge.REPLAYS_PER_CAUSE
    assert f"{rest} later non-finite step(s) with the same symptoms" in verdict.message, verdict.message
    assert verdict.evidence["counted_without_replay"] == rest


def test_a_run_whose_every_step_is_skipped_is_said_to_stall_with_the_cause_replays_name():
    report = _fp16_overflow_every_step(12)
    stalled = report.by_name("training-stalled")
    assert len(stalled) == 1 and stalled[0].severity.value == "error"
    assert stalled[0].message.startswith("12 of the last 12 optimizer steps were skipped")
    assert "the optimizer never ran" in stalled[0].message
    assert "aten.mm" in stalled[0].message  # the op every replay named
    assert stalled[0].evidence["count"] == 12 and stalled[0].evidence["last_good_step"] is None


def _lr_blow_up(**sentinel: object) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = fpdoctor.Sentinel(model, opt, **sentinel)

    def step(x, y):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(36):
        if i == 12:  # a learning rate far too high from here on
            for group in opt.param_groups:
                group["lr"] = 50.0
        guard.step(step, torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(p.grad is None for p in model.parameters()) and opt.param_groups[0]["lr"] == 50.0
    report = guard.report
    # the trial ran on stand-ins: the user's weights, gradients and optimizer are as they were
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return report


def test_a_loss_that_climbs_before_it_goes_nonfinite_points_the_stall_at_the_learning_rate():
    report = _lr_blow_up()
    spikes = report.by_name("loss-spike")
    assert len(spikes) == 1  # one climbing episode, not one finding per step of it
    assert spikes[0].evidence["occurrences"] >= 3
    # its fix names the step and the run's rate (trial78: "consider a lower learning rate", no value)
    assert f"step {spikes[0].evidence['step']}'s batch" in spikes[0].fix and "(now 50:" in spikes[0].fix
    stalled = report.by_name("training-stalled")[0]
    first_bad = report.by_name("nonfinite-loss")[0].evidence["step"]
    assert spikes[0].evidence["step"] < first_bad
    assert "learning rate" in stalled.message and "learning rate" in stalled.fix
    assert stalled.evidence["last_good_step"] == first_bad - 1
    # the advice was tried before it was printed: from the climb's first step, at lower rates
    tried = stalled.evidence["lr_tried"]
    assert tried["from_step"] == spikes[0].evidence["step"] and tried["lr"] == 50.0
    assert not tried["as_is"]["losses"][-1] <= tried["as_is"]["losses"][0]  # at the run's rate the loss climbs
    assert tried["fix_lr"] == 0.05 and tried["lowered"][-1] == {**tried["lowered"][-1], "lr": 0.05, "settles": True}
    assert all(not arm["settles"] for arm in tried["lowered"][:-1])  # 5 and 0.5 were tried and did not help
    assert stalled.fix.startswith("Lower the learning rate to 0.05 or below (the run's 50 / 1000)")
    assert "Checked: from the climb's first step, 4 steps at 0.05 stayed finite" in stalled.fix
    assert "lr 0.05 keeps them finite and the loss from climbing (checked)" in stalled.message


def test_the_learning_rate_trial_fires_no_global_optimizer_hook():
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    stepped: list[int] = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, *_: stepped.append(id(o))),
        register_optimizer_step_post_hook(lambda o, *_: stepped.append(id(o))),
    ]
    try:
        report = _lr_blow_up()
    finally:
        for handle in handles:
            handle.remove()
    assert "lowered" in report.by_name("training-stalled")[0].evidence["lr_tried"]  # the trial ran
    assert stepped and len(set(stepped)) == 1  # only the user's optimizer, never a stand-in's


def test_a_learning_rate_that_cannot_be_tried_says_why():
    stalled = _lr_blow_up(replay=False).by_name("training-stalled")[0]
    assert stalled.evidence["lr_tried"] == {"not_tried": "replays are off"}
    assert "Lowering the learning rate was not tried: replays are off." in stalled.message
    assert "(not tried: replays are off)" in stalled.fix


def test_a_lower_learning_rate_that_was_tried_and_did_not_help_is_not_printed_as_the_fix():
    from fpdoctor.numerics.training.findings import stall_finding
    from fpdoctor.numerics.training.lr_whatif import Arm, LrTrial

    climbing = [1.0, 10.0, 100.0, 1e3, 1e4]
    trial = LrTrial(3, 4, Arm(1.0, climbing), [Arm(0.1, climbing), Arm(0.01, climbing), Arm(0.001, [1.0, 2.0], 2)])
    spike = fpdoctor.Finding(
        code="TRN", name="loss-spike", severity=fpdoctor.Severity.WARNING, title="", message="",
        evidence={"step": 3, "loss": 9.0, "mean": 1.0},
    )  # fmt: skip
    outcome = step_judge.StepOutcome(5, float("nan"), finite=False, skipped=True)
    stalled = stall_finding(
        steps=5, window=[outcome], first_skip=5, last_good=4, found=[spike], here={}, lr_trial=trial
    )
    assert not stalled.fix.startswith("Lower the learning rate")
    assert (
        "Tried: learning rates of 0.1, 0.01, 0.001" in stalled.fix and "lowering it alone is not the fix" in stalled.fix
    )
    assert "at lr 0.001 they went non-finite after 1 of them" in stalled.message


def _amp_run(steps: int, *, scale_x: float) -> fpdoctor.Report:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")  # starts at 65536: the first steps overflow by design
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)

    def step(x, y):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x * scale_x)
        loss = (out.float() - y).pow(2).mean()
        scaler.scale(loss).backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        guard.step(step, torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g))
    return guard.report


def test_a_grad_scaler_calibrating_from_its_first_scale_is_not_a_stall():
    report = _amp_run(12, scale_x=1000.0)
    amp = report.data["amp"]
    assert amp["skipped_steps"] >= 3  # calibration: the scaler's own business
    assert report.by_name("training-stalled") == []
    assert report.verdict == "ok"
    assert amp["min_scale"] is not None and amp["min_scale"] <= amp["scale"]


@pytest.mark.parametrize("bad_step", [3])
def test_a_grad_scaler_the_user_steps_outside_the_guard_keeps_its_gradients(bad_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = fpdoctor.Sentinel(model)  # no optimizer: the user's own scaler steps it

    def step(x, y, bad):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = (out.float() - y).pow(2).mean()
        if bad:
            loss = loss * float("nan")
        scaler.scale(loss).backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(1, 6):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        guard.step(step, x, y, i == bad_step)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)  # raised "No inf checks were recorded" when the sentinel dropped the gradients
        scaler.update()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert unchanged == (i == bad_step)  # the scaler skipped the bad step itself, and only it
    report = guard.report
    assert report.by_name("deterministic-nonfinite")[0].evidence["step"] == bad_step


def test_a_run_that_diverges_from_its_first_steps_is_a_spike():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=5.0)  # far too high from the start
    guard = fpdoctor.Sentinel(model, opt)

    def step(x, y):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(1)
    losses = [
        float(guard.step(step, torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)).detach())
        for _ in range(6)
    ]
    spikes = guard.report.by_name("loss-spike")
    assert max(losses[1:]) > 100 * losses[0]  # the reproduction diverges within 6 steps
    assert len(spikes) == 1 and spikes[0].evidence["step"] <= 6


def test_a_nan_made_after_the_model_at_a_named_op_keeps_that_ops_checked_fix():
    """A margin head's acos at 1 (trial80: ArcFace under fp16 autocast): the replay names the op in
    the loss code and checks its clamp; the verdict said it was made "in the loss computation (every
    target ignored, a mean over an empty selection ...)", examples of another class, and replaced
    the op's checked fix with "check the loss code"."""
    from fpdoctor import catalog
    from fpdoctor.numerics.training import findings as step_findings
    from fpdoctor.numerics.training.replay import ReplayResult
    from fpdoctor.report.model import Trial

    checked = Trial.checked("x.clamp(-1 + eps, 1 - eps)", metric="the gradient", before="inf", after="finite")
    culprit = catalog.make(
        "nonfinite-produced",
        message="the backward of aten.acos.default (AcosBackward0) produced 4 -inf of 4096 values.",
        where={"module": None, "op": "aten.acos.default", "phase": "backward"},
        evidence={"experiment": {"verdict": "origin"}},
        fix="keep the argument inside (-1, 1): x.clamp(-1 + eps, 1 - eps), eps = 0.000977 (checked)",
        trial=checked,
    )
    result = ReplayResult("deterministic-nonfinite", culprit=culprit, evidence={"made_after_outputs": True})
    (verdict,) = step_findings.verdict_findings(7, result, {}, micro_batches=False, kind="nan")
    assert verdict.fix == culprit.fix and verdict.trial == checked
    assert "every target ignored" not in verdict.message and "at the op named above" in verdict.message


def test_a_loss_made_non_finite_after_the_outputs_with_no_op_named_sends_to_trace() -> None:
    """A compute_loss of the script's own (a Hugging Face Trainer's) is not in the callback's replay, which
    runs the model: no op is named. The fix was "guard the denominator" whatever the loss code did (a log
    of 0 in a label smoothing): it is `fpdoctor trace`, which follows the loss code op by op."""
    from fpdoctor.numerics.training import findings as step_findings
    from fpdoctor.numerics.training.replay import ReplayResult

    result = ReplayResult("deterministic-nonfinite", culprit=None, evidence={"made_after_outputs": True})
    (verdict,) = step_findings.verdict_findings(3, result, {}, micro_batches=False, kind="nan")
    assert (
        verdict.fix.startswith("Run `fpdoctor trace -- <your script>`") and "guard the denominator" not in verdict.fix
    )
    assert verdict.trial is not None and not verdict.trial.tried and "trace runs both" in verdict.trial.reason
    assert "named op" not in verdict.title and "no op named" in verdict.title  # the title claimed one


def test_a_recipe_check_that_fails_is_said_and_the_report_stands(monkeypatch):
    """The recipe's checks run when the report is built: one that raises (ours) is said under not_checked,
    and the report keeps every other finding; it never raises into the caller."""
    from fpdoctor.numerics.training.recipe import RecipeChecks

    def broken(*args, **kwargs):
        raise RuntimeError("a recipe check of ours failed")

    monkeypatch.setattr(RecipeChecks, "findings", broken)
    report = _fp16_overflow_every_step(4)
    assert "a recipe check of ours failed" in report.data["not_checked"]["optimizer recipe"]
    assert _names(report)["deterministic-nonfinite"] == 1
