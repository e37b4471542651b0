"""The sentinel's own failures and the user's: a skipped step stays skipped whatever fails after the
decision, and what the user's optimizer raises reaches the user once, unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.training import findings as sentinel_findings


def _step(model, opt):
    def step(x):
        opt.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    return step


def test_a_failure_while_reporting_a_skipped_step_never_applies_it(monkeypatch):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt, replay=False)

    def broken(*args, **kwargs):
        raise KeyError("reporting failed")

    monkeypatch.setattr(sentinel_findings, "rank_finding", broken)
    before = [p.detach().clone() for p in model.parameters()]
    guard.step(_step(model, opt), torch.full((8, 4), float("nan")))
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    assert guard.skipped == 1
    assert [f.name for f in guard.report.findings] == ["sentinel-error"]


class _FailsOnce(torch.optim.SGD):
    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("out of memory in the optimizer")
        return super().step(closure)


def test_the_users_optimizer_error_reaches_the_user_once_and_is_not_retried():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = _FailsOnce(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt, replay=False)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="out of memory in the optimizer") as raised:
        guard.step(_step(model, opt), torch.randn(8, 4))
    assert type(raised.value) is RuntimeError
    assert opt.calls == 1
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert guard.report.findings == []
    guard.step(_step(model, opt), torch.randn(8, 4))  # the next step goes on as usual
    assert opt.calls == 2 and guard.steps == 2


def _inner_run(guarded: bool, with_scaler: bool):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if with_scaler else None
    guard = fpdoctor.Sentinel(model, opt) if guarded else None

    def step(x, big):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        if scaler is None:
            loss.backward()
            opt.step()  # step_fn steps the optimizer itself
        else:
            scaler.scale(loss * big).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    g = torch.Generator().manual_seed(1)
    for i in range(6):
        x = torch.randn(8, 4, generator=g)
        big = 1e38 if i == 3 else 1.0  # an overflow step_fn's own scaler skips
        if guard is None:
            step(x, big)
        else:
            guard.step(step, x, big)
    params = [p.detach().clone() for p in model.parameters()]
    return params, guard, scaler


@pytest.mark.parametrize("with_scaler", [False, True])
def test_a_step_fn_that_steps_itself_is_not_stepped_again(with_scaler):
    plain, _, plain_scaler = _inner_run(False, with_scaler)
    guarded, guard, scaler = _inner_run(True, with_scaler)
    assert all(torch.equal(a, b) for a, b in zip(plain, guarded, strict=True))
    if with_scaler:
        assert scaler.get_scale() == plain_scaler.get_scale()
        assert guard.report.data["amp"]["skipped_steps"] == 1
    names = [f.name for f in guard.report.findings]
    assert names == ["sentinel-error"] and "step_fn stepped the optimizer itself" in guard.report.findings[0].message


def test_a_batch_that_holds_nan_is_called_bad_data_not_a_bug_at_an_op():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = fpdoctor.Sentinel(model, opt)
    x = torch.randn(8, 4)
    x[1, 2] = float("nan")
    guard.step(_step(model, opt), x)
    verdict = guard.report.by_name("deterministic-nonfinite")[0]
    assert "bad data" in verdict.title and "numerical bug" not in verdict.title
    assert verdict.evidence["step"] == 1 and verdict.evidence["kind"] == "nan"
    assert verdict.fix.startswith("Check the data pipeline") and "every rank" not in verdict.fix, verdict.fix


def test_bad_data_named_by_its_dataset_items_is_fixed_at_its_source_and_skipped_on_every_rank_together():
    """Where the loader named the items, the fix names them; under torch.distributed a skip of one rank's
    own leaves the others waiting in the all-reduce, so the fix says the skip is agreed across ranks."""
    from fpdoctor import catalog
    from fpdoctor.numerics.training.findings import _bad_data_fix

    held = catalog.make(
        "nonfinite-input", message="an input held +inf",
        evidence={"origin": "input", "rows": {"indices": [7], "of": 32, "dataset_indices": [967]}},
    )  # fmt: skip
    alone = _bad_data_fix(held, distributed=False)
    assert alone.startswith("Fix dataset item 967 where it is made") and "every rank" not in alone, alone
    assert "every rank must skip that step together" in _bad_data_fix(held, distributed=True)


def test_fp16_adam_eps_is_named_and_dead_weights_are_said_once(monkeypatch):
    from fpdoctor.numerics.training import judge as sentinel_module

    replays = []
    real_replay = sentinel_module.replay
    monkeypatch.setattr(sentinel_module, "replay", lambda *a, **k: replays.append(1) or real_replay(*a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)  # eps is 0 in fp16
    guard = fpdoctor.Sentinel(model, opt)
    assert [f.name for f in guard.findings] == ["fp16-adam-eps"]  # said before the first step

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    g = torch.Generator().manual_seed(0)
    for _ in range(6):
        guard.step(step, torch.randn(8, 16, generator=g).half(), torch.randn(8, 1, generator=g).half())
    report = guard.report
    assert [f.name for f in report.findings] == ["fp16-adam-eps", "deterministic-nonfinite"]
    dead = report.findings[1]
    assert "cannot continue" in dead.title and dead.evidence["applied_step"] == guard.last_good_step
    assert dead.where["phase"] == "optimizer" and dead.evidence["step"] == guard.last_good_step + 1
    assert guard.skipped == 6 - guard.last_good_step and replays == []


def test_a_replay_of_no_micro_batch_is_no_verdict_on_the_machine():
    """An empty window ran nothing, which read as a finite replay: transient-fault-suspected."""
    from torch import nn

    from fpdoctor.numerics.training.replay import replay

    model = nn.Linear(2, 1)
    result = replay(model, list(model.parameters()), lambda: None, [], [])
    assert result.verdict == "replay-failed" and (result.error or "").startswith("not replayed: no micro-batch")
