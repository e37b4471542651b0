"""An output that is not logits reads in its own units: mean and largest absolute error beside
rounding's floor and the output's magnitude (precision/units.py)."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.units import in_units


def test_an_offset_output_reads_its_error_in_its_units() -> None:
    torch.manual_seed(0)
    exact = 300.0 + torch.randn(4096, dtype=torch.float64)  # a temperature near 300 K
    candidate = exact.to(torch.bfloat16)  # bf16 spacing at 256-512 is 2: errors up to 1 K
    found = in_units(exact, candidate, "bf16")
    assert found is not None and found.values == 4096
    assert 0.3 < found.mean < 0.7 and 0.9 < found.largest <= 1.0
    assert found.floor_mean == found.mean and found.floor_largest == found.largest  # rounding is all it does
    assert abs(found.magnitude - 300.0) < 1.0
    text = found.text("bf16")
    assert "mean |error| 0." in text and "rounding the exact output to bf16" in text and "300" in text


def test_a_candidate_worse_than_rounding_and_a_non_finite_one() -> None:
    exact = torch.linspace(-1.0, 1.0, 1000, dtype=torch.float64)
    found = in_units(exact, (exact + 0.01).float(), "fp32")
    assert found is not None and abs(found.mean - 0.01) < 1e-6 and found.floor_largest < 1e-7
    bad = exact.clone()
    bad[3] = float("nan")
    assert in_units(exact, bad, "fp32") is None
    assert in_units(exact, exact[:10], "fp32") is None


def test_compare_says_a_regression_outputs_error_in_its_units_and_not_a_classifiers() -> None:
    torch.manual_seed(0)
    regression = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))
    with torch.no_grad():
        regression[-1].bias += 300.0  # predicts a temperature in kelvin
    result = fpdoctor.compare(regression, torch.randn(256, 8), candidate="bf16")
    error = result.report.data["output_error"]
    assert error["values"] == 256 and 0.05 < error["mean"] < 0.5 and abs(error["magnitude"] - 300) < 5
    labels = [label for label, _ in result.report.data["summary"]]
    at = labels.index("end-to-end error")
    assert labels[at + 1] == "output error, in its units"  # beside the error: shown by a clean report too
    line = dict(result.report.data["summary"])["output error, in its units"]
    assert "mean |error|" in line and "rounding the exact output to bf16" in line

    classifier = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 10))
    result = fpdoctor.compare(classifier, torch.randn(256, 8), candidate="bf16")
    assert "output_error" not in result.report.data and "decisions" in result.report.data
    labels = [label for label, _ in result.report.data["summary"]]
    assert labels[labels.index("end-to-end error") + 1].startswith("decisions (")


class _Regressor(nn.Module):
    """An MLP whose output sits at `offset` and varies by about `spread` (a temperature in kelvin, an
    altitude in metres): trained weights' shape, the offset in the last layer's bias."""

    def __init__(self, offset: float, spread: float) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            h = self.body(torch.randn(4096, 8, generator=torch.Generator().manual_seed(9)))
            self.head.weight.mul_(spread / float((h @ self.head.weight.T).std()))
            self.head.bias.fill_(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _coarse(offset: float, spread: float, candidate: str) -> fpdoctor.CompareResult:
    torch.manual_seed(0)
    model = _Regressor(offset, spread).eval()
    return fpdoctor.compare(model, torch.randn(1024, 8, generator=torch.Generator().manual_seed(1)),
                            candidate=candidate)  # fmt: skip


def test_an_output_the_format_rounds_coarsely_is_never_ok_and_keeping_its_layer_in_fp32_is_checked() -> None:
    """288 K +- 3 K in bf16 (spacing 2 there): the candidate's error equals rounding's floor, so every
    relative figure looks fine; the finding names the format, and the layer kept in fp32, returning
    fp32, is checked to take the error away. An altitude of 1500 m +- 30 m (spacing 8) is the same
    class; in fp16 (spacing 1) that altitude is held finely enough and nothing is said."""
    for offset, spread in ((288.15, 3.0), (1500.0, 30.0)):
        result = _coarse(offset, spread, "bf16")
        assert result.report.verdict != "ok", str(result.report)
        (found,) = [f for f in result.report.findings if f.name == "output-too-coarse"]
        assert found.severity == "warning" and found.where["module"] == "head"
        assert found.evidence["share_of_spread"] > 0.05
        assert found.trial is not None and found.trial.tried, found.trial
        assert found.fix.startswith("Keep `head` in fp32, returning an fp32 output")
        kept = found.evidence["kept_in_fp32"]
        assert kept["mean"] < found.evidence["output_error"]["mean"] / 4
        # as printed: the head in fp32 on the bf16 body's output
        torch.manual_seed(0)
        model = _Regressor(offset, spread).eval()
        x = torch.randn(1024, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            exact = model.double()(x.double())
            model.float()
            body = model.body.to(torch.bfloat16)(x.to(torch.bfloat16))
            fixed = model.head(body.float())
        assert float((fixed.double() - exact).abs().mean()) < found.evidence["output_error"]["mean"] / 4
    result = _coarse(1500.0, 30.0, "fp16")
    assert "output-too-coarse" not in [f.name for f in result.report.findings], str(result.report)
    assert result.report.data["output_error"]["spread"] > 20
