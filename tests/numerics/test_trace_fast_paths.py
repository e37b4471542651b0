"""The trace's per-op shortcuts never hide a non-finite value: scalar scaling that cannot grow a
finite input is not reduced, every other scaling is; in-place ops on tensors the trace has not
met are probed before they write; views share their base's producer."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fpdoctor


def _records(tr, op):
    return [r for r in tr.records if r.op == op]


def _produced(report):
    return [f for f in report.findings if f.name == "nonfinite-produced"]


@pytest.mark.parametrize(
    ("fn", "op"),
    [
        (lambda y: y * 0.5, "aten.mul.Tensor"),
        (lambda y: y * -1, "aten.mul.Tensor"),
        (lambda y: y / 4.0, "aten.div.Tensor"),
        (lambda y: y / -math.inf, "aten.div.Tensor"),
        (lambda y: y.mul_(0.25), "aten.mul_.Tensor"),
    ],
)
def test_scaling_a_finite_value_down_needs_no_reduction(fn, op):
    x = torch.full((4,), 3e38)
    with fpdoctor.trace() as tr:
        y = x + 0.0  # made in the block: known finite
        fn(y)
    (record,) = _records(tr, op)
    assert record.outputs[0].derived and record.kind is None
    assert tr.report.verdict != "error"


@pytest.mark.parametrize(
    ("fn", "op", "kind"),
    [
        (lambda y: y * 2.0, "aten.mul.Tensor", "+inf"),
        (lambda y: y / 0.5, "aten.div.Tensor", "+inf"),
        (lambda y: y * math.nan, "aten.mul.Tensor", "nan"),
        (lambda y: y / 0, "aten.div.Tensor", "+inf"),
        (lambda y: y.mul_(-3), "aten.mul_.Tensor", "-inf"),
    ],
)
def test_scaling_that_can_overflow_is_checked(fn, op, kind):
    x = torch.full((4,), 3e38)
    with fpdoctor.trace() as tr:
        y = x + 0.0
        out = fn(y)
        out.sum()
    (record,) = _records(tr, op)
    assert not record.outputs[0].derived and record.kind == kind
    (finding,) = _produced(tr.report)
    assert finding.where["op"] == op


def test_scaling_a_non_finite_input_down_keeps_it_non_finite():
    x = torch.full((4,), 3e38)
    with fpdoctor.trace() as tr:
        y = x * 10.0  # overflow: +inf
        z = y * 0.5  # would be skipped for a finite y
        z.sum()
    (half,) = [r for r in _records(tr, "aten.mul.Tensor") if r.index != _records(tr, "aten.mul.Tensor")[0].index]
    assert half.kind == "+inf" and not half.outputs[0].derived
    (finding,) = _produced(tr.report)
    assert finding.where["op"] == "aten.mul.Tensor" and finding.evidence["first"] == "first Inf"


def test_scaling_an_input_that_arrived_non_finite_is_checked():
    x = torch.tensor([1.0, math.inf])
    with fpdoctor.trace() as tr:
        (x * 0.5).sum()
    (record,) = _records(tr, "aten.mul.Tensor")
    assert record.kind == "+inf" and not record.outputs[0].derived


def test_in_place_op_on_a_tensor_made_outside_is_probed_before_it_writes():
    # The buffer already holds a NaN: the in-place op passes it on, it does not produce it.
    buf = torch.tensor([1.0, math.nan])
    with fpdoctor.trace() as tr:
        buf.add_(1.0)
        buf.sum()
    (record,) = _records(tr, "aten.add_.Tensor")
    assert record.kind == "nan"
    assert [tr.tracer.kind_of(s) for s in record.inputs] == ["nan"]
    assert not _produced(tr.report)


def test_in_place_overflow_of_a_tensor_made_in_the_block_is_its_producer():
    x = torch.full((3,), 2e38)
    with fpdoctor.trace() as tr:
        y = x + 0.0
        y.add_(y)  # 4e38: overflows fp32
        y.sum()
    (finding,) = _produced(tr.report)
    assert finding.where["op"] == "aten.add_.Tensor"


def test_a_view_of_a_non_finite_value_is_blamed_on_its_producer():
    x = torch.zeros(2, 3)
    with fpdoctor.trace() as tr:
        y = torch.log(x)  # -inf
        z = y.t().reshape(-1)[1:] * 2.0
        z.sum()
    (finding,) = _produced(tr.report)
    assert finding.where["op"] == "aten.log.default"


def test_a_number_returned_by_an_op_is_not_a_record():
    x = torch.tensor([2.0, 3.0])
    with fpdoctor.trace() as tr:
        v = (x * 2.0).sum().item()
    assert v == 10.0
    assert not _records(tr, "aten._local_scalar_dense.default")
    assert tr.tracer.ops_seen >= 3


def test_a_meta_tensor_has_no_values_to_read_and_no_hook_error():
    """transformers builds some masks on the meta device (shapes only): nothing there to check."""
    m = nn.Linear(4, 4)
    with torch.no_grad(), fpdoctor.trace(m) as t:
        shape = (torch.empty(3, 4, device="meta") * 2).shape
        m(torch.randn(*shape))
    assert t.report.data["not_checked"] == {}, t.report.data["not_checked"]
