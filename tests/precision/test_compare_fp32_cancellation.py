"""An fp32 output made by subtracting two large totals: no fp32 op computes worse than fp32 allows
(rounding what the subtraction reads is the whole error: its conditioning), so no op diverged and the
verdict was OK on an output far off fp64. The first finding names the subtraction, and the lines that
make what it reads computed in fp64 with it are the checked fix; applied as printed, the output is
right. A portfolio's change in value over a small price move, as two sums over its positions; a
variance as E[x^2] - E[x]^2 of readings far from zero. A total whose difference is not taken, and
the same model in fp64 lines, get no such finding."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fpdoctor


class PnL(nn.Module):
    """The portfolio's value after the move minus before; `wide`: the fix as printed."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.wide = wide

    def value(self, prices: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        if self.wide:
            prices, units = prices.double(), units.double()
        held = prices * units
        return held.sum()

    def forward(self, before: torch.Tensor, after: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        change = self.value(after, units) - self.value(before, units)
        return change.to(before.dtype) if self.wide else change


def _book() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    before = 50.0 + 10.0 * torch.rand(200_000, generator=g)
    units = torch.randint(1, 1000, (200_000,), generator=g).float()
    after = before.clone()
    after[:20] += 0.01  # twenty prices tick up
    return before, after, units


def _error(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> float:
    exact = PnL()(*(t.double() for t in inputs))
    return float((model(*inputs).double() - exact).abs() / exact.abs())


def test_the_difference_of_two_totals_is_named_and_its_lines_in_fp64_work_as_printed():
    inputs = _book()
    result = fpdoctor.compare(PnL(), inputs, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    source, start = inspect.getsourcelines(PnL)
    at = {text: start + next(i for i, line in enumerate(source) if text in line)
          for text in ("held = prices * units", "return held.sum()", "change = self.value")}  # fmt: skip
    assert first.name == "precision-divergence" and first.evidence["kind"] == "cancellation", first
    assert first.evidence["location"] == f"{__file__}:{at['change = self.value']}", first.evidence
    lines = f"lines {at['held = prices * units']}-{at['return held.sum()']} and {at['change = self.value']}"
    assert f"compute {lines} of {__file__} in fp64" in first.fix, first.fix
    # the other way, only where few terms differ: two models' log-likelihoods differ a little at every term
    assert "where few terms differ between the two totals" in first.fix, first.fix
    # cast back to the model's dtype: a hard .float() would turn compare's own fp64 run of the fixed code to fp32
    assert "`.to(x.dtype)`" in first.fix and "(.float())" not in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    before, after = _error(PnL(), inputs), _error(PnL(wide=True), inputs)
    assert before > 1e-3 and after * 100 < before, (before, after)


class Variance(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=0)
        return (x * x).mean(dim=0) - mean * mean


def test_a_variance_as_the_mean_square_less_the_squared_mean_is_a_cancellation():
    g = torch.Generator().manual_seed(0)
    x = 3000.0 + torch.randn(4096, 64, generator=g)  # readings far from zero, spread 1
    first = fpdoctor.compare(Variance(), x, candidate="fp32", reference="fp64").report.findings[0]
    assert first.severity == "error" and first.trial is not None and first.trial.tried, first
    assert first.trial.after * 100 < first.trial.before, first.trial


class Total(nn.Module):
    def forward(self, prices: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
        return (prices * units).sum()


def test_a_total_whose_difference_is_not_taken_gets_no_such_finding():
    before, _, units = _book()
    result = fpdoctor.compare(Total(), (before, units), candidate="fp32", reference="fp64")
    assert not [f for f in result.report.findings if f.evidence.get("kind") == "cancellation"], result.report


class Fit(nn.Module):
    """A regression's MSE loss near a good fit: predictions close to their targets, subtracted."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.net(x).squeeze(-1) - y) ** 2).mean()


def test_a_loss_near_a_good_fit_is_no_cancellation_whatever_its_own_rounding():
    """Its subtraction loses a few digits (residuals 1e-4 of values near 1), not most of fp32's: judged
    against fp32's unit roundoff, not the 0-d loss's own rounding, which can be near 0 by chance."""
    for seed in (0, 1, 3):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        x = torch.randn(256, 32, generator=g)
        model = Fit().eval()
        with torch.no_grad():
            y = model.net(x).squeeze(-1) + 1e-4 * torch.randn(256, generator=g)
        result = fpdoctor.compare(model, (x, y), candidate="fp32", reference="fp64")
        assert result.report.verdict == "ok", (seed, [f.title for f in result.report.findings])


class ScaledPnL(nn.Module):
    """The portfolio's change with its totals made by a Linear whose weight is the units held: the check
    runs the Linear in fp64 with the line that calls it, and the fix must say so."""

    def __init__(self, units: torch.Tensor, wide: bool = False) -> None:
        super().__init__()
        self.value = nn.Linear(units.numel(), 1, bias=False)
        with torch.no_grad():
            self.value.weight.copy_(units[None])
        if wide:  # as printed: the module in fp64, the line's operands .double(), the result cast back
            self.value.double()
        self.wide = wide

    def forward(self, before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
        if self.wide:
            return (self.value(after.double()) - self.value(before.double())).float()
        return self.value(after) - self.value(before)


def test_a_module_a_fixed_line_calls_is_named_in_the_fix_and_the_fix_works_as_printed():
    before, after, units = _book()
    before, after = before[None], after[None]
    first = fpdoctor.compare(ScaledPnL(units), (before, after), candidate="fp32", reference="fp64").report.findings[0]
    assert first.evidence["kind"] == "cancellation", first.title
    assert "with `value` they call in fp64 too" in first.fix, first.fix
    exact = after.double() @ units.double() - before.double() @ units.double()
    got = ScaledPnL(units, wide=True)(before, after).double()
    assert float((got - exact).abs() / exact.abs()) < 1e-3, (float(got), float(exact))
