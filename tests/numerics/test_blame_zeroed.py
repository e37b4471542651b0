"""An overflow's Inf that a later op turns into zeros is an error, not a harmless masked value."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class RMSNorm(nn.Module):  # hand-written, as many models have it: the variance in the input's dtype
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float16))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)

    def forward(self, x):
        return self.norm(x)


def names(report):
    return [f.name for f in report.findings]


def test_fp16_rmsnorm_whose_variance_overflows_outputs_zeros():
    x = torch.ones(4, 8, dtype=torch.float16)
    x[1] = 300.0  # 300**2 = 90000 > 65504: pow overflows for this row only
    net = Net()
    with fpdoctor.trace(net) as t:
        y = net(x)
    assert torch.isfinite(y).all() and (y[1] == 0).all()  # what the user sees: zeros, no NaN
    assert t.report.verdict == "error"
    assert "nonfinite-masked" not in names(t.report)
    (f,) = [f for f in t.report.findings if f.name == "nonfinite-zeroed"]
    assert f.code == "NUM008" and f.severity.value == "error"
    assert f.where["module"] == "norm" and f.where["op"] == "aten.pow.Tensor_Scalar"
    assert f.where["phase"] == "forward" and f.where["zeroed_by"] == "aten.rsqrt.default"
    assert f.evidence["kind"] == "+inf" and f.evidence["count"] == 8 and f.evidence["numel"] == 32
    assert f.evidence["dtype"] == "torch.float16"
    assert "output of module norm" in " ".join(f.evidence["reaches"])
    assert "rsqrt turned" not in f.message and "turned the Inf into 0" in f.message
    assert "bfloat16" in f.fix  # an overflow from finite fp16 inputs: range, so bf16 is offered


def test_division_by_an_overflowed_value_is_zeroed():
    class Scale(nn.Module):
        def forward(self, x):
            return x / (x * 1000.0)  # fp16: 100 * 1000 overflows, x / inf = 0

    x = torch.full((2, 3), 100.0, dtype=torch.float16)
    with fpdoctor.trace(Scale()) as t:
        Scale()(x)
    (f,) = [f for f in t.report.findings if f.name == "nonfinite-zeroed"]
    assert f.where["op"] == "aten.mul.Tensor" and f.where["zeroed_by"] == "aten.div.Tensor"


def test_masking_an_attention_mask_stays_masked():
    class Attention(nn.Module):
        def forward(self, scores, mask):
            masked = scores.masked_fill(mask, float("-inf"))
            return masked.exp() / masked.exp().sum(-1, keepdim=True)  # a hand-written softmax

    scores = torch.randn(2, 4)
    mask = torch.tensor([[False, True, True, False]] * 2)
    with fpdoctor.trace(Attention()) as t:
        Attention()(scores, mask)
    assert "nonfinite-zeroed" not in names(t.report)
    assert t.report.verdict != "error"


def test_where_that_discards_an_overflow_stays_masked():
    class Guard(nn.Module):
        def forward(self, x):
            y = x * 1000.0
            return torch.where(torch.isfinite(y), y, torch.zeros_like(y))

    x = torch.full((2, 3), 100.0, dtype=torch.float16)
    with fpdoctor.trace(Guard()) as t:
        Guard()(x)
    assert names(t.report) == ["nonfinite-masked"]


def test_an_overflow_nobody_uses_is_masked_not_zeroed():
    class Unused(nn.Module):
        def forward(self, x):
            torch.rsqrt(x * 1000.0)  # zeroed, but the result is dropped
            return x + 1

    x = torch.full((2, 3), 100.0, dtype=torch.float16)
    with fpdoctor.trace(Unused()) as t:
        Unused()(x)
    assert names(t.report) == ["nonfinite-masked"]


def test_an_in_place_division_by_an_overflowed_norm_is_zeroed():
    """A per-tensor gradient normalisation in fp16, p.grad.div_(rms): the mean of squares overflows,
    the in-place division turns the gradient into zeros (before: 'masked', fix 'usually nothing')."""
    layer = nn.Linear(8, 8).half()
    with fpdoctor.trace(layer) as t:
        layer(torch.full((4, 8), 40.0, dtype=torch.float16)).float().sum().mul(100).backward()
        for p in layer.parameters():
            p.grad.div_(p.grad.pow(2).mean().sqrt() + 1e-6)
    assert all(bool((p.grad == 0).all()) for p in layer.parameters())
    (f,) = [f for f in t.report.findings if f.name == "nonfinite-zeroed"]
    assert f.where["zeroed_by"] == "aten.div_.Tensor" and f.severity.value == "error"
    assert "nonfinite-masked" not in names(t.report)


def test_a_division_by_a_constant_is_not_told_to_guard_its_denominator():
    """logits / 0.05 (a temperature) overflowing fp16: there is no denominator that can be 0."""

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8).half()

        def forward(self, x):
            return self.proj(x) / 0.0001

    net = Tempered()
    with fpdoctor.trace(net) as t:
        net(torch.full((2, 8), 40.0, dtype=torch.float16))
    (f,) = [f for f in t.report.findings if f.name == "nonfinite-produced"]
    assert "guard the denominator" not in f.fix and "division by a constant" in f.fix, f.fix
