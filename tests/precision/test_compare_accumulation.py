"""compare on an error no op makes alone: a running state that accumulates it over many steps."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import fpdoctor
from tests.precision.factories import RunningSum, running_sum


def test_a_running_state_in_bf16_is_never_ok_and_is_named_with_its_line():
    model, sets = running_sum()
    result = fpdoctor.compare(model, sets, candidate="bf16")
    assert result.report.verdict == "error"
    (finding,) = [f for f in result.report.findings if f.evidence.get("kind") == "accumulation"]
    ev = finding.evidence
    assert ev["state_location"].endswith("factories.py:" + str(_line_of("state = state + h[:, t]")))
    assert ev["state_op"] == "aten.add.Tensor" and ev["state_steps"] >= 2999
    # the experiment that decided it: the state alone in fp64 takes most of the error away
    assert ev["raised_rel"] * 10 < ev["propagated_rel"]
    assert "(checked)" in finding.message and "grows with the input's size" in finding.message
    assert ev["growth"]["errors"] == sorted(ev["growth"]["errors"])
    assert result.report.data["error_grows_with_input_size"]["sizes"] == [6400, 25600, 96000]
    assert "accumulation" in dict(result.report.data["summary"])["first divergent module"]


def test_a_short_running_state_stays_ok():
    model = RunningSum()
    torch.manual_seed(0)
    result = fpdoctor.compare(model, torch.randn(2, 20, 16) + 0.5, candidate="bf16")
    assert not [f for f in result.report.findings if f.evidence.get("kind") == "accumulation"]


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = x[:, 0]
        for t in range(x.shape[1]):
            state = torch.tanh(state * 0.5 + x[:, t])
        return self.head(state)


def test_own_ops_repeated_in_a_loop_are_rerun_a_logarithmic_number_of_times():
    # thousands of tiny ops per forward: the re-runs per op site grow with the log of the loop
    result = fpdoctor.compare(_Tiny(), torch.randn(4, 4096, 8), candidate="bf16")
    (row,) = [r for r in result.rows if r.module == ""]
    assert row.own is not None and 3 * 4 <= row.own["judged"] <= 3 * (4 + 13)


def _line_of(text: str) -> int:
    import tests.precision.factories as f

    lines = Path(f.__file__).read_text().splitlines()
    return next(k + 1 for k, line in enumerate(lines) if text in line)


def test_plan_says_the_error_is_made_inside_the_module_it_keeps():
    from collections import OrderedDict

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(enc=RunningSum(), head=nn.Linear(16, 4)))
    result = fpdoctor.plan(model, torch.randn(2, 3000, 16) + 0.5, candidate="bf16")
    assert "enc" in result.plan.keep_fp32
    why = dict(result.report.data["summary"])["why `enc`"]
    assert "made inside it, by accumulation in the running state at" in why and "factories.py" in why
    assert "what follows amplifies" not in why


class _InPlaceSum(RunningSum):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            state += h[:, t]  # in place: its dtype cannot be raised without the code changed
            outs.append(state.clone())
        return self.out(torch.stack(outs, 1))


def test_an_in_place_running_state_is_named_and_said_untried():
    torch.manual_seed(0)
    result = fpdoctor.compare(_InPlaceSum(), torch.randn(2, 3000, 16) + 0.5, candidate="bf16")
    (finding,) = [f for f in result.report.findings if f.evidence.get("kind") == "accumulation"]
    (state,) = finding.evidence["states_tried"]
    assert state["in_place"] and state["raised_rel"] is None and state["op"] == "aten.add_.Tensor"
    assert "could not be tried in fp64: it is updated in place" in finding.message
    assert "not checked" in finding.fix and "(checked)" not in finding.message
