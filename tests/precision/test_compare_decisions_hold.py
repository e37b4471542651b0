"""A classifier whose inputs' rounding costs more than the noise floor while its decisions stay the
exact model's: compare warns (the error is the inputs'), and passes, rather than failing a CI job
on a model whose every decision is right. Not where a few rows cannot tell, nor where half flip, nor
for a module's divergence (an output read as logits may be a regression head's)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import fpdoctor


class _Centred(nn.Module):
    """Readings near 500 (spread 30), centred inside the model, then a classifier with wide margins;
    `casts`: the centring in fp32 on the inputs as given (as a fixed model does)."""

    def __init__(self, casts: bool) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.casts = casts
        self.register_buffer("centre", torch.full((8,), 500.0))
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            self.head.weight.copy_(4 * torch.randn(4, 8, generator=g))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.casts:
            return self.head((x.float() - self.centre).to(self.head.weight.dtype))
        return self.head(x - self.centre)


def _inputs(rows: int = 256, spread: float = 30.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    centres = spread * torch.randn(4, 8, generator=g)
    labels = torch.arange(rows) % 4
    return 500 + centres[labels] + 0.3 * torch.randn(rows, 8, generator=g)


def test_inputs_rounding_with_decisions_that_hold_is_a_warning_its_fix_checked() -> None:
    result = fpdoctor.compare(_Centred(casts=True).eval(), _inputs(spread=10.0), candidate="bf16")
    found = [f for f in result.report.findings if f.evidence.get("kind") == "input-rounding"]
    assert found and all(f.severity == "warning" for f in found), str(result.report)
    assert "The decisions hold all the same: top-1 agreement" in found[0].message
    assert found[0].fix.startswith("Pass the inputs to the bf16 model unrounded") and found[0].trial.tried
    assert result.report.verdict == "warning" and result.report.data["decisions"]["top1"] >= 0.99


def test_a_few_rows_half_flipped_and_a_modules_divergence_stay_errors() -> None:
    few = fpdoctor.compare(_Centred(casts=False).eval(), 500 + 0.5 * torch.randn(6, 8), candidate="bf16")
    assert few.report.verdict == "error", str(few.report)
    assert not any("decisions hold" in f.message for f in few.report.findings)
    held = fpdoctor.compare(_Centred(casts=False).eval(), _inputs(), candidate="bf16")
    assert held.report.data["decisions"]["top1"] >= 0.99
    assert held.report.verdict == "error", str(held.report)


def test_fewer_rows_than_can_tell_keep_the_inputs_rounding_an_error() -> None:
    """64 rows, none flipped: one flip would be 1.6%, so "the decisions hold" cannot be told."""
    result = fpdoctor.compare(_Centred(casts=True).eval(), _inputs(rows=64, spread=10.0), candidate="bf16")
    found = [f for f in result.report.findings if f.evidence.get("kind") == "input-rounding"]
    assert found and found[0].severity == "error", str(result.report)
    assert result.report.data["decisions"]["top1"] == 1.0


class Fp32Head(nn.Module):
    """A small LM whose head runs in fp32 in its forward (a fix in place): the candidate returns fp32
    logits, which rounding to bf16 would flip as often as its bf16 body does."""

    def __init__(self, vocab: int = 2000, dim: int = 128) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + 8.0  # features off centre: the bf16 body rounds them, and flips some decisions
        h = self.norm(h + self.body(h))
        return F.linear(h.float(), self.head.weight.float())


def test_logits_returned_in_fp32_are_judged_against_fp32s_floor_not_the_formats():
    torch.manual_seed(0)
    ids = torch.randint(0, 2000, (4, 256), generator=torch.Generator().manual_seed(1))
    result = fpdoctor.compare(Fp32Head().eval(), ids, candidate="bf16")
    decisions = result.report.data["decisions"]
    assert decisions["floor_format"] == "fp32" and decisions["floor_top1"] == 1.0
    assert decisions["top1"] < 0.98  # the bf16 body flips them (rounding the exact output to bf16: 1%): not OK
    assert result.report.by_name("decisions-changed")
