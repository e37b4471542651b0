"""The Sentinel's findings as they are decided: one line on stderr each, and `stop_on`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.training.live import FindingLog, Live, line_of
from fpdoctor.report.model import Severity
from tests.numerics.test_sentinel import data, make, step_fn


def _bad_at(model, opt, bad_call: int):
    plain = step_fn(model, opt)
    calls = {"n": 0}

    def step(x, y):
        loss = plain(x, y)
        calls["n"] += 1
        if calls["n"] == bad_call:  # once: a transient fault
            model[0].weight.grad[0, 0] = float("nan")
        return loss

    return step


def test_a_finding_is_said_on_stderr_when_its_step_is_decided(capsys):
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt, reference_every=0)
    step = _bad_at(model, opt, 3)
    batches = data()
    for x, y in batches[:2]:
        guard.step(step, x, y)
    assert capsys.readouterr().err == ""
    guard.step(step, *batches[2])  # the bad step: decided here, before the run ends
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("fpdoctor: step 3: TRN") and "nonfinite-gradient (error)" in err[0], err
    assert any("transient-fault-suspected" in line for line in err), err
    guard.step(step, *batches[3])  # a finite step says nothing; the summary is unchanged
    assert capsys.readouterr().err == ""
    assert [f.name for f in guard.report.findings] == ["nonfinite-gradient", "transient-fault-suspected"]


def test_stop_on_error_sets_should_stop_at_the_first_error_and_training_may_end(capsys):
    model, opt = make()
    guard = fpdoctor.Sentinel(model, opt, reference_every=0, stop_on="error")
    step = _bad_at(model, opt, 2)
    ran = 0
    for x, y in data():
        guard.step(step, x, y)
        ran += 1
        if guard.should_stop:
            break
    assert ran == 2 and guard.report.verdict == "error"
    with pytest.raises(ValueError, match="stop_on must be one of error, warning"):
        fpdoctor.Sentinel(model, opt, stop_on="fatal")


def test_a_repeated_cause_is_one_line_and_a_replaced_finding_none():
    said: list[str] = []
    live = Live(say=said.append, stop_on=Severity.WARNING)
    log = FindingLog(live)
    from fpdoctor.catalog import make as make_finding

    first = make_finding("nonfinite-loss", message="m", evidence={"step": 7}, where={"rank": 1})
    log.append(first)
    assert said == [] and live.stopped is first and live.behind  # said when the judge is done with the step
    live.settle()
    log[0] = first  # counted again under its cause: no new line
    live.settle()
    assert said == [line_of(first)] and said[0].startswith("fpdoctor: rank 1 step 7: ")
    live.rank = 0  # another rank's finding is said by that rank
    log.append(first)
    live.settle()
    assert len(said) == 1


def test_the_report_file_is_rewritten_only_when_a_finding_arrived_and_before_its_line():
    events: list[str] = []
    live = Live(say=events.append)
    live.writer = lambda: events.append("written")
    live.settle()
    assert events == []  # no finding: no rewrite, whatever the steps
    FindingLog(live).append(_finding())
    live.settle()
    live.settle()
    assert events[0] == "written" and events[1].startswith("fpdoctor: step 1: ") and len(events) == 2
    assert live.writes == 1


def _finding():
    from fpdoctor.catalog import make as make_finding

    return make_finding("loss-spike", message="m", evidence={"step": 1})


def test_a_writer_that_fails_is_one_line_and_the_run_goes_on():
    said: list[str] = []
    live = Live(say=said.append)

    def broken() -> None:
        raise OSError(30, "Read-only file system")

    live.writer = broken
    FindingLog(live).append(_finding())
    live.settle()
    assert live.writer is None and "could not be rewritten" in said[0] and len(said) == 2


def test_a_module_that_prints_nothing_when_no_finding(capsys):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    guard = fpdoctor.Sentinel(model, torch.optim.SGD(model.parameters(), lr=0.1), reference_every=0)
    guard.step(lambda x: model(x).sum().backward() or model(x).sum().detach(), torch.randn(2, 4))
    assert capsys.readouterr().err == ""
