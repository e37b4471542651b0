"""Bad data is the data's fault: an Inf or NaN that arrives in the inputs or a parameter is
`nonfinite-input`, and the ops it turns into NaN on its way are not blamed as numerical bugs."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import fpdoctor


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def _names(report) -> list[str]:
    return [f.name for f in report.findings]


def _train(model: nn.Module, x: torch.Tensor):
    y = torch.randn(x.shape[0], 1)
    with fpdoctor.trace(model) as t:
        nn.functional.mse_loss(model(x), y).backward()
    assert t.report is not None
    return t.report


def test_an_inf_in_the_batch_is_the_inputs_not_the_linear_layers():
    x = torch.randn(8, 16)
    x[1, 1] = float("inf")
    report = _train(_mlp(), x)
    assert _names(report) == ["nonfinite-input"], [f.title for f in report.findings]
    (f,) = report.findings
    assert f.evidence["kind"] == "+inf" and f.evidence["origin"] == "input" and f.evidence["count"] == 1


def test_a_batch_made_non_finite_in_a_loader_thread_is_an_input():
    out: dict = {}

    def load() -> None:
        x = torch.randn(8, 16)
        out["x"] = x / (x - x)  # not traced: another thread

    worker = threading.Thread(target=load)
    worker.start()
    worker.join()
    report = _train(_mlp(), out["x"])
    assert "nonfinite-produced" not in _names(report)
    assert report.by_name("nonfinite-input")[0].evidence["origin"] == "input"


def test_an_inf_made_by_an_op_is_still_that_ops():
    model = _mlp()
    x = torch.randn(8, 16)
    with fpdoctor.trace(model) as t:
        h = model(x) / torch.zeros(())  # the division makes the Inf: the op's fault
        h.sum().backward()
    assert t.report is not None
    assert t.report.findings[0].name == "nonfinite-produced" and t.report.findings[0].where["op"] == "aten.div.Tensor"
    assert "nonfinite-input" not in _names(t.report)


def test_raise_on_stops_at_an_inf_in_the_batch_as_an_input():
    import pytest

    x = torch.randn(8, 16)
    x[1, 1] = float("inf")
    with pytest.raises(fpdoctor.NonFiniteError) as caught, fpdoctor.trace(_mlp(), raise_on="nonfinite"):
        _mlp()(x)
    assert caught.value.finding.name == "nonfinite-input"


def test_a_trace_that_fails_to_start_leaves_no_global_hook(monkeypatch):
    import pytest
    from torch.nn.modules import module as module_mod
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    from fpdoctor.numerics.trace import tracer as tracer_mod

    before = (len(module_mod._global_forward_pre_hooks), len(_global_optimizer_pre_hooks))

    def broken(self):
        raise RuntimeError("cannot enter")

    monkeypatch.setattr(tracer_mod.Tracer, "__enter__", broken)
    with pytest.raises(RuntimeError, match="cannot enter"), fpdoctor.trace(_mlp()):
        pass
    assert (len(module_mod._global_forward_pre_hooks), len(_global_optimizer_pre_hooks)) == before


def test_batchnorm_statistics_written_from_a_nan_batch_are_not_inputs_that_held_nan():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    x[2, 1] = float("nan")
    with fpdoctor.trace(model) as t:
        model(x).sum().backward()
    assert t.report is not None
    (f,) = t.report.findings  # the batch's NaN, not 1.running_mean / 1.running_var
    assert f.name == "nonfinite-input" and f.evidence["origin"] == "input"


def test_a_best_score_started_at_inf_is_no_finding():
    """EarlyStopping's best score starts at torch.tensor(inf), compared with each loss: a trace of any
    Lightning run with it said ERROR nonfinite-input, "check the data pipeline". A one-value +-inf input
    first read by a comparison, that reaches only values read back by Python, is a sentinel."""
    start = float("inf")
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    best = torch.tensor(start)
    with fpdoctor.trace(model) as t:
        for _ in range(6):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bool(loss.detach() - 1e-3 < best):  # EarlyStopping's monitor_op(current - min_delta, best)
                best = loss.detach()
    assert "nonfinite-input" not in [f.name for f in t.report.findings]


@pytest.mark.parametrize("use", ["weight", "bias"])
def test_an_inf_that_flows_into_a_value_the_user_reads_is_named_even_as_one_value(use):
    """A 0-d inf weight on an evaluation loss, a (1,)-shaped -inf added to a score: read back as a float
    that is itself Inf. No comparison reads them first: they are no sentinel."""
    scale = torch.tensor(float("inf")) if use == "weight" else torch.full((1,), float("-inf"))
    with fpdoctor.trace() as t:
        score = torch.randn(4).mean()
        value = float(score * scale) if use == "weight" else float((score + scale).sum())
    assert math.isinf(value)
    assert "nonfinite-input" in [f.name for f in t.report.findings]
