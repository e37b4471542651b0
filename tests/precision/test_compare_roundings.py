"""A float rounded to an integer inside the model is a choice: which bucket, which table row. In
bf16 values near a boundary land in the next bucket, what follows reads another embedding row, and
no module or op stands out by its own error (the embedding is exact; what it was fed differs). The
finding names the rounding at its line, with the lines in fp32 that give the integers back, checked.
Two forms: an event model's log-scaled time-gap buckets (floor), and a price standardised inside the
model and bucketized, whose fix needs the inputs fed in fp32 (the cast rounds the raw price)."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class TimeGaps(nn.Module):
    """Event gaps in seconds bucketed on a log scale into an embedding, in the model's dtype; `fixed`:
    the bucket line in fp32, as the fix says."""

    def __init__(self, fixed: bool = False, buckets: int = 64, d: int = 32) -> None:
        super().__init__()
        self.fixed, self.buckets = fixed, buckets
        self.gap_emb = nn.Embedding(buckets, d)
        self.inp = nn.Linear(8, d)
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, gaps: torch.Tensor) -> torch.Tensor:
        g = gaps.float() if self.fixed else gaps.to(self.inp.weight.dtype)
        idx = (torch.log1p(g) * 4.0).floor().long().clamp(0, self.buckets - 1)
        return self.out(torch.tanh(self.inp(x) + self.gap_emb(idx))).squeeze(-1)


class PriceBins(nn.Module):
    """A price standardised inside the model, bucketized against fixed edges."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.register_buffer("edges", torch.linspace(-3, 3, 63))
        self.emb = nn.Embedding(64, d)
        self.head = nn.Sequential(nn.Linear(d + 4, 64), nn.ReLU(), nn.Linear(64, 3))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        z = (feats[:, 0] - 2.5) * 1.7
        bins = torch.bucketize(z, self.edges.to(z.dtype))
        return self.head(torch.cat([self.emb(bins), feats[:, 1:]], -1))


def _gaps() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 50, 8, generator=g), torch.exp(torch.rand(64, 50, generator=g) * 12)  # up to 1.6e5 s


def test_a_bucket_index_rounded_otherwise_is_named_with_its_line_in_fp32_checked() -> None:
    torch.manual_seed(0)
    model, inputs = TimeGaps().eval(), _gaps()
    result = fpdoctor.compare(model, inputs, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "selection-changed" and first.evidence["op"] == "floor", str(result.report)
    assert first.evidence["location"].endswith(":29") and first.evidence["lines_raised"] == [29]
    assert first.trial is not None and first.trial.tried and "integers stay as they are" in first.fix
    # the same cause is not said again as the floor op's own error
    assert [f.name for f in result.report.findings] == ["selection-changed"], [f.name for f in result.report.findings]

    fixed = TimeGaps(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    applied = fpdoctor.compare(fixed, inputs, candidate="bf16")
    assert all(f.name != "selection-changed" for f in applied.report.findings), str(applied.report)
    assert applied.rows[-1].propagated * 2 <= result.rows[-1].propagated


def test_a_bucketized_reading_the_cast_rounds_is_checked_on_the_inputs_as_given() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2048, 5, generator=g)
    feats[:, 0] = 2.5 + torch.randn(2048, generator=g) * 0.6
    result = fpdoctor.compare(PriceBins().eval(), feats, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "selection-changed" and first.evidence["op"] == "bucketize", str(result.report)
    assert first.trial is not None and first.trial.tried, first.fix
    assert "pass the model's inputs in fp32" in first.fix and "--inputs-as-given" in first.fix
    assert first.evidence["rows_changed_after"] * 4 <= first.evidence["rows_changed"]
