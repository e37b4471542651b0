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


def test_inputs_passed_by_keyword_are_checked_as_given_too() -> None:
    class ByKeyword(PriceBins):
        def forward(self, feats: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
            assert feats is not None
            return super().forward(feats)

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2048, 5, generator=g)
    feats[:, 0] = 2.5 + torch.randn(2048, generator=g) * 0.6
    result = fpdoctor.compare(ByKeyword().eval(), {"feats": feats}, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "selection-changed" and first.trial is not None and first.trial.tried, first.fix


class _Centre(nn.Module):
    """A variance by hand that bf16 cancels: a module that diverges by itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(-1, keepdim=True)
        return (x - m) * ((x * x).mean(-1, keepdim=True) - m * m)


class _Film(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d) * 1e-3)

    def forward(self, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return h * (1 + torch.sin(t * self.w))


class _Diverged(nn.Module):
    """The divergence upstream, a gate after it, a leaf that also reads a timestep up to 1000."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.centre, self.lin, self.film, self.head = _Centre(), nn.Linear(d, d), _Film(d), nn.Linear(d, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.centre(x))
        return self.head(self.film(h * (h > 0), t))


def test_a_leaf_far_off_behind_a_module_that_diverges_opens_no_selection_search() -> None:
    torch.manual_seed(0)
    x, t = 8 + torch.randn(512, 64), torch.randint(0, 1000, (512, 1)).float()
    result = fpdoctor.compare(_Diverged().eval(), (x, t), candidate="bf16")
    names = [f.name for f in result.report.findings]
    assert names[0] == "precision-divergence" and "selection-changed" not in names, names
