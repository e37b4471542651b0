"""compare --against: a departure is judged on what differs between the two machines, not on
the error both carried in against fp64 (two records, as test_record.py makes them)."""

from __future__ import annotations

import pytest
import torch

from fpdoctor.precision.metrics import l2_norm
from fpdoctor.precision.record import against
from fpdoctor.precision.record.against_report import findings
from tests.precision.test_record import _call, _record


def _linear_one_percent_off(b_isolated: float) -> against.Judgement:
    """Deep in a model both runs carry an error of 1e-3 against fp64 into `lin`; upstream, B's
    outputs equal A's exactly; B's `lin` output is 1% off A's."""
    base = [1.0, 2.0, 3.0, 4.0]
    norm = l2_norm(torch.tensor(base, dtype=torch.float64))
    off = [1.0, 2.0, 3.0, 4.0 + 0.01 * norm]
    upstream = dict(floor=2e-4, propagated=1e-3, isolated=3e-4)
    a = _record([_call("a", base, base, **upstream), _call("b", base, base, floor=2e-4, propagated=1e-3,
                                                            isolated=3.3e-4)])  # fmt: skip
    b = _record([_call("a", base, base, **upstream), _call("b", base, off, floor=2e-4, propagated=1e-2,
                                                           isolated=b_isolated)], gpu="B")  # fmt: skip
    return against.judge(a, b)


def test_a_module_whose_own_computation_differs_departs_though_both_carry_error_in():
    j = _linear_one_percent_off(b_isolated=1e-2)  # B's copy alone: 40 dB against A's 69.6
    one = j.sets[0]
    assert one.rows[0].departure == 0.0 and not one.rows[0].departs
    row = one.rows[1]
    assert row.departs and one.departure is row and one.blamed == "b"
    assert row.basis == "floor" and row.limit == 16 * 2e-4
    (finding,) = [f for f in findings(j) if f.name == "machine-departure"]
    assert finding.evidence["limit_basis"] == "floor"
    assert "carried in against fp64 is the same on both machines" in finding.message


def test_a_module_that_agrees_by_itself_may_grow_the_error_carried_in():
    j = _linear_one_percent_off(b_isolated=3.4e-4)  # alone, B's copy computes as A's does
    row = j.sets[0].rows[1]
    assert row.basis == "carried error" and not row.departs


def test_a_difference_carried_in_is_the_allowance_where_upstream_differs():
    base = [1.0, 2.0, 3.0, 4.0]
    norm = l2_norm(torch.tensor(base, dtype=torch.float64))

    def judged(offset: float) -> against.Row:
        near = [1.0, 2.0, 3.0, 4.0 + 0.01 * norm]  # upstream differs by 0.01, within its limit (16 x 1e-3)
        off = [1.0, 2.0, 3.0, 4.0 + offset * norm]
        a = _record([_call("a", base, base), _call("b", base, base)])
        b = _record([_call("a", base, near), _call("b", base, off, isolated=0.1)], gpu="B")
        return against.judge(a, b).sets[0].rows[1]

    row = judged(0.03)
    assert row.carried == pytest.approx(0.01, rel=1e-3) and row.basis == "carried difference"
    assert not row.departs  # 3.2 x the 0.01 carried in is 0.032
    assert judged(0.05).departs
