"""benchmarks/gate.py, the benchmarks' regression gate in CI: its decision on given numbers, and an
injected 10x slowdown of the watch's own work failing it (no other timing is asserted here)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gate  # noqa: E402
from fpdoctor.integrations.script import ScriptWatch  # noqa: E402


def _row(value: float, budget: float = 1.01, gate_at: float = 1.9) -> gate.Result:
    return gate.Result("a check", value, budget, gate_at, "x")


def test_over_budget_passes_and_past_the_gate_fails():
    assert gate.decide([_row(1.0), _row(1.45), _row(1.9)])  # over the budget, at the gate: a pass
    assert not gate.decide([_row(1.0), _row(1.91)])
    assert not gate.decide([])  # nothing measured is no pass


def test_env_from_that_imports_torch_is_past_any_gate():
    assert not gate.decide([gate.Result("env --from FILE", math.inf, 0.5, 1.0, "s")])


def test_the_gate_is_twice_the_added_cost_of_the_budget_or_of_today():
    assert gate.gate_of(1.01) == pytest.approx(1.02)
    assert gate.gate_of(3.0) == pytest.approx(5.0)
    assert gate.gate_of(1.01, 1.55) == pytest.approx(2.1)  # over budget today: twice today's cost
    assert gate.gate_of(1.5, 1.2) == pytest.approx(2.0)  # within budget today: twice the budget's


def test_a_line_shows_value_budget_gate_and_verdict():
    line = _row(2.5).line()
    assert "x2.500" in line and "budget   x1.010" in line and "gate   x1.900" in line
    assert line.rstrip().endswith("REGRESSION")
    assert gate.Result("update check", 0.17, 0.01, 0.34, "%").line().rstrip().endswith("ok")


def test_the_slowdown_is_put_back():
    originals = {name: vars(ScriptWatch)[name] for name in ("_pre", "_before_step")}
    with gate.slowdown(10, [(ScriptWatch, name) for name in originals]):
        assert all(vars(ScriptWatch)[name] is not f for name, f in originals.items())
    assert all(vars(ScriptWatch)[name] is f for name, f in originals.items())


def test_ten_times_the_watchs_own_work_fails_the_gate(monkeypatch, capsys):
    # x1.3-1.5 on the 10-tensor MLP today, its gate x2.1; ten times the watch's own work reads x3.5
    monkeypatch.setattr(gate, "BLOCKS", 3)
    monkeypatch.setattr(gate, "REPEATS", 1)
    assert gate.main(["--only", "watch", "--slowdown", "10"]) == 1
    out = capsys.readouterr().out
    assert "watch, MLP 10 x 64, foreach AdamW" in out and "REGRESSION" in out
    assert "bench-gate: FAIL" in out
