"""Dtype headroom catches failures that never make a NaN."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from fpdoctor.formats import FORMATS, format_named
from fpdoctor.numerics.trace.headroom import share_below, smallest_nonzero


class Variance(nn.Module):
    def forward(self, x):
        return x.pow(2).mean(-1, keepdim=True)


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.var = Variance()

    def forward(self, x):
        return x * torch.rsqrt(self.var(x) + 1e-12)


def test_fp16_variance_that_would_underflow():
    x = torch.randn(4, 64) * 1e-4  # x**2 ~ 1e-8: below fp16's smallest subnormal (6e-8)
    norm = Norm()
    with fpdoctor.trace(norm, headroom=True) as t:
        norm(x)
    risks = [f for f in t.report.findings if f.name == "underflow-risk"]
    assert [(f.where["module"], f.evidence["target"]) for f in risks] == [("var", "fp16")]
    assert risks[0].evidence["share"] > 0.5
    # and it is real: in fp16 the variance is zero and the "norm" divides by sqrt(eps)
    assert (x.half().float().pow(2).half() == 0).float().mean() > 0.5


def test_e4m3_cast_that_clamps_at_448():
    class Cast(nn.Module):
        def forward(self, x):
            return x.clamp(-448, 448).to(torch.float8_e4m3fn)

    x = torch.randn(64, 64) * 300
    with fpdoctor.trace(Cast(), headroom=True) as t:
        Cast()(x)
    risks = [f for f in t.report.findings if f.name == "overflow-risk"]
    assert risks and risks[0].evidence["target"] == "fp8_e4m3" and risks[0].evidence["share"] >= 0.99
    assert not risks[0].evidence["what_if"]


def test_fp32_activation_that_would_overflow_fp16():
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.fill_(5000.0)
    with fpdoctor.trace(lin, headroom=True) as t:
        lin(torch.ones(2, 16))
    risk = [f for f in t.report.findings if f.name == "overflow-risk"]
    assert risk and risk[0].evidence["target"] == "fp16" and risk[0].evidence["what_if"]
    row = t.report.data["headroom"][0]
    assert row["module"] == "<root>" and row["absmax"] >= 80000


def test_histogram_shares():
    hist = [0] * 300
    hist[160 - 30] = 10  # frexp exponent -30: values in [2**-31, 2**-30)
    hist[160] = 90  # exponent 0: values in [0.5, 1)
    assert share_below(hist, FORMATS["fp16"].flush_threshold) == 0.1
    assert smallest_nonzero(hist) == 2.0**-31


def test_format_names():
    assert format_named("half").name == "fp16" and format_named("fp8-e4m3").max == 448
    import pytest

    with pytest.raises(ValueError, match="unknown dtype"):
        format_named("fp12")


def _no_unknowns(value):
    """Keys whose value is unknown are omitted, never null (ARCHITECTURE.md, contract 2)."""
    if isinstance(value, dict):
        return all(v is not None and _no_unknowns(v) for k, v in value.items() if k != "module")
    return True


def test_every_call_counted_although_python_reuses_ids():
    # Each output is freed before the next call, so CPython hands the next output the same id().
    lin = nn.Linear(8, 8)
    counts = []
    for _ in range(2):
        with fpdoctor.trace(lin, headroom=True) as t:
            for _ in range(200):
                lin(torch.randn(4, 8))
        counts.append(t.report.data["headroom"][0]["calls"])
    assert counts == [200, 200]


def test_container_returning_its_childs_output_counts_it_once():
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    with fpdoctor.trace(model, headroom=True) as t:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    calls = {row["module"]: row["calls"] for row in t.report.data["headroom"]}
    assert calls == {"0": 2, "1": 2}  # the Sequential hands on 1's output: not a second row


def test_headroom_findings_name_the_op_and_omit_unknowns():
    x = torch.randn(4, 64) * 1e-4
    norm = Norm()
    with fpdoctor.trace(norm, headroom=True) as t:
        norm(x)
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.fill_(5000.0)
    with fpdoctor.trace(lin, headroom=True) as t2:
        lin(torch.ones(2, 16))
    found = [f for f in t.report.findings + t2.report.findings if f.name in ("underflow-risk", "overflow-risk")]
    assert {f.name for f in found} == {"underflow-risk", "overflow-risk"}
    for f in found:
        assert {"module", "op", "phase"} <= f.where.keys() and _no_unknowns(f.where), f.where
        assert {"kind", "numel", "dtype"} <= f.evidence.keys() and _no_unknowns(f.evidence), f.evidence
    under = next(f for f in found if f.name == "underflow-risk")
    assert under.where["op"] == "aten.mean.dim" and under.evidence["numel"] == 4
    over = next(f for f in found if f.name == "overflow-risk")
    # with the op's exact range (Tracer.ranges, accelerators) the op's source line joins it
    place = {k: v for k, v in over.where.items() if k not in ("file", "line")}
    assert place == {"module": "", "op": "aten.addmm.default", "phase": "forward"}
    assert over.where.get("file", __file__) == __file__


def test_a_nan_output_is_not_shown_as_zero_headroom():
    from fpdoctor.numerics.trace.headroom import ModuleStats

    stats = ModuleStats("torch.float32")
    stats.add(torch.tensor([1.0, float("nan")]))
    stats.add(torch.tensor([3.0]))  # a later finite call does not hide the NaN
    assert stats.absmax != stats.absmax  # NaN, not max(0.0, nan) == 0.0
    norm = Norm()
    with fpdoctor.trace(norm, headroom=True) as t:
        norm(torch.tensor([[1.0, float("nan")]]))
    rows = t.report.data["headroom"]
    assert not [row for row in rows if row["absmax"] == 0.0]  # a NaN module is left out, not shown as 0
