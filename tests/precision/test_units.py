"""An output that is not logits reads in its own units: mean and largest absolute error beside
rounding's floor and the output's magnitude (precision/units.py)."""

from __future__ import annotations

import pytest
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
        assert found.fix.startswith("Keep `head` in fp32, with its fp32 weights and an fp32 input, returning an fp32")
        kept = found.evidence["kept_in_fp32"]
        assert kept["mean"] < found.evidence["output_error"]["mean"] / 4
        # as printed, in a model cast to bf16: the head's weights saved before the cast and put back in fp32,
        # its input cast in by the printed hook
        torch.manual_seed(0)
        model = _Regressor(offset, spread).eval()
        x = torch.randn(1024, 8, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            exact = model.double()(x.double())
            model.float()
            before, after = found.fix.split("before the model's cast, ")[1].split(" (under")[0].split("; after it, ")
            scope = {"model": model}
            exec(before, scope)  # saved = {...}
            model.to(torch.bfloat16)
            exec(after, scope)  # .float().load_state_dict(saved); ...register_forward_pre_hook(...)
            fixed = model(x.to(torch.bfloat16))
        assert fixed.dtype == torch.float32
        assert float((fixed.double() - exact).abs().mean()) < found.evidence["output_error"]["mean"] / 4
    result = _coarse(1500.0, 30.0, "fp16")
    assert "output-too-coarse" not in [f.name for f in result.report.findings], str(result.report)
    assert result.report.data["output_error"]["spread"] > 20


class _RevIN(nn.Module):
    """A forecaster with its instance normalisation written by hand: each series' mean and std over
    time taken, a small net on the normalised values, and the output put back at the series' level."""

    def __init__(self, fixed: bool = False, lookback: int = 96, horizon: int = 24) -> None:
        super().__init__()
        self.fixed = fixed
        self.net = nn.Sequential(nn.Linear(lookback, 128), nn.GELU(), nn.Linear(128, horizon))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + 1e-5)
        z = (x - mean) / std
        # the printed fix: only the net in the candidate's dtype, the model's own ops in fp32
        y = self.net(z.to(self.net[0].weight.dtype)).float() if self.fixed else self.net(z)
        return y * std + mean


class _Stations(nn.Module):
    """Hourly temperatures per station: a net predicts the anomaly, added to each station's own
    climatology (a buffer, 230-310 K) at the output. Stations differ by tens of kelvin, a day by one."""

    def __init__(self, fixed: bool = False, stations: int = 32) -> None:
        super().__init__()
        self.fixed = fixed
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 24))
        self.register_buffer("climate", 230.0 + 80.0 * torch.rand(stations, 1))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        anomaly = self.net(features.to(self.net[0].weight.dtype)).float() if self.fixed else self.net(features)
        return self.climate.to(anomaly.dtype) + 0.5 * anomaly


def _series() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    t = torch.arange(96, dtype=torch.float32)
    level = 1e5 * (1 + torch.rand(16, 8, 1))  # prices of 1e5 to 2e5, each series at its own
    return _RevIN(), level + 50 * torch.sin(t / 6 + 6 * torch.rand(16, 8, 1)) + 10 * torch.randn(16, 8, 96)


def _stations() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(1)
    return _Stations(), torch.randn(32, 8)


@pytest.mark.parametrize("make", [_series, _stations])
def test_rows_at_their_own_levels_are_judged_by_their_variation_within_and_the_own_ops_fix_is_checked(make):
    """Series at their own levels vary little within a row and much across rows: rounding to bf16 at
    their level costs more than they vary within, which the spread over the whole output (across
    levels) hid, and the verdict was OK. Now output-too-coarse, with the model's own ops in fp32 and
    its submodules in bf16 checked; that fix, applied as printed (the net alone in bf16), keeps the
    error far below rounding's."""
    model, x = make()
    result = fpdoctor.compare(model, x, candidate="bf16")
    [found] = result.report.by_name("output-too-coarse")
    units = found.evidence["output_error"]
    assert units["row_spread"] < units["spread"] / 4 and units["floor_mean"] >= 0.05 * units["row_spread"]
    assert found.trial is not None and found.trial.tried and "own ops in fp32" in found.fix, found.fix
    assert float(found.trial.after) * 4 <= float(found.trial.before)
    fixed = type(model)(fixed=True)
    fixed.load_state_dict(model.state_dict())
    fixed.net.to(torch.bfloat16)
    with torch.no_grad():
        exact, got = model.double()(x.double()), fixed(x)
    assert (got.double() - exact).abs().mean() * 4 <= units["floor_mean"]
