"""A router whose changed picks a residual connection dilutes: the MoE block's output is a small part of
`x + moe(norm(x))`, so the end-to-end error stays near bf16's rounding while the tokens the router
sends elsewhere are 10-30x off. No module diverges and no part's error is far below the end-to-end
error; what gives it away is the experts called on other rows than in fp64. compare opens the
selection search there and names the router's top-k with lines in fp32, checked. Where those lines
give back most rows but not all (the rest are ranked on a norm's rounded output before them), the fix
says how far it goes. Two forms: a Mixtral block (softmax, top-2, SwiGLU experts, a router
initialised at std 0.02), a DeepSeek-style block (sigmoid affinities, top-2 of 16, a shared expert)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


def _line(fn: object, text: str) -> int:
    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


class SwiGLU(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = (
            nn.Linear(d, h, bias=False),
            nn.Linear(h, d, bias=False),
            nn.Linear(d, h, bias=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Mixtral(nn.Module):
    def __init__(self, fixed: bool = False, d: int = 64, experts: int = 8) -> None:
        super().__init__()
        self.fixed = fixed
        self.norm, self.gate = nn.LayerNorm(d), nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, 2 * d) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).view(-1, x.shape[-1])
        logits = self.gate(h)
        if self.fixed:  # the printed fix: the softmax and top-k lines in fp32, their weights cast back
            w = F.softmax(logits.float(), dim=-1)
            w, idx = torch.topk(w.float(), 2, dim=-1)
        else:
            w = F.softmax(logits, dim=-1)
            w, idx = torch.topk(w, 2, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, expert(h[tok]) * w[tok, slot, None])
        return x + out.view_as(x)


class Sigmoid(nn.Module):
    def __init__(self, fixed: bool = False, d: int = 64, experts: int = 16) -> None:
        super().__init__()
        self.fixed = fixed
        self.norm, self.gate = nn.RMSNorm(d), nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, 96) for _ in range(experts))
        self.shared = SwiGLU(d, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).view(-1, x.shape[-1])
        if self.fixed:  # the printed fix: the gate by F.linear on fp32 copies, the scores and top-k in fp32
            scores = torch.sigmoid(F.linear(h.float(), self.gate.weight.float()))
            w, idx = torch.topk(scores.float(), 2, dim=-1)
        else:
            scores = torch.sigmoid(self.gate(h))
            w, idx = torch.topk(scores, 2, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        out = self.shared(h)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out = out.index_add(0, tok, expert(h[tok]) * w[tok, slot, None])
        return x + out.view_as(x)


def _mixtral(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Mixtral(fixed).eval()
    nn.init.normal_(model.gate.weight, std=0.02)  # an early checkpoint: the router's logits near 0
    return model, torch.randn(4, 128, 64)


def _sigmoid(fixed: bool = False) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Sigmoid(fixed).eval()
    nn.init.normal_(model.gate.weight, std=0.05)  # affinities near 0.5: bf16 holds them in steps of 0.002
    return model, torch.randn(4, 128, 64)


CASES = [
    pytest.param(_mixtral, Mixtral.forward, ["w = F.softmax(logits, dim=-1)", "w, idx = torch.topk(w, 2"],
                 id="mixtral"),
    pytest.param(_sigmoid, Sigmoid.forward, ["scores = torch.sigmoid(self.gate(h))", "w, idx = torch.topk(scores, 2"],
                 id="sigmoid"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "forward", "lines"), CASES)
def test_a_diluted_router_is_named_with_its_lines_checked_and_the_fix_as_printed_is_ok(
    make: object, forward: object, lines: list[str]
) -> None:
    model, x = make()  # type: ignore[operator]
    report = fpdoctor.compare(model, x, candidate="bf16").report
    assert report.findings and report.findings[0].name == "selection-changed", [f.name for f in report.findings]
    first = report.findings[0]
    ev = first.evidence
    assert first.where["op"] == "aten.topk"
    assert first.trial is not None and first.trial.tried, first.fix
    assert ev["lines_raised"] == sorted(_line(forward, text) for text in lines), (ev["lines_raised"], first.fix)
    assert ev["rows_changed_after"] * 2 <= ev["rows_changed"] and ev["error_after"] < ev["error_before"]
    if ev["rows_changed_after"] * 4 > ev["rows_changed"]:  # as far as the lines go: said so
        assert f"do not give back the other {ev['rows_changed_after']} rows" in first.fix, first.fix

    fixed, x = make(fixed=True)  # type: ignore[operator]
    after = fpdoctor.compare(fixed, x, candidate="bf16").report
    assert not [f for f in after.findings if f.severity in ("error", "warning")], [
        (f.name, f.message[:200]) for f in after.findings
    ]


def test_lines_that_give_every_pick_back_without_the_error_falling_are_no_fix() -> None:
    """The partial rule takes lines that leave some rows changed and take the error down: a selection
    whose picks all come back while the error barely moves does not make the error."""
    from fpdoctor.precision.compare import selections as s

    key = ("model.py:10", "topk", 0)
    truth_rows = torch.arange(100).reshape(100, 1)
    truth = {key: s.Pick("topk", "model.py:10", truth_rows, ("model.py:9",))}
    changed = truth_rows.clone()
    changed[:40] += 1
    found = s.Changed(s.Pick("topk", "model.py:10", changed, ("model.py:9",)), 40, 100, 0.0, error_before=0.020)

    def check(lines: set, given: bool) -> tuple[float, dict]:
        return 0.019, {key: s.Pick("topk", "model.py:10", truth_rows.clone(), ())}

    s.checked(key, found, truth, check, rounded_inputs=False)
    assert found.lines is None and not found.partial


def test_a_plan_that_keeps_nothing_says_the_router_fix_goes_with_it() -> None:
    """plan's target is the end-to-end error, which the diluted router stays within: a verified plan that
    keeps nothing says the selection finding beside it is an error no module kept in fp32 takes away."""
    model, x = _mixtral(False)
    report = fpdoctor.plan(model, x, candidate="bf16").report
    summary = dict(report.data["summary"])
    assert report.by_name("selection-changed"), [f.code for f in report.findings]
    assert summary["verified"].startswith("yes") and "but not the whole fix: NUM022" in summary["verified"], summary
