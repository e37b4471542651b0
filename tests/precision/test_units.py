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
