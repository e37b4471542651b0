"""Progress judged against the reference (numerics/training/progress.py): a loss that stopped
improving is put to an experiment from the step's state, the same steps in the run's recipe and in
fp32. Our classes: a bf16 residual stream that absorbs the learned correction (the gradients flow,
the weights move, the forward rounds their effect away: every NaN, update and gradient check says
OK), and an fp16 model whose gradients flush to zero. Not findings: a run that has converged, and a
run whose learning rate is too small (both recipes are flat: precision is not the question).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from tests import distillation

WINDOW = 20


class _Residual(nn.Module):
    """out = 256 x + 0.1 delta(x), |x| in [1, 2]: between 256 and 512 a bf16 value is a multiple of 2,
    so delta's 0.1-sized correction rounds away in the sum whatever delta learns."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.delta = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 256 + self.delta(x) * 0.1


def _run(model: nn.Module, dtype: torch.dtype, lr: float, steps: int = WINDOW, **kwargs) -> fpdoctor.Sentinel:
    model = model.to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(64, 16, generator=g) + 1) * torch.randn(64, 16, generator=g).sign()
    x = x.to(dtype)
    target = x.float() * 256 + torch.randn(64, 16, generator=g) * 0.5  # fp32: what delta has to learn
    guard = fpdoctor.Sentinel(model, opt, progress_window=WINDOW, reference_every=0, **kwargs)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        return loss

    for _ in range(steps):
        guard.step(step, x, target)
    return guard


def test_a_bf16_residual_that_rounds_the_correction_away_is_not_progressing():
    guard = _run(_Residual(), torch.bfloat16, lr=1e-2)
    (found,) = guard.report.by_name("training-not-progressing")
    ours, ref = found.evidence["recipe_loss"], found.evidence["reference_loss"]
    assert ours[0] - ours[1] <= 0.25 * (ref[0] - ref[1]) and ref[1] < 0.98 * ref[0]
    assert found.trial is not None and found.trial.tried and found.trial.after < found.trial.before
    (line,) = [text for key, text in guard.report.data["summary"] if key == "progress"]
    assert line.startswith(f"loss flat over steps 1-{WINDOW}") and "fp32 reference" in line


def test_the_same_model_in_fp32_progresses_and_is_not_judged():
    guard = _run(_Residual(), torch.float32, lr=1e-2)
    assert guard.report.by_name("training-not-progressing") == []
    assert "progress" not in guard.report.data  # the loss went down: no window was flat


def test_a_learning_rate_too_small_is_flat_in_both_recipes_and_no_finding():
    guard = _run(_Residual(), torch.float32, lr=1e-9)
    assert guard.report.by_name("training-not-progressing") == []
    (judged,) = guard.report.data["progress"]  # flat, put to the experiment, and fp32 did no better
    assert judged["reference"][0] - judged["reference"][1] < 0.02 * judged["reference"][0]


def test_a_converged_run_is_flat_and_no_finding():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    with torch.no_grad():  # at the least-squares solution already: the fp32 steps cannot do better
        model.weight.copy_(torch.eye(16) * 256)
        model.bias.zero_()
    guard = _run(model, torch.float32, lr=1e-4)
    assert guard.report.by_name("training-not-progressing") == []
    # the OK says what was judged, and that the reference step was off
    judged = guard.report.data["judged"]
    assert judged == guard.report.data["summary"][0][1]
    assert f"{WINDOW} optimizer step(s)" in judged and "no reference step: switched off" in judged
    assert "loss progress over 1 window(s)" in judged
    # and what a step judge does not see (an EMA kept in bf16 went OK unremarked): where to look
    assert "not judged: tensors updated outside the optimizer step" in judged and "fpdoctor trace" in judged


def test_an_ok_on_a_run_too_short_for_the_progress_check_says_so():
    guard = _run(nn.Linear(16, 16), torch.float32, lr=1e-3, steps=WINDOW - 1)
    assert guard.report.verdict == "ok"
    assert f"loss progress: not judged (it needs {WINDOW} finite steps)" in guard.report.data["judged"]


def test_the_user_state_is_left_as_the_step_made_it():
    model = _Residual().to(torch.bfloat16)
    plain = _Residual().to(torch.bfloat16)
    guard_run = _run(model, torch.bfloat16, lr=1e-2)
    opt = torch.optim.Adam(plain.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = ((torch.rand(64, 16, generator=g) + 1) * torch.randn(64, 16, generator=g).sign()).to(torch.bfloat16)
    target = x.float() * 256 + torch.randn(64, 16, generator=g) * 0.5
    for _ in range(WINDOW):
        opt.zero_grad()
        nn.functional.mse_loss(plain(x).float(), target.float()).backward()
        opt.step()
    assert guard_run.report.by_name("training-not-progressing")
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)  # the experiment ran on copies: the run's weights are its own


@pytest.mark.parametrize("bad", [-1, 2, 1.5])
def test_a_bad_progress_window_is_refused(bad):
    with pytest.raises(ValueError, match="progress_window"):
        fpdoctor.Sentinel(nn.Linear(2, 2), progress_window=bad)


def test_a_replay_that_gives_no_loss_is_said_not_judged_not_non_finite(monkeypatch):
    """A PINN under `fpdoctor watch` (trial78): its loss is made of the output's derivatives and of
    several forwards, so the replayed call gives no loss, NaN from the arms' first step. That is no
    loss to compare, not steps that went non-finite ("undecided: the steps went non-finite" on a run
    with no non-finite step)."""
    from fpdoctor.integrations.script import ScriptWatch
    from fpdoctor.numerics.training import progress

    monkeypatch.setattr(progress, "WINDOW", WINDOW)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-9)  # flat: every window is put to the experiment
    g = torch.Generator().manual_seed(1)
    watcher = ScriptWatch(notify=None, reference_every=0)
    with watcher:
        for _ in range(2 * WINDOW + 2):
            pts = torch.rand(64, 2, generator=g).requires_grad_(True)  # new collocation points each step
            u = model(pts)
            (du,) = torch.autograd.grad(u.sum(), pts, create_graph=True)
            residual = du[:, 1] - 0.1 * du[:, 0]  # u_t = a u_x
            boundary = model(torch.zeros(8, 2))
            loss = residual.pow(2).mean() + boundary.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    summary = dict(watcher.report.data["summary"])
    assert "progress" in summary, summary["judged"]
    assert "went non-finite" not in summary["judged"] and "non-finite" not in summary["progress"], summary
    assert "gives no loss to compare" in summary["progress"], summary["progress"]


def test_a_what_if_that_moves_no_weight_is_said_not_judged_not_a_fall_of_zero(monkeypatch):
    """Master weights of the script's own (trial120): the optimizer steps fp32 copies the forward never reads,
    and the script copies them into the bf16 model after the step. The what-if's arms step the same optimizer
    on copies of the model: nothing the forward reads moves, and "the loss falls by 0 (yours) and 0 (an fp32
    reference)" was printed as a measurement, the window counted as put to a reference."""
    from fpdoctor.integrations.script import ScriptWatch
    from fpdoctor.numerics.training import progress

    monkeypatch.setattr(progress, "WINDOW", WINDOW)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.SGD(masters, lr=1e-9)  # flat: every window is put to the experiment
    g = torch.Generator().manual_seed(1)
    watcher = ScriptWatch(notify=None, reference_every=0)
    with watcher:
        for _ in range(2 * WINDOW + 2):
            x = torch.randn(32, 4, generator=g)
            loss = model(x.to(torch.bfloat16)).float().pow(2).mean()
            model.zero_grad()
            loss.backward()
            for p, m in zip(model.parameters(), masters, strict=True):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters, strict=True):
                    p.copy_(m)
    summary = dict(watcher.report.data["summary"])
    assert "progress" in summary, summary["judged"]
    assert "falls by 0 (yours)" not in summary["progress"], summary["progress"]
    assert "moved no weight the model reads" in summary["progress"], summary["progress"]


def test_the_sentinel_applies_a_nan_loss_step_whose_gradients_are_finite() -> None:
    """A NaN in a loss term without gradient (a teacher's 0 * log 0): the update is finite and the
    user's loop would apply it; the sentinel applies it too, after its replay, and says so."""

    def run(guarded: bool) -> tuple[dict[str, torch.Tensor], fpdoctor.Sentinel | None]:
        teacher, student = distillation.teacher_and_student()
        opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
        guard = fpdoctor.Sentinel(student, opt, reference_every=0) if guarded else None
        g = torch.Generator().manual_seed(1)

        def step_fn(x: torch.Tensor) -> torch.Tensor:
            loss = distillation.loss(teacher, student, x)
            loss.backward()
            return loss

        for _ in range(6):
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            if guard is None:
                step_fn(x)
                opt.step()
            else:
                guard.step(step_fn, x)
        if guard is not None:
            guard.flush()
        return {k: v.clone() for k, v in student.state_dict().items()}, guard

    plain, _ = run(False)
    guarded, guard = run(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)
    assert guard is not None
    loss = next(f for f in guard.report.findings if f.name == "nonfinite-loss")
    assert "its gradients were finite, so its update was applied" in loss.message, loss.message
    assert "training-stalled" not in [f.name for f in guard.report.findings]


def test_a_first_order_fall_past_the_loss_itself_is_said_to_be_a_comparison() -> None:
    from fpdoctor.numerics.training.judge import _progress_text

    last = {
        "window": (201, 400),
        "recipe": (0.99, -7.0),
        "reference": (0.99, -7.02),
        "loss_is": "the loss to first order",
    }
    text = _progress_text(last)
    assert "falls by 7.99 (yours) and 8.01 (an fp32 reference), the loss to first order; a fall past the loss" in text
    assert "past the loss" not in _progress_text({**last, "recipe": (0.99, 0.5), "reference": (0.99, 0.4)})
