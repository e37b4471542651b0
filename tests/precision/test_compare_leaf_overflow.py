"""A leaf the user wrote whose own op overflows while the leaf's output stays finite (x divided by an
Inf is 0): a hand-written L2 normalisation whose sum of squares passes fp16's range, a hand-written
cosine whose product of norms does. The divergence finding names the op and its line, says it
overflows, and its fix (the line in fp32, cast back) is checked end to end, where it was a hedge of
three untried options."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class L2Norm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.pow(2).sum(-1, keepdim=True).sqrt()


class Cosine(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256))
        self.norm = L2Norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))


class Pairs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.cos = nn.Linear(32, 256), nn.Linear(32, 256), Cosine()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cos(self.a(x), self.b(x.flip(0)))  # unrelated rows: a small dot, large norms


def _scaled(model: nn.Module, *layers: nn.Linear, by: float) -> nn.Module:
    with torch.no_grad():
        for layer in layers:
            layer.weight.mul_(by)  # a trained encoder's large features
    return model.eval()


def _checked_line_fix(result: fpdoctor.CompareResult, op: str, line: int) -> fpdoctor.Finding:
    first = result.report.findings[0]
    assert first.name == "precision-divergence", str(result.report)
    assert first.evidence.get("overflow_inside") and first.evidence["overflow_op"].startswith(op), first.evidence
    assert f"line {line} " in first.fix and "fp32" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried, first.trial
    assert isinstance(first.trial.after, float) and first.trial.after < 0.01, first.trial
    return first


def test_a_hand_written_l2_norm_whose_sum_overflows_gets_its_line_in_fp32_checked() -> None:
    torch.manual_seed(0)
    model = Encoder()
    model = _scaled(model, model.body[2], by=150.0)
    result = fpdoctor.compare(model, torch.randn(128, 64), candidate="fp16")
    _checked_line_fix(result, "aten.sum", L2Norm.forward.__code__.co_firstlineno + 1)


def test_a_hand_written_cosine_whose_product_of_norms_overflows_gets_its_line_in_fp32_checked() -> None:
    torch.manual_seed(0)
    model = Pairs()
    model = _scaled(model, model.a, model.b, by=35.0)
    result = fpdoctor.compare(model, torch.randn(64, 32), candidate="fp16")
    _checked_line_fix(result, "aten.mul", Cosine.forward.__code__.co_firstlineno + 1)
