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


class LeakyIntegrator(nn.Module):
    """An irregularly sampled series (events): a leaky integrator whose leak per step, exp(-rate * dt) with
    dt ~ 0.004 from the inputs, is ~0.998: computed each step in the model's dtype it rounds to 1.0 in
    bf16 (bf16's spacing below 1 is 2**-8), so the state integrates without leaking. The state kept in
    fp64 alone cannot help: each update reads the rounded leak. `fixed`: the fix as compare prints it
    (the state in fp32, the leak's line in fp32, what is read from the state cast back)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.proj, self.step = nn.Linear(6, 12), nn.Linear(6, 12)
        self.rate = nn.Parameter(torch.full((12,), 0.5))
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, dt = self.proj(x), nn.functional.softplus(self.step(x) - 5.5)
        s = torch.zeros(h.shape[0], 12, dtype=torch.float32 if self.fixed else h.dtype)
        outs = []
        for t in range(h.shape[1]):
            leak = torch.exp(-self.rate.float() * dt[:, t].float()) if self.fixed else torch.exp(-self.rate * dt[:, t])
            s = leak * s + dt[:, t] * h[:, t]
            outs.append(s.to(h.dtype))
        return torch.stack(outs, 1)


class Events(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.cell = LeakyIntegrator(fixed)
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.cell(x))


def test_a_state_whose_update_reads_a_leak_rounded_to_1_is_fixed_with_the_line_that_makes_the_leak():
    torch.manual_seed(0)
    model, x = Events().eval(), torch.randn(2, 1500, 6) + 1.0
    result = fpdoctor.compare(model, x, candidate="bf16")
    (finding,) = [f for f in result.report.findings if f.evidence.get("kind") == "accumulation"]
    leak_line = LeakyIntegrator.forward.__code__.co_firstlineno + 5
    # before: "No running state tried explains it ... `fpdoctor plan` cannot fix this", nothing checked
    assert finding.evidence["feeding_lines"] == [f"{__file__}:{leak_line}"], finding.evidence
    assert f"compute line {leak_line} of " in finding.fix and finding.trial is not None and finding.trial.tried
    assert finding.trial.after * 10 < finding.trial.before
    fixed = Events(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    after = fpdoctor.compare(fixed, x, candidate="bf16")  # as printed
    assert not [f for f in after.report.findings if f.evidence.get("kind") == "accumulation"]
    assert after.rows[-1].propagated * 10 < result.rows[-1].propagated and after.report.verdict == "ok"
