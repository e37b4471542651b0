"""A composite torch computes in a stable form (log of a sigmoid, of 1 - a sigmoid, of a softmax, of
a sum of exps) that made NaN/Inf: the fix is the stable form, checked in the run's own dtype on the
step's inputs and on them scaled to the dtype's largest values, not the lines in fp32 (which only
move the edge: a confident classifier's fp32 sigmoid is 1.0 past z = 17). The fix applied as
printed keeps the loss finite where the fp32 lines do not."""

from __future__ import annotations

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
    assert "in fp32 are non-finite there" in first.fix  # the lines in fp32 fail at the scaled inputs
    assert first.trial is not None and first.trial.tried and "F.logsigmoid" in first.trial.changed, first.trial
    # as printed: both sides in their stable form, in fp16, even with logits scaled far past the step's
    z = model(x).squeeze(-1) * 100
    loss = -(y * F.logsigmoid(z) + (1 - y) * F.logsigmoid(-z)).mean()
    assert torch.isfinite(loss)


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
