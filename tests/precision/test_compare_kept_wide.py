"""Values the format rounds again where they are cast back: a histogram's counts (bf16 holds whole
numbers exactly up to 256) and the CDF made from them, in a calibration step that picks score
thresholds at quantiles. Computing them in fp32 and casting the result back, as a fix usually says,
rounds them again; the check keeps them in fp32 for what reads them (with the rounded quantiles held),
and the fix applied as printed picks the thresholds fp64 picks."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Thresholds(nn.Module):
    """The score at each target quantile of a histogram's CDF. `fixed`: the fix as printed (the counts
    and the CDF in fp32 and kept so, the quantiles a plain fp32 attribute, the scores fed in fp32)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        quantiles = torch.tensor([0.5, 0.9, 0.99, 0.999])
        if fixed:
            self.quantiles = quantiles
        else:
            self.register_buffer("quantiles", quantiles)
        self.fixed = fixed

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        hist = torch.histc(scores.float() if self.fixed else scores, bins=512, min=0.0, max=1.0)
        cdf = hist.cumsum(0) / hist.sum()
        idx = torch.searchsorted(cdf, self.quantiles.to(cdf.dtype))
        edges = torch.linspace(0.0, 1.0, 513, dtype=scores.dtype)
        return edges[(idx + 1).clamp(max=512)]


def _scores() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    logits = torch.where(torch.rand(100_000, generator=g) < 0.05, 2.0 + torch.randn(100_000, generator=g),
                         -3.0 + torch.randn(100_000, generator=g))  # fmt: skip
    return torch.sigmoid(logits)


def test_counts_and_a_cdf_kept_in_fp32_are_the_checked_fix_and_work_as_printed():
    result = fpdoctor.compare(Thresholds().eval(), _scores(), candidate="bf16")
    finding = next(f for f in result.report.findings if f.name == "precision-divergence")
    assert finding.trial is not None and finding.trial.tried, finding.fix
    assert finding.evidence["kept_wide"] is True and finding.evidence["rounded_buffers"] == ["quantiles"]
    assert "keep what they make in fp32 for what reads it" in finding.fix
    assert "is not the cause" not in finding.message  # the whole model's own ops: no amplifier named
    after = float(finding.trial.after)
    assert after * 4 <= float(finding.trial.before)
    again = fpdoctor.compare(Thresholds(fixed=True).eval(), _scores(), candidate="bf16", inputs_as_given=True)
    assert not any(f.name == "precision-divergence" for f in again.report.findings)
    assert again.rows[-1].propagated <= max(2 * after, 1e-6)


class CastBack(nn.Module):
    """The counts made in fp32 and cast back to the model's dtype (a fix as usually written): its CDF
    still rounds, and the searchsorted that reads it picks other bins."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("quantiles", torch.tensor([0.5, 0.9, 0.95, 0.99, 0.999]))

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        hist = torch.histc(scores.float(), bins=2048, min=0.0, max=1.0).to(scores.dtype)
        cdf = hist.cumsum(0) / hist.sum()
        idx = torch.searchsorted(cdf, self.quantiles.to(cdf.dtype))
        edges = torch.linspace(0.0, 1.0, 2049, dtype=scores.dtype)
        return edges[(idx + 1).clamp(max=2048)]


def test_a_selection_whose_fix_no_run_found_goes_after_the_divergence_whose_fix_was_checked():
    g = torch.Generator().manual_seed(0)
    n = 500_000
    logits = torch.where(torch.rand(n, generator=g) < 0.03, 2.0 + 1.5 * torch.randn(n, generator=g),
                         -3.0 + 1.2 * torch.randn(n, generator=g))  # fmt: skip
    findings = fpdoctor.compare(CastBack().eval(), torch.sigmoid(logits), candidate="bf16").report.findings
    assert [f.name for f in findings] == ["precision-divergence", "selection-changed"]
    assert findings[0].trial is not None and findings[0].trial.tried
    assert findings[1].trial is not None and not findings[1].trial.tried
