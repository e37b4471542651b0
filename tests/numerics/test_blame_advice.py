"""The fix a producer finding offers is chosen by the exact op, and bf16 only for range."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.trace.blame import OP_ADVICE, _fix_for
from fpdoctor.numerics.trace.tracer import Output, Record


def record(op: str, dtype: str = "torch.float32", kind: str = "+inf", stats=None) -> Record:
    r = Record(0, op, "forward", "m", 0, False, None, None, None, [])
    r.outputs.append(Output((4,), dtype, kind=kind))
    r.input_stats = stats
    return r


@pytest.mark.parametrize("name", sorted(OP_ADVICE))
def test_every_entry_is_an_aten_op_and_is_what_that_op_gets(name):
    packet = getattr(torch.ops.aten, name)  # a misspelt key would never match any op
    overload = packet.overloads()[0]
    op = str(getattr(packet, overload))
    assert op == f"aten.{name}.{overload}"
    assert _fix_for(record(op)).startswith(OP_ADVICE[name])


def test_log_softmax_is_not_log():
    fix = _fix_for(record("aten._log_softmax.default", kind="nan"))
    assert "clamp" not in fix and "entirely masked" in fix
    assert _fix_for(record("aten.logit.default")) == fpdoctor.catalog.get("nonfinite-produced").fix
    assert _fix_for(record("aten.logsumexp.default")) == fpdoctor.catalog.get("nonfinite-produced").fix


def test_bf16_only_when_the_cause_is_range():
    big = [{"dtype": "torch.float16", "shape": [4], "min": -300.0, "max": 300.0}] * 2
    assert "bfloat16" in _fix_for(record("aten.mm.default", "torch.float16", stats=big))
    # 1 / 0 in fp16 is a pole, not range: bf16 would make the same Inf
    pole = [big[0], {"dtype": "torch.float16", "shape": [4], "min": 0.0, "max": 1.0}]
    assert "bfloat16" not in _fix_for(record("aten.div.Tensor", "torch.float16", stats=pole))
    # a NaN (0/0) and an fp32 overflow are not fp16's range either
    assert "bfloat16" not in _fix_for(record("aten.mm.default", "torch.float16", kind="nan", stats=big))
    assert "bfloat16" not in _fix_for(record("aten.mm.default", "torch.float32", stats=big))


def test_fp16_matmul_overflow_says_bf16_plainly():
    lin = nn.Linear(64, 64).half()
    with torch.no_grad():
        lin.weight.fill_(40.0)
    with fpdoctor.trace(lin) as t:
        lin(torch.full((2, 64), 40.0, dtype=torch.float16))
    (f,) = [f for f in t.report.findings if f.name == "nonfinite-produced"]
    assert "fp16's range" in f.fix and "torch.bfloat16" in f.fix


def test_an_optimizer_update_that_divides_by_zero_is_not_told_to_use_bf16():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)  # eps is 0 in fp16
    with fpdoctor.trace(model) as t:
        for _ in range(3):
            opt.zero_grad()
            x = torch.randn(8, 16).half()
            x[:, 0] = 0  # the first layer's column 0 gets no gradient: v = 0, update 0/0 and m/0
            model(x).float().square().mean().backward()
            opt.step()
    assert t.report is not None
    produced = t.report.by_name("nonfinite-produced")
    assert produced and all(f.where["phase"] == "optimizer" for f in produced)
    assert all("bf16" not in f.fix and "eps" in f.fix for f in produced)
    assert t.report.by_name("fp16-adam-eps")


def test_the_division_guard_names_the_lines_denominator_only_where_the_line_holds_that_one_division():
    from fpdoctor.numerics.trace.blame import _division

    assert _division("return (x - x.min()) / (x.max() - x.min())") == ("x - x.min()", "x.max() - x.min()")
    assert _division("z = a / self.scale[i]") == ("a", "self.scale[i]")
    # the division that made it is a call, or the `/` divides by a Python number: not named
    assert _division("y = x.div(norm) * (1 / math.sqrt(d))") is None
    assert _division("z = torch.div(a, b) / c") is None
    assert _division("z = a / math.sqrt(2)") is None and _division("z = a / 2.0") is None
    assert _division("z = a / b / c") is None and _division("if x:") is None
