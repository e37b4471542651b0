"""audit explains every dtype/device mismatch PyTorch raises - in Python, in composite ops, in
loss functions, index and scatter ops - with each operand's origin; any other error is a finding
too: an error is never OK."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fpdoctor
from tests.conftest import ROOT, run_fpdoctor
from tests.precision import factories


class WithLoss(nn.Module):
    """Returns the loss, as training wrappers do; the target is made in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        target = (labels > 0).float()  # fp32 whatever the model's dtype
        return F.binary_cross_entropy(torch.sigmoid(logits), target)


def with_loss():
    torch.manual_seed(0)
    return WithLoss().half(), (torch.randn(4, 8).half(), torch.randint(0, 2, (4, 1)))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


class HalfBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        self.conv.bias = nn.Parameter(self.conv.bias.detach().half())  # a checkpoint loaded into one tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8).half(), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x.half()), self.k(x), self.v(x)
        return F.scaled_dot_product_attention(q, k, v)


class Cache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).half()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.index_put_((torch.tensor([0, 1]),), self.proj(x))
        return self.cache


class Scatter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.zeros(2, 8).scatter_add(0, torch.zeros(2, 8, dtype=torch.long), h)


class Batched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8).half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (batch, 8) in fp16
        return torch.bmm(torch.ones(2, 1, 2), h.view(2, 2, 4))  # expected scalar type Float but found Half


CASES = {
    "loss": (with_loss, "", "a tensor cast to torch.float32 by .to()/.float()"),
    "rnn": (lambda: (Recurrent(), torch.randn(2, 3, 8).half()), "rnn", "input inputs[0]"),
    "conv-bias": (lambda: (HalfBias(), torch.randn(2, 4, 8)), "conv", "parameter conv.bias"),
    "sdpa": (lambda: (Attention(), torch.randn(2, 4, 8)), "", "parameter q.bias"),
    "index_put": (lambda: (Cache(), torch.randn(2, 8).half()), "", "buffer cache"),
    "scatter": (lambda: (Scatter(), torch.randn(2, 8).half()), "", "a tensor made by aten.zeros.default"),
    "bmm": (lambda: (Batched(), torch.randn(2, 8).half()), "", "a tensor made by aten.ones.default"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_dtype_mismatch_is_explained_with_its_operands_origin(case):
    make, module, entered = CASES[case]
    model, inputs = make()
    report = fpdoctor.audit(model, inputs).report
    assert report.verdict == "error", case  # before: "ok" with the error under "not checked" for most
    mismatch = report.by_name("dtype-mismatch")[0]
    assert mismatch.where["module"] == module
    assert entered in mismatch.evidence["entered_at"], mismatch.evidence["entered_at"]
    dtypes = {o["dtype"] for o in mismatch.evidence["operands"]}
    assert {"torch.float16", "torch.float32"} <= dtypes


def test_a_target_made_by_float_in_the_forward_names_that_line():
    model, inputs = with_loss()
    mismatch = fpdoctor.audit(model, inputs).report.by_name("dtype-mismatch")[0]
    source = Path(__file__).read_text().splitlines()
    line = next(i for i, text in enumerate(source, 1) if "target = (labels > 0).float()" in text)
    assert f"test_audit_errors.py:{line})" in mismatch.evidence["entered_at"]
    assert "not a fixed torch.float32" in mismatch.fix and "torch.float16" in mismatch.fix


def test_an_error_that_is_no_dtype_mismatch_is_still_an_error():
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    report = fpdoctor.audit(model, torch.randn(2, 5)).report  # a wrong input width
    assert report.verdict == "error"  # before: "ok", the error tucked under "not checked"
    failed = report.by_name("forward-failed")[0]
    assert failed.where["module"] == "0" and "RuntimeError" in failed.message
    assert dict(report.data["summary"])["forward"].startswith("raised RuntimeError")


def test_a_missing_half_kernel_gets_a_hint():
    class Solve(nn.Module):
        def forward(self, x):
            return torch.linalg.cholesky(x @ x.transpose(-1, -2) + torch.eye(4, dtype=x.dtype))

    x = torch.randn(4, 4).half()
    try:
        Solve()(x)
    except (RuntimeError, NotImplementedError):
        pass
    else:
        pytest.skip("this torch has a Half Cholesky kernel on CPU: nothing to report")
    failed = fpdoctor.audit(Solve(), x).report.by_name("forward-failed")[0]
    assert "no kernel for Half on this device" in failed.fix


def test_a_parameter_shape_is_its_own_not_the_transposed_view():
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 16))
    model[1].half()
    mismatch = fpdoctor.audit(model, torch.randn(2, 32)).report.by_name("dtype-mismatch")[0]
    weight = next(o for o in mismatch.evidence["operands"] if o.get("name") == "1.weight")
    assert weight["shape"] == [16, 64] and weight["shape_used"] == [64, 16]  # before: [64, 16], transposed


def test_audit_cli_exits_1_for_any_forward_error(tmp_path):
    result = run_fpdoctor(
        "audit", "tests.precision.test_audit_errors:wrong_width", "--format", "json", env={"PYTHONPATH": str(ROOT)}
    )
    assert result.code == 1, result.err
    doc = factories.loads_strict(result.out)
    assert doc["verdict"] == "error" and doc["findings"][0]["name"] == "forward-failed"


def wrong_width():
    return nn.Sequential(nn.Linear(8, 8)), torch.randn(2, 5)


def test_a_fix_that_only_moves_the_crash_is_followed_to_the_end():
    """Mostly fp16 with an fp32 tail: casting the input alone moves the failure to the tail."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8))
    model[0].half()
    x = torch.randn(4, 64)  # the fp32 inputs the user has
    mismatch = fpdoctor.audit(model, x).report.by_name("dtype-mismatch")[0]
    assert mismatch.where["module"] == "0" and mismatch.evidence["entered_at"] == "input inputs[0]"
    # before: "cast the input" alone, which only moved the crash to module 2
    steps = mismatch.evidence["fix_checked"]
    assert [s["fix"] for s in steps] == [
        "inputs[0].to(torch.float16)   # the input",
        "model.get_submodule('2').to(torch.float16)",
    ]
    assert (
        steps[0]["then"].startswith("aten.addmm.default in module `2` fails") and steps[1]["then"] == "the forward runs"
    )
    assert "One fix alone only moves the failure" in mismatch.message
    assert mismatch.fix.startswith("# all of:\ninputs[0].to(torch.float16)")
    assert model[2].weight.dtype == torch.float32  # the model is left as it was


def test_a_fix_that_works_alone_is_said_to():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)).half()
    mismatch = fpdoctor.audit(model, torch.randn(2, 8)).report.by_name("dtype-mismatch")[0]
    assert mismatch.evidence["fix_checked"] == [
        {"fix": "inputs[0].to(torch.float16)   # the input", "then": "the forward runs"}
    ]
    assert mismatch.message.endswith("With the fix below, the forward runs (checked).")


def test_an_error_no_aten_op_saw_names_the_call_not_an_op():
    model, x = CASES["sdpa"][0]()
    mismatch = fpdoctor.audit(model, x).report.by_name("dtype-mismatch")[0]
    assert mismatch.where.get("op") is None  # where.op is an aten overload, unknown here
    assert mismatch.message.startswith("F.scaled_dot_product_attention in module `<root>` got")
