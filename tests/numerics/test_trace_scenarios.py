"""Localisation scenarios, translated from the peer suites: JAX debug_nans_test.py / checkify,
TensorFlow check_numerics_callback_test.py, PyTorch anomaly-mode tests in test_autograd.py.

Each asserts the producing op, module, phase and kind, and that masked values are not errors.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fpdoctor


def named(report, name):
    return [f for f in report.findings if f.name == name]


def only_producer(report, first="first NaN"):
    found = [f for f in named(report, "nonfinite-produced") if f.evidence["first"] == first]
    assert len(found) == 1, [f.title for f in report.findings]
    return found[0]


class Block(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.lin(x))


class Net(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
        self.block = Block(fn)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.block(self.enc(x)))


def run(fn, x=None, backward=True, **trace_kwargs):
    torch.manual_seed(0)
    net = Net(fn)
    x = torch.randn(3, 4) if x is None else x
    with fpdoctor.trace(net, **trace_kwargs) as t:
        y = net(x).sum()
        if backward:
            y.backward()
    return t.report


def test_zero_over_zero_in_a_submodule():  # JAX: testDivZero-like; TF: "0/0"
    report = run(lambda h: h * 0 / (h * 0))
    f = only_producer(report)
    assert f.where["op"] == "aten.div.Tensor" and f.where["module"] == "block" and f.where["phase"] == "forward"
    assert f.evidence["kind"] == "nan" and f.evidence["count"] == 12 and f.evidence["numel"] == 12
    assert f.evidence["location"].endswith("in <lambda>")  # the user's source line
    assert not named(report, "nonfinite-input")


def test_log_of_zero_is_the_first_inf():  # TF check_numerics: log(0)
    report = run(lambda h: torch.log(h * 0))
    f = only_producer(report, "first Inf")
    assert f.where["op"] == "aten.log.default" and f.evidence["kind"] == "-inf"


def test_sqrt_of_negative():  # JAX checkify: sqrt of negative
    report = run(lambda h: torch.sqrt(-(h.abs() + 1)))
    assert only_producer(report).where["op"] == "aten.sqrt.default"


def test_exp_overflow_then_inf_over_inf():  # a hand-written softmax: first Inf and first NaN apart
    report = run(lambda h: torch.exp(h * 1000) / torch.exp(h * 1000).sum(-1, keepdim=True))
    assert only_producer(report, "first Inf").where["op"] == "aten.exp.default"
    nan = only_producer(report, "first NaN")
    assert nan.where["op"] == "aten.div.Tensor" and "turned +inf into nan" in nan.title


def test_inf_only_forward_has_no_nan_finding():
    block = Block(lambda h: h.abs() / torch.zeros_like(h))  # +inf only, nothing mixes signs
    with fpdoctor.trace(block) as t:
        block(torch.randn(3, 4))
    assert only_producer(t.report, "first Inf").where["op"] == "aten.div.Tensor"
    assert not [f for f in named(t.report, "nonfinite-produced") if f.evidence["first"] == "first NaN"]


def test_fp16_matmul_overflow():
    lin = nn.Linear(64, 64).half()
    with torch.no_grad():
        lin.weight.fill_(30.0)
    x = torch.full((2, 64), 40.0, dtype=torch.float16)  # 64 * 30 * 40 = 76800 > 65504
    with fpdoctor.trace(lin) as t:
        lin(x)
    f = only_producer(t.report, "first Inf")
    assert f.where["module"] == "" and f.where["op"].startswith("aten.addmm")
    assert f.evidence["dtype"] == "torch.float16"
    assert "fp32" in f.fix


def test_where_masked_nan_is_not_an_error():  # JAX debug_nans: where-masked NaN
    def fn(h):
        bad = h / (h * 0)  # NaN/Inf everywhere...
        return torch.where(torch.zeros_like(h, dtype=torch.bool), bad, h)  # ...and all of it discarded

    report = run(fn, backward=False)
    assert report.verdict != "error"
    masked = named(report, "nonfinite-masked")
    assert masked and masked[0].where["op"] == "aten.div.Tensor"


def test_where_trap_leaks_nan_into_the_gradient():  # JAX FAQ: gradients of where with sqrt
    x = torch.tensor([[-1.0, 4.0, 9.0, -4.0]] * 3, requires_grad=True)

    def fn(h):
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x)) + h * 0

    report = run(fn, x=torch.randn(3, 4))
    # where() masks the forward NaN of sqrt(negative), but sqrt's backward reuses that NaN output:
    # the blame is the forward sqrt, and the value it reaches is x's gradient.
    f = only_producer(report)
    assert (f.where["op"], f.where["phase"]) == ("aten.sqrt.default", "forward")
    assert f.evidence["reaches"] == ["gradient of input"]
    assert x.grad is not None and torch.isnan(x.grad).any()


def test_backward_only_inf_gradient():  # detect_anomaly is silent on Inf-only gradients
    class Sqrt(nn.Module):
        def forward(self, h):
            return torch.sqrt(h * 0)  # forward 0, backward 0.5 / sqrt(0) = inf

    net = nn.Sequential(nn.Linear(4, 4), Sqrt())
    with fpdoctor.trace(net) as t:
        net(torch.randn(2, 4)).sum().backward()
    f = only_producer(t.report, "first Inf")
    assert f.where["phase"] == "backward" and f.where["module"] == "1"
    assert f.where["forward_op"] == "aten.sqrt.default"
    assert any("gradient of 0.weight" in r for r in f.evidence["reaches"])
    assert not [g for g in named(t.report, "nonfinite-produced") if g.where["phase"] == "forward"]


def test_nan_in_the_data_is_an_input_problem():  # TF: NaN fed through a placeholder
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    report = run(lambda h: h, x=x)
    inputs = named(report, "nonfinite-input")
    assert len(inputs) == 1 and inputs[0].evidence["origin"] == "input" and inputs[0].evidence["count"] == 1
    assert not named(report, "nonfinite-produced")


def test_nan_in_a_parameter_is_named():
    torch.manual_seed(0)
    net = Net(lambda h: h)
    with torch.no_grad():
        net.block.lin.bias[0] = float("nan")
    with fpdoctor.trace(net) as t:
        net(torch.randn(3, 4)).sum().backward()
    inputs = named(t.report, "nonfinite-input")
    assert [f.where["input"] for f in inputs] == ["block.lin.bias"]
    assert not named(t.report, "nonfinite-produced")


def test_nan_inside_a_loop_names_the_iteration():  # JAX: NaN inside lax.scan / fori_loop
    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h, step):
            h = self.lin(h)
            return h / (h - h) if step == 3 else torch.tanh(h)

    class RNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = Cell()

        def forward(self, h):
            for step in range(5):
                h = self.cell(h, step)
            return h

    rnn = RNN()
    with fpdoctor.trace(rnn) as t:
        rnn(torch.randn(2, 4))
    f = only_producer(t.report, "first Inf")
    assert f.where["module"] == "cell" and f.where["iteration"] == 4  # step 3 of range(5): the 4th call


def test_in_place_op():
    report = run(lambda h: h.mul_(0).div_(0.0), backward=False)
    assert only_producer(report).where["op"].startswith("aten.div_")


def test_custom_function_backward():  # PyTorch: anomaly mode with a custom Function's backward
    class BadGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h):
            return h * 2

        @staticmethod
        def backward(ctx, g):
            return g * float("inf") - g * float("inf")  # inf - inf = nan

    report = run(BadGrad.apply)
    f = only_producer(report)
    assert f.where["phase"] == "backward" and "BadGradBackward" in f.where["autograd_node"]


def test_double_backward():  # PyTorch: anomaly mode and double backward
    x = torch.zeros(3, requires_grad=True)
    with fpdoctor.trace() as t:
        y = (x**1.5).sum()  # d/dx = 1.5 x^0.5 (finite at 0); d2/dx2 = 0.75 x^-0.5 = inf at 0
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        g.sum().backward()
    f = only_producer(t.report, "first Inf")
    assert f.where["phase"] == "backward"
    assert torch.isinf(x.grad).all()


def test_activation_checkpoint_recompute_is_backward():
    class Seg(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, h):
            return torch.sqrt(self.lin(h) * 0)  # backward inf, forward finite

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.seg = Seg()

        def forward(self, h):
            return checkpoint(self.seg, h, use_reentrant=False)

    net = Outer()
    with fpdoctor.trace(net) as t:
        net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert all(r.phase == "backward" for r in t.records if r.recompute)
    assert any(r.recompute for r in t.records)
    assert not [f for f in named(t.report, "nonfinite-produced") if f.where["phase"] == "forward"]
    assert only_producer(t.report, "first Inf").where["phase"] == "backward"


@dataclasses.dataclass
class Out:
    value: torch.Tensor
    aux: float


def test_dict_tuple_dataclass_and_non_tensor_outputs():
    class Multi(nn.Module):
        def forward(self, h):
            return {"ok": h, "bad": (h / 0, Out(h, 1.0)), "n": 3, "none": None}

    class Wrap(nn.Module):
        def forward(self, h):
            return Out(h / 0, 2.0)  # the only place the Inf goes is a dataclass field

    net = nn.Sequential(nn.Linear(4, 4))
    multi = Multi()
    with fpdoctor.trace() as t:
        out = multi(net(torch.randn(2, 4)))
        Wrap()(torch.ones(2))
    assert torch.isinf(out["bad"][0]).any()
    f = only_producer(t.report, "first Inf")
    assert f.where["op"].startswith("aten.div")
    assert f.evidence["reaches"] == ["output of module Multi (call 1)"]
    # the Inf that leaves only through a dataclass field reaches a sink too
    (other,) = f.evidence["other_producers"]
    assert other.startswith("aten.div.Tensor in module `Wrap` (forward) at ") and other.endswith(
        f":{Wrap.forward.__code__.co_firstlineno + 1} in forward"
    )


def test_integer_and_bool_tensors_are_skipped():
    with fpdoctor.trace() as t:
        x = torch.randn(4, 4)
        idx = x.argmax(-1)
        mask = x > 0
        y = torch.gather(x, 1, idx[:, None]) * mask.float().sum()
    assert t.report.verdict == "ok" and y.isfinite().all()
    assert all(o.dtype.startswith("torch.float") for r in t.records for o in r.outputs)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_module_at_op_level():
    @torch.jit.script
    def scripted(h: torch.Tensor) -> torch.Tensor:
        return torch.log(h - h)

    with fpdoctor.trace() as t:
        scripted(torch.randn(3))
    assert only_producer(t.report, "first Inf").where["op"] == "aten.log.default"


def test_optimizer_step_writes_nan_into_a_parameter():
    lin = nn.Linear(4, 1)
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3, eps=0.0)
    with fpdoctor.trace(lin) as t:
        (lin(torch.randn(2, 4)) * 0).sum().backward()  # zero gradients: Adam divides 0 by sqrt(0) + 0
        opt.step()
    f = only_producer(t.report)
    assert f.where["phase"] == "optimizer"
    assert any(r.startswith("parameter") for r in f.evidence["reaches"])


def test_attention_mask_rows():  # masked attention: partial rows are fine, a fully masked row is NaN
    def attend(scores, mask):
        return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)

    scores = torch.randn(4, 4)
    partial = torch.triu(torch.ones(4, 4, dtype=torch.bool), diagonal=1)  # causal: no row fully masked
    with fpdoctor.trace() as t:
        attend(scores, partial)
    assert t.report.verdict == "ok"
    full = partial.clone()
    full[2] = True
    with fpdoctor.trace() as t:
        attend(scores, full)
    f = only_producer(t.report)
    assert f.where["op"].startswith("aten._softmax") and "turned -inf into nan" in f.title


class CausalAttention(nn.Module):
    """nn.MultiheadAttention under a causal mask made with masked_fill(-inf); `fault` runs on its input."""

    def __init__(self, fault):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)
        self.fault = fault

    def forward(self, x):
        n = x.shape[1]
        mask = torch.zeros(n, n).masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        h = self.fault(self.emb(x))
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return self.head(a)


@pytest.mark.parametrize("where", ["nan-producer", "inf-input"])
def test_a_causal_masks_minus_inf_does_not_lead_when_the_fault_is_elsewhere(where):
    # the mask's -inf reaches the outputs only alongside the real NaN: it is not the cause
    torch.manual_seed(0)
    model = CausalAttention(torch.sqrt if where == "nan-producer" else (lambda h: h))
    x = torch.randn(2, 5, 8)
    if where == "inf-input":
        x[0, 3, 0] = float("inf")
    with fpdoctor.trace(model) as t:
        model(x).mean().backward()
    lead = next(f for f in t.report.findings if f.name in ("nonfinite-produced", "nonfinite-input"))
    assert all("masked_fill" not in f.where.get("op", "") for f in t.report.findings)
    if where == "nan-producer":
        assert lead.where["op"] == "aten.sqrt.default" and lead.evidence["first"] == "first NaN"
    else:
        assert lead.name == "nonfinite-input" and lead.evidence["kind"] == "+inf"


def test_a_minus_inf_mask_that_reaches_the_loss_alone_is_still_named():
    # nothing else to blame: the -inf written by the code is the story
    x = torch.randn(4, 4, requires_grad=True)
    with fpdoctor.trace() as t:
        x.masked_fill(torch.eye(4, dtype=torch.bool), float("-inf")).sum()
    f = only_producer(t.report, "first Inf")
    assert f.where["op"] == "aten.masked_fill.Scalar"


def test_raise_on_nonfinite_stops_at_the_producer():
    seen = []

    def fn(h):
        bad = h / (h - h)
        seen.append("after")
        return bad

    net = Net(fn)
    with pytest.raises(fpdoctor.NonFiniteError) as info, fpdoctor.trace(net, raise_on="nonfinite"):
        net(torch.randn(2, 4))
    assert isinstance(info.value, FloatingPointError)
    assert info.value.finding.where["op"] == "aten.div.Tensor"
    assert seen == []  # raised inside the op, before the rest of the forward ran


def test_raise_on_validates():
    with pytest.raises(ValueError, match="raise_on"):
        fpdoctor.trace(raise_on="nan")


def test_a_clean_run_is_clean():
    report = run(torch.tanh)
    assert report.verdict == "ok" and report.findings == []


def test_a_model_compiled_before_the_trace_runs_eagerly_under_it():
    net = Net(lambda h: h / (h - h))
    compiled = torch.compile(net, backend="eager")
    x = torch.randn(2, 4)
    compiled(x)  # its graph compiled before the trace: not wrapped, so not run compiled while traced
    with fpdoctor.trace(compiled) as t:
        compiled(x)
    f = only_producer(t.report, "first Inf")
    assert f.where["module"] == "block" and f.where["op"] == "aten.div.Tensor"
    assert "ran eagerly" in t.report.data["not_checked"]["torch.compile"]


def test_other_producers_name_each_op_and_line_once():
    """The same op on the same line making NaN on five steps is one other producer, not five lines of
    the same text (trial79)."""
    model = torch.nn.Linear(4, 4)
    with fpdoctor.trace(model) as t:
        for _ in range(6):
            out = model(torch.randn(2, 4))
            first = torch.log(out - out - 1.0)  # NaN at every step, its own line
            second = torch.sqrt(out - out - 1.0)  # and another line
            (first + second).sum().backward()
    found = [f for f in t.report.findings if "other_producers" in f.evidence]
    assert found, [f.name for f in t.report.findings]
    for f in found:
        others = f.evidence["other_producers"]
        assert len(others) == len(set(others)), others
