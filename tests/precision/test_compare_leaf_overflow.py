"""A leaf the user wrote whose own op overflows while the leaf's output stays finite (x divided by an
Inf is 0): a hand-written L2 normalisation whose sum of squares passes fp16's range, a hand-written
cosine whose product of norms does. The divergence finding names the op and its line, says it
overflows, and its fix (the line in fp32, cast back) is checked end to end, where it was a hedge of
three untried options. So is a container's own op (outside its submodules): a linear attention whose
normaliser q . sum(k) passes fp16's range on a long input (1 / Inf = 0: the attention is silently
zero), and a pooling container that divides by a norm of its own Linear's output."""

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


class LinearAttention(nn.Module):
    """phi(x) = elu(x) + 1 attention in linear form: its own ops sit beside its two Linear layers."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = nn.functional.elu(q) + 1, nn.functional.elu(k) + 1
        kv = torch.einsum("bnd,bne->bde", k, v)
        z = 1.0 / (torch.einsum("bnd,bd->bn", q, k.sum(dim=1)) + 1e-6)
        return self.out(torch.einsum("bnd,bde,bn->bne", q, kv, z))


class Pooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h / h.pow(2).sum(-1, keepdim=True).sqrt()


def test_a_containers_own_op_that_overflows_while_its_output_stays_finite_gets_its_line_in_fp32_checked() -> None:
    torch.manual_seed(0)
    attention = nn.Sequential(nn.Embedding(1000, 64), LinearAttention(64)).eval()
    tokens = torch.randint(0, 1000, (2, 4096), generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(attention, tokens, candidate="fp16")
    line = LinearAttention.forward.__code__.co_firstlineno + 4
    first = _checked_line_fix(result, "aten.bmm", line)
    # as printed: that line in fp32, its result cast back to fp16
    model = attention.half()
    inner = model[1]
    with torch.no_grad():
        x = model[0](tokens)
        q, k, v = inner.qkv(x).chunk(3, dim=-1)
        q, k = nn.functional.elu(q) + 1, nn.functional.elu(k) + 1
        kv = torch.einsum("bnd,bne->bde", k, v)
        z = (1.0 / (torch.einsum("bnd,bd->bn", q.float(), k.sum(dim=1).float()) + 1e-6)).half()
        fixed = inner.out(torch.einsum("bnd,bde,bn->bne", q, kv, z)).double()
        exact = attention.double()(tokens)
    assert float((fixed - exact).norm() / exact.norm()) < first.trial.before / 10

    torch.manual_seed(0)
    pooler = Pooler()
    model = _scaled(nn.Sequential(nn.LayerNorm(64), pooler), pooler.proj, by=150.0)
    result = fpdoctor.compare(model, torch.randn(128, 64), candidate="fp16")
    _checked_line_fix(result, "aten.pow", Pooler.forward.__code__.co_firstlineno + 2)


def test_another_input_sets_risk_at_the_line_a_checked_fix_names_is_not_a_second_finding() -> None:
    """Short inputs bring the normaliser near fp16's max (a risk), long ones past it (the divergence,
    its line in fp32 checked): one finding for that line, not a second one from the short set."""
    torch.manual_seed(0)
    attention = nn.Sequential(nn.Embedding(1000, 64), LinearAttention(64)).eval()
    g = torch.Generator().manual_seed(1)
    short, long = torch.randint(0, 1000, (2, 512), generator=g), torch.randint(0, 1000, (2, 4096), generator=g)
    result = fpdoctor.compare(attention, [short, long], candidate="fp16")
    line = LinearAttention.forward.__code__.co_firstlineno + 4
    first = _checked_line_fix(result, "aten.bmm", line)
    assert first.evidence.get("input_set") == 1
    at = [f for f in result.report.findings if f.where.get("line") == line]
    assert not at, [(f.name, f.where) for f in at]
