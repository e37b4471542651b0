"""overflow-risk for op outputs inside modules: values near a format's max that no module output shows."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.api import Trace
from fpdoctor.numerics.trace.headroom import MAX_OP_FINDINGS

FP16_MAX = 65504.0


class Attention(nn.Module):
    """Unscaled attention: the q·kᵀ scores, made in this forward, are the model's largest values."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # (batch, tokens, tokens)
        return torch.softmax(scores, dim=-1) @ self.v(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x))


_SOURCE, _FIRST = inspect.getsourcelines(Attention.forward)
SCORES_LINE = _FIRST + next(n for n, text in enumerate(_SOURCE) if "scores =" in text)


def block_at(share: float, dtype: torch.dtype = torch.float16) -> tuple[Block, torch.Tensor]:
    """A block whose attention scores reach `share` of fp16's max (measured in fp64)."""
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 16, 64)
    with torch.no_grad():
        attn = block.attn
        top = float((attn.q(x).double() @ attn.k(x).double().transpose(-1, -2)).abs().max())
        factor = math.sqrt(share * FP16_MAX / top)
        attn.q.weight.mul_(factor)
        attn.k.weight.mul_(factor)
    return block.to(dtype), x.to(dtype)


def risks(report: fpdoctor.Report) -> list[fpdoctor.Finding]:
    return [f for f in report.findings if f.name == "overflow-risk"]


@pytest.mark.parametrize("immediate", [None, False], ids=["immediate", "deferred"])
def test_fp16_scores_at_62_percent_are_named_at_their_matmul(immediate):
    block, x = block_at(0.62)
    with Trace(block, headroom=True, immediate=immediate) as t:
        block(x)
    (risk,) = risks(t.report)  # the attention's output and every module output stay small
    assert risk.where["module"] == "attn" and risk.where["op"] == "aten.bmm.default"
    assert risk.where["phase"] == "forward" and risk.where["iteration"] == 1
    assert risk.where["file"] == __file__ and risk.where["line"] == SCORES_LINE
    assert risk.evidence["target"] == "fp16" and not risk.evidence["what_if"]
    assert 0.60 < risk.evidence["share"] < 0.64 and risk.evidence["dtype"] == "torch.float16"
    assert risk.evidence["location"].startswith(f"{__file__}:{SCORES_LINE} in forward")
    assert "62% of the fp16 max" in risk.message and "1.61x larger overflow fp16" in risk.message
    assert risk.severity.value == "warning"


def test_fp32_scores_at_62_percent_are_an_fp16_what_if_with_exact_ranges():
    block, x = block_at(0.62, torch.float32)
    with Trace(block, headroom=True, ranges=True) as t:  # exact fp32 ranges on CPU
        block(x)
    (risk,) = risks(t.report)
    assert (risk.where["module"], risk.where["op"], risk.where["line"]) == ("attn", "aten.bmm.default", SCORES_LINE)
    assert risk.evidence["what_if"] and risk.evidence["target"] == "fp16"
    assert risk.evidence["dtype"] == "torch.float32" and 0.61 < risk.evidence["share"] < 0.63
    assert abs(risk.evidence["absmax"] - 0.62 * FP16_MAX) < 0.01 * FP16_MAX
    assert "in fp32" in risk.message and "in fp16, values 1.61x larger would overflow" in risk.message


def test_without_exact_ranges_fp32_ops_are_not_judged_against_fp16():
    block, x = block_at(0.62, torch.float32)
    with Trace(block, headroom=True, ranges=False) as t:  # an fp32 sum per op, as with no fp16 target
        block(x)
    assert not t.tracer.ranges
    assert not [r for r in risks(t.report) if r.where.get("op") == "aten.bmm.default"]


def test_the_public_trace_asks_for_exact_ranges_itself_and_judges_fp16_ops_without_headroom():
    block, x = block_at(0.62, torch.float32)
    with fpdoctor.trace(block, headroom=True) as t:  # no private flag: headroom with an fp16 target sets it
        block(x)
    (risk,) = risks(t.report)
    assert risk.where["op"] == "aten.bmm.default" and risk.evidence["what_if"]
    block, x = block_at(0.62)
    with fpdoctor.trace(block) as t:  # values in fp16 are judged per op with headroom off too
        block(x)
    (risk,) = risks(t.report)
    assert risk.where["line"] == SCORES_LINE and not risk.evidence["what_if"]


def test_fp32_what_ifs_on_an_accelerator_path_need_no_extra_reduction():
    # deferred mode (how accelerators run) takes every op's exact range anyway
    block, x = block_at(0.62, torch.float32)
    with Trace(block, headroom=True, immediate=False) as t:
        block(x)
    (risk,) = risks(t.report)
    assert risk.where["op"] == "aten.bmm.default" and risk.evidence["what_if"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_from_half_the_max_on_not_at_40_percent(dtype):
    found = {}
    for share in (0.40, 0.52):
        block, x = block_at(share, dtype)
        with Trace(block, headroom=True, immediate=False) as t:
            block(x)
        found[share] = [f.where["op"] for f in risks(t.report)]
    assert found == {0.40: [], 0.52: ["aten.bmm.default"]}


def test_a_module_output_near_the_limit_is_one_finding_with_its_line():
    torch.manual_seed(0)
    lin = nn.Linear(16, 16)
    with torch.no_grad():
        lin.weight.fill_(0.7 * FP16_MAX / 16)
        lin.bias.zero_()
    with Trace(lin, headroom=True, immediate=False) as t:
        line = inspect.currentframe().f_lineno + 1
        lin(torch.ones(2, 16))
    (risk,) = risks(t.report)  # the module's output and the addmm that made it: one finding
    assert risk.where["module"] == "" and risk.where["op"] == "aten.addmm.default"
    assert risk.where["line"] == line and risk.evidence["numel"] == 32 and risk.evidence["what_if"]
    assert "Module `<root>`'s output reaches 70% of the fp16 max" in risk.message


class Many(nn.Module):
    """Twelve modules each scaling its input by its own factor, each called twice."""

    def __init__(self, factors: list[float]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Scale(f) for f in factors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([p(x) for p in self.parts] + [p(x * 0.5) for p in self.parts]).sum(0) * 0


class Scale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.factor).tanh()


def test_op_findings_are_the_worst_per_module_and_op_largest_first_and_bounded():
    shares = [0.51 + 0.04 * n for n in range(12)]  # 51% .. 95%
    model = Many([s * FP16_MAX for s in shares]).half()
    with Trace(model, headroom=True) as t:
        model(torch.ones(4, dtype=torch.float16))
    found = risks(t.report)
    assert len(found) == MAX_OP_FINDINGS
    got = [f.evidence["share"] for f in found]
    assert got == sorted(got, reverse=True)
    # the worst call of each module (the first: x, not x * 0.5), the largest shares first
    assert [f.where["module"] for f in found] == [f"parts.{n}" for n in range(11, 1, -1)]
    assert all(f.where["op"] == "aten.mul.Tensor" and f.where["iteration"] == 1 for f in found)
    assert got[0] == pytest.approx(shares[-1], rel=1e-3)


def test_an_attention_mask_filled_with_the_format_minimum_is_not_a_risk():
    class Masked(nn.Module):
        def forward(self, scores: torch.Tensor) -> torch.Tensor:
            mask = torch.ones_like(scores, dtype=torch.bool).triu(1)
            return torch.softmax(scores.masked_fill(mask, torch.finfo(scores.dtype).min), dim=-1)

    with Trace(Masked(), headroom=True) as t:
        Masked()(torch.randn(2, 8, 8, dtype=torch.float16))
    assert risks(t.report) == []  # -65504 is a chosen value, not a computed one


def test_fp16_what_ifs_are_asked_of_fp32_models_only():
    # the casebook's fixed attention: scores at ~216% of fp16's max, computed in fp32 on purpose
    from fpdoctor.casebook import attention

    found = {}
    for dtype in (torch.float32, torch.float16):
        block, frames = attention.build(fp32_scores=True)
        block, frames = block.to(dtype), frames.to(dtype)
        with Trace(block, headroom=True, immediate=False) as t:
            block(frames)
        found[dtype] = [(f.where["module"], f.where["op"], f.evidence["what_if"]) for f in risks(t.report)]
    assert found[torch.float32] == [("attn", "aten.bmm.default", True)]
    assert found[torch.float16] == []  # a model in fp16 keeps these fp32 by choice
