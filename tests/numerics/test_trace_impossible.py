"""A result arithmetic cannot produce: a GEMM output beyond |A|@|B| + |bias| is not the code's fault.

The corruption is injected below the trace by a dispatch mode entered first, so the trace sees
the op return a wrong value from finite inputs - what a faulty GPU or library would hand it."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fpdoctor
from fpdoctor.numerics.trace.bounds import impossible, output_bound


class CorruptOneGemm(TorchDispatchMode):
    """Writes +Inf into one element of the `at`-th addmm output (a silent wrong value)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.addmm.default:
            self.calls += 1
            if self.calls == self.at:
                out[0, 0] = math.inf
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def test_a_corrupted_gemm_output_is_beyond_arithmetic_and_points_at_the_machine():
    model, x = _model(), torch.randn(8, 16)
    with CorruptOneGemm(at=2), fpdoctor.trace(model) as t:
        model(x)
    finding = t.report.by_name("nonfinite-produced")[0]
    assert finding.where["op"] == "aten.addmm.default" and finding.where["module"] == "2"
    bound = finding.evidence["arithmetic_bound"]
    assert 0 < bound < 100  # tanh outputs <= 1, 32 of them, small weights
    assert "arithmetic cannot" in finding.title and "Arithmetic cannot explain it" in finding.message
    assert "fpdoctor health" in finding.fix and "clamp" not in finding.message


def test_a_real_fp16_overflow_is_arithmetic_and_keeps_its_advice():
    torch.manual_seed(0)
    layer = nn.Linear(64, 4).half()
    with torch.no_grad():
        layer.weight.fill_(30.0)
    x = torch.full((2, 64), 40.0, dtype=torch.float16)  # 64 * 40 * 30 = 76800 > 65504
    with fpdoctor.trace(layer) as t:
        layer(x)
    finding = t.report.by_name("nonfinite-produced")[0]
    assert "arithmetic_bound" not in finding.evidence
    assert "arithmetic cannot" not in finding.title


def test_bounds_of_matrix_products_and_convolutions():
    torch.manual_seed(0)
    a, b, bias = torch.randn(3, 5), torch.randn(5, 4), torch.randn(4)
    expected = float((bias.abs().double() + a.abs().double() @ b.abs().double()).max())
    assert output_bound("aten.addmm.default", (bias, a, b), {}) == expected
    assert output_bound("aten.addmm.default", (bias, a, b), {"beta": 0.5, "alpha": -2}) == float(
        (0.5 * bias.abs().double() + 2 * (a.abs().double() @ b.abs().double())).max()
    )
    x, w, cb = torch.randn(1, 2, 6, 6), torch.randn(3, 2, 3, 3), torch.randn(3)
    y = torch.ops.aten.convolution.default(x, w, cb, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    bound = output_bound("aten.convolution.default", (x, w, cb, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {})
    assert bound is not None and float(y.abs().max()) <= bound
    assert output_bound("aten.tanh.default", (x,), {}) == 1.0
    assert output_bound("aten.exp.default", (x,), {}) is None  # exp overflows legitimately
    # below fp16's max with room for rounding: impossible; at or above it, or unknown: not
    assert impossible(100.0, "torch.float16") and not impossible(70000.0, "torch.float16")
    assert not impossible(None, "torch.float32") and not impossible(math.inf, "torch.float32")


def test_a_saturating_op_fed_a_nan_the_trace_did_not_see_is_not_called_corruption():
    class Extension(nn.Module):
        def forward(self, x):
            h = torch.zeros(2, 4)  # an output buffer a custom kernel fills, outside the dispatcher
            h.numpy()[0, 0] = math.nan
            return x * torch.sigmoid(h).sum()

    model = Extension()
    with fpdoctor.trace(model) as t:
        model(torch.randn(2, 4)).sum()
    for finding in t.report.findings:
        assert "arithmetic_bound" not in finding.evidence and "arithmetic cannot" not in finding.title
    assert output_bound("aten.sigmoid.default", (torch.tensor([math.nan]),), {}) is None


def test_a_report_that_could_not_be_built_is_never_ok(monkeypatch):
    """What was traced but not judged (an error inside fpdoctor's own judging) is incomplete, not OK."""

    def broken(self, *args, **kwargs):
        raise RuntimeError("judging failed")

    monkeypatch.setattr("fpdoctor.numerics.trace.blame.Analysis.findings", broken)
    model, x = _model(), torch.randn(8, 16)
    with CorruptOneGemm(at=2), fpdoctor.trace(model) as t:
        model(x)
    assert t.report is not None and t.report.verdict == "warning"
    assert t.report.data["status"] == "incomplete"
    assert "judging failed" in t.report.data["not_checked"]["report"]


def test_an_ok_trace_says_what_it_judged_and_that_no_reference_was_compared():
    model, x = _model(), torch.randn(8, 16)
    with fpdoctor.trace(model) as t:
        model(x)
    assert t.report is not None and t.report.verdict == "ok"
    key, judged = t.report.data["summary"][0]
    assert key == "judged" and f"the outputs of {t.report.data['ops']:,} ops" in judged
    assert "not compared with a reference" in judged and "fpdoctor watch" in judged
