"""A composite torch computes in a stable form (log of a sigmoid, of 1 - a sigmoid, of a softmax, of
a sum of exps) that made NaN/Inf: the fix is the stable form, checked in the run's own dtype on the
step's inputs and on them scaled to the dtype's largest values, not the lines in fp32 (which only
move the edge: a confident classifier's fp32 sigmoid is 1.0 past z = 17). The fix applied as
printed keeps the loss finite where the fp32 lines do not."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor
from fpdoctor.numerics.engine import stable


def _confident(dim: int = 1) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(16, dim).half()
    with torch.no_grad():
        model.weight.mul_(20.0)  # logits of tens: sigmoid and softmax saturate in fp16
    x = torch.randn(64, 16).half()
    y = torch.randint(0, max(dim, 2), (64,))
    return model, x, y


def _first_fix(step) -> fpdoctor.Finding:  # type: ignore[no-untyped-def]
    with fpdoctor.Trace() as tr:
        step()
    first = tr.report.findings[0]
    assert first.name == "nonfinite-produced", str(tr.report)
    return first


def test_a_hand_written_binary_cross_entropy_gets_logsigmoid_checked_at_the_formats_range() -> None:
    model, x, y = _confident()
    y = y.half()

    def step() -> None:
        p = torch.sigmoid(model(x).squeeze(-1))
        (-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).mean().backward()

    first = _first_fix(step)
    assert "F.logsigmoid(" in first.fix and "binary_cross_entropy_with_logits" in first.fix, first.fix
    assert "in fp32, finite on this step's inputs, are non-finite on those scaled inputs" in first.fix
    assert first.trial is not None and first.trial.tried and "F.logsigmoid" in first.trial.changed, first.trial
    # as printed: both sides in their stable form, in fp16, even with logits scaled far past the step's
    z = model(x).squeeze(-1) * 100
    loss = -(y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)).mean()
    assert torch.isfinite(loss)


def test_a_focal_loss_with_both_halves_on_one_line_gets_the_whole_cross_entropy_and_then_trains() -> None:
    """trial134: the fix named the half that broke (log(1 - p)); applied alone, the other half (log(p)) broke
    eleven steps later. Both halves on the line: the fix is the cross-entropy from the logits, which trains."""
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).half()
    model = nn.Linear(8, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)

    def step(fixed: bool = False) -> float:
        z = model(x.half()).squeeze(-1)
        if fixed:
            bce = F.binary_cross_entropy_with_logits(z, y, reduction="none")
            p_t = torch.exp(-bce)
        else:
            p = torch.sigmoid(z)
            bce = -(y * p.log() + (1 - y) * (1 - p).log())
            p_t = y * p + (1 - y) * (1 - p)
        loss = (bce * (1 - p_t) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return float(loss.detach())

    with fpdoctor.Trace() as tr:
        losses = [step() for _ in range(60)]
    assert not all(math.isfinite(v) for v in losses)  # the premise: the confident classifier breaks
    first = tr.report.findings[0]
    assert first.fix.startswith("Write F.binary_cross_entropy_with_logits(z, y, reduction='none')"), first.fix
    assert "The other side likewise" not in first.fix and first.trial is not None and first.trial.tried
    assert "On the step's loss: with F.logsigmoid(-z)" in first.fix, first.fix  # checked on the loss, not only the op
    torch.manual_seed(0)
    model = nn.Linear(8, 1).half()
    opt = torch.optim.SGD(model.parameters(), lr=2.0)
    fixed = [step(fixed=True) for _ in range(300)]  # as printed, five times as long: finite throughout
    assert all(math.isfinite(v) for v in fixed) and fixed[-1] < fixed[0], fixed[::50]


def test_a_cross_entropy_written_as_log_of_softmax_gets_log_softmax() -> None:
    model, x, y = _confident(dim=10)

    def step() -> None:
        logp = torch.log(torch.softmax(model(x), dim=-1))
        (-logp[torch.arange(len(y)), y]).mean().backward()

    first = _first_fix(step)
    assert "F.log_softmax(x, dim)" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried, first.trial
    assert torch.isfinite(F.log_softmax(model(x) * 100, dim=-1)).all()


def test_only_the_exact_composites_have_a_stable_form() -> None:
    assert stable.form_of(["sigmoid", "rsub", "log"]) is not None
    assert stable.form_of(["exp", "sum", "log"]) is not None
    assert stable.form_of(["sigmoid", "mul", "log"]) is None  # log(2 * sigmoid(z)): no form of torch's
    assert stable.form_of(["log"]) is None


class _Variance(nn.Module):
    """A variance head with softplus by hand; its bias puts exp(s) below bf16's spacing at 1."""

    def __init__(self, written: str) -> None:
        super().__init__()
        self.body, self.raw = nn.Linear(4, 32), nn.Linear(32, 1)
        self.written = written
        with torch.no_grad():
            self.raw.bias.fill_(-12.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.raw(torch.tanh(self.body(x)))
        if self.written == "1 + exp":
            return torch.log(1 + torch.exp(s))
        if self.written == "exp + 1":
            return torch.log(torch.exp(s) + 1)
        if self.written == "2 + exp":
            return torch.log(2 + torch.exp(s)) - 0.6931
        return F.softplus(s)


def _variance_step(written: str) -> tuple[nn.Module, torch.Tensor, object]:
    torch.manual_seed(0)
    model, x = _Variance(written).to(torch.bfloat16), torch.rand(64, 4).to(torch.bfloat16)

    def step() -> None:
        torch.log(model(x)).mean().backward()  # a Gaussian NLL's log(var)

    return model, x, step


@pytest.mark.parametrize("written", ["1 + exp", "exp + 1"])
def test_a_softplus_by_hand_whose_one_plus_rounds_to_one_gets_log1p_checked_downstream(written: str) -> None:
    """log(1 + exp(s)) is 0 in bf16 for s < -6, and the loss's log(var) makes -inf lines later: the
    fix is the stable form at the softplus's line, checked by re-running the ops after it on its value."""
    _, _, step = _variance_step(written)
    first = _first_fix(step)
    assert "torch.log1p(x)" in first.fix and "F.softplus(s)" in first.fix, first.fix
    assert "output is then finite" in first.fix
    assert first.trial is not None and first.trial.tried and "log1p" in first.trial.changed, first.trial
    # as printed, still in bf16: the loss is finite
    model, x, _ = _variance_step("softplus")
    assert torch.isfinite(torch.log(model(x)).mean())


def test_log_of_two_plus_a_small_value_is_not_the_softplus_form() -> None:
    assert stable.form_of(["add", "log", "log"]) is not None  # the packets alone would match ...
    _, _, step = _variance_step("2 + exp")
    with fpdoctor.Trace() as tr:
        step()
    assert tr.report.findings and tr.report.findings[0].name == "nonfinite-produced"  # log of a negative
    assert not any("log1p" in (f.fix or "") for f in tr.report.findings)  # ... its arguments do not


def test_lines_in_fp32_that_fail_on_the_steps_own_inputs_are_said_to_fail_there() -> None:
    """Logits of hundreds: fp32's sigmoid is 1.0 past z = 17, so the lines in fp32 are non-finite on
    the step's own inputs, not only on them scaled; the fix says what was checked where."""
    torch.manual_seed(0)
    model = nn.Linear(16, 1).half()
    with torch.no_grad():
        model.weight.mul_(400.0)
    x, y = torch.randn(64, 16).half(), torch.randint(0, 2, (64,)).half()

    def step() -> None:
        p = torch.sigmoid(model(x).squeeze(-1))
        (-(y * torch.log(p) + (1 - y) * torch.log(1 - p))).mean().backward()

    fix = _first_fix(step).fix
    assert "non-finite on this step's inputs too (checked)" in fix, fix
    assert "finite on this step's inputs, are" not in fix


@pytest.mark.parametrize("scale", [3.0, 2000.0])  # cosh past fp32's range only, and past fp64's too
def test_a_log_cosh_loss_gets_its_form_without_cosh_even_where_fp64_overflows(scale: float) -> None:
    """A log-cosh regression loss on residuals of hundreds (prices): cosh overflows past |x| ~ 89 in fp32.
    At residuals past ~710 it overflows in fp64 too, where 'no precision change is the fix' had no fix
    to give; the form without cosh is the fix either way, and applied as printed the loss is finite."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = torch.randn(128, 8), scale * 100.0 * torch.randn(128, 1)

    def step() -> None:
        torch.log(torch.cosh(model(x) - y)).mean().backward()

    first = _first_fix(step)
    assert first.fix.startswith("Write x.abs() + F.softplus(-2 * x.abs()) - math.log(2) instead of log(cosh(x))"), (
        first.fix
    )
    assert first.trial is not None and first.trial.tried, first.trial
    # as printed: the residual as x, at the same scale and past it
    for r in (model(x) - y, (model(x) - y) * 100):
        loss = (r.abs() + F.softplus(-2 * r.abs()) - math.log(2)).mean()
        exact = float(r.detach().double().abs().mean() - math.log(2))  # log cosh x = |x| - log 2 for |x| >> 1
        assert torch.isfinite(loss) and abs(loss.item() - exact) < 1e-3 * abs(exact)
        loss.backward()


@pytest.mark.parametrize("scale", [2.0, 20.0])  # exp past fp32's range only, and past fp64's too
def test_a_softplus_by_hand_gets_f_softplus_not_the_softmax_advice(scale: float) -> None:
    """log(1 + exp(r)) on residuals of hundreds (a smooth hinge on prices): exp overflows past r ~ 88 in
    fp32, past ~709 in fp64. The advice was 'subtract the max before exp (use softmax/logsumexp)', which
    applied literally trains to nonsense; the stable form is F.softplus, and as printed it trains."""
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    x, y = torch.randn(128, 8), scale * 100.0 * torch.randn(128, 1)

    def step() -> None:
        torch.log(1 + torch.exp(model(x) - y)).mean().backward()

    first = _first_fix(step)
    assert first.fix.startswith("Write F.softplus(x) (or torch.logaddexp(torch.zeros_like(x), x)) instead of "), (
        first.fix
    )
    assert first.trial is not None and first.trial.tried, first.trial
    model.zero_grad()  # the traced step's NaN gradients
    r = (model(x) - y) * 10  # as printed, far past the step's values
    loss = F.softplus(r).mean()
    assert torch.isfinite(loss)
    loss.backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())


def test_a_stable_form_says_the_imports_it_needs() -> None:
    """The log-cosh form writes F. and math.: pasted into a file without those imports it did not run."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    x, y = torch.randn(32, 4), 300.0 * torch.randn(32, 1)
    first = _first_fix(lambda: torch.log(torch.cosh(model(x) - y)).mean().backward())
    assert first.fix.endswith(" It needs import torch.nn.functional as F; import math."), first.fix
