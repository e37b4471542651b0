"""Raw readings standardised inside the model, the model and its inputs cast to a narrow format: GPS
degrees near 48.86 (bf16's spacing there is 0.25, the data's spread 0.03), air pressure near
1013 hPa in fp16 (spacing 0.5, spread 2). The subtraction is the worst op, and holding the mean
buffer and its line in fp32 is not enough: the inputs were rounded before the forward. The fix
checked feeds the inputs in fp32 to that line (its result cast back), and applied as printed the
model's error is at rounding's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class Standardize(nn.Module):
    def __init__(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def _model(center: list[float], spread: list[float]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    c, s = torch.tensor(center), torch.tensor(spread)
    x = c + s * torch.randn(1024, len(center), generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(Standardize(c.clone(), s.clone()), nn.Linear(len(center), 64), nn.ReLU(), nn.Linear(64, 4))
    return model.eval(), x


def test_raw_readings_rounded_before_the_model_standardises_them_get_the_computation_before_the_cast() -> None:
    line = Standardize.forward.__code__.co_firstlineno + 1
    for (center, spread), candidate in (
        (([48.8566, 2.3522], [0.03, 0.04]), "bf16"),  # GPS degrees
        (([1013.25, 15.0, 60.0], [2.0, 5.0, 10.0]), "fp16"),  # pressure, temperature, humidity
    ):
        model, x = _model(center, spread)
        result = fpdoctor.compare(model, x, candidate=candidate)
        first = result.report.findings[0]
        assert first.name == "precision-divergence" and first.evidence.get("inputs_as_given"), str(result.report)
        assert first.fix.startswith("Do that computation before the cast: pass the model's inputs in fp32")
        assert f"line {line} of" in first.fix and "`0.mean` kept in fp32" in first.fix
        assert first.trial is not None and first.trial.tried and first.trial.after < first.trial.before / 10
        # as printed: the inputs and the mean in fp32 at that line, its result cast to the format
        dtype = torch.bfloat16 if candidate == "bf16" else torch.float16
        with torch.no_grad():
            exact = model.double()(x.double())
            narrow = model.to(dtype)
            norm = model[0]
            standardised = ((x - torch.tensor(center)) / norm.std).to(dtype)
            fixed = narrow[1:](standardised).double()
        assert float((fixed - exact).norm() / exact.norm()) < first.trial.before / 10


def test_plan_keeps_no_module_for_inputs_rounded_before_the_model_and_passes_the_checked_fix_on() -> None:
    """plan said 'keep in fp32 nothing, verified yes' against a target relaxed to the inputs' floor:
    the floor is that finding's cause, which no module set fixes."""
    model, x = _model([48.8566, 2.3522], [0.03, 0.04])
    result = fpdoctor.plan(model, x, candidate="bf16")
    summary = dict(result.report.data["summary"])
    assert summary["keep in fp32"].startswith("no module set is the fix: the model's inputs are rounded"), summary
    assert "before the cast" in summary["verified"] and not summary["verified"].startswith("yes")
    first = result.report.findings[0]
    assert first.evidence.get("inputs_as_given") and first.trial is not None and first.trial.tried
    # the plan's code is no cast that reproduces the broken run, and applying it refuses to
    assert result.plan.to_code().startswith("# no set of modules kept in fp32 is the fix"), result.plan.to_code()
    with pytest.raises(ValueError, match="no set of modules kept in fp32 is the fix"):
        fpdoctor.apply_plan(model, result.plan)


class Altimeter(nn.Module):
    """Altitudes near a summit (8848.86 m +- 20; fp16's spacing there is 8) centred by a learned
    offset, an nn.Parameter, in the whole model's own forward: the model's cast rounds the offset
    as it does the inputs, and rounding the inputs alone explains the model's error."""

    def __init__(self) -> None:
        super().__init__()
        self.ref = nn.Parameter(torch.tensor([8848.86, 8848.86]))
        self.body = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.body((h - self.ref) / 20.0)


def test_a_learned_offset_in_the_whole_models_forward_is_kept_in_fp32_with_the_inputs_as_given() -> None:
    torch.manual_seed(0)
    model, h = Altimeter().eval(), 8848.86 + 20.0 * torch.randn(512, 2)
    result = fpdoctor.compare(model, h, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.evidence.get("inputs_as_given"), str(result.report)
    assert first.evidence.get("rounded_buffers") == ["ref"] and "the parameter `ref`" in first.message
    assert "nn.Parameter(value.float())" in first.fix and "neither trained nor saved" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < first.trial.before / 10
    # as printed: the inputs and `ref` in fp32 at that line, its result cast to the format
    with torch.no_grad():
        exact = model.double()(h.double())
        fixed = model.half().body(((h - torch.tensor(8848.86)) / 20.0).half()).double()
    assert float((fixed - exact).norm() / exact.norm()) < first.trial.before / 10


class MinMaxScaled(nn.Module):
    """Sensor counts near 25008 (+- 0.4; fp16's spacing there is 16) min-max scaled over the batch in
    the forward: rounded to fp16 every reading of a column is one value, its range 0, and 0/0 is NaN.
    Computing that line in fp32 cannot help (the inputs it reads are already rounded)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 32), nn.GELU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low, high = x.min(0).values, x.max(0).values
        return self.body((x - low) / (high - low))


def test_a_nan_made_from_inputs_rounded_before_the_model_gets_the_computation_before_the_cast() -> None:
    torch.manual_seed(0)
    model, x = MinMaxScaled().eval(), 25008.0 + 0.4 * torch.randn(256, 4)
    line = MinMaxScaled.forward.__code__.co_firstlineno + 2
    for candidate, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        result = fpdoctor.compare(model, x, candidate=candidate)
        first = result.report.findings[0]
        # before: "its values pass fp16's largest ... no line alone in fp32 is the fix", untried; and a
        # divergence fix "checked" from non-finite to non-finite
        assert first.fix.startswith("Do that computation before the cast: pass the model's inputs in fp32"), first
        assert f"{line} of" in first.fix, first.fix  # the line, and the one before it that it reads
        assert first.trial is not None and first.trial.tried and first.trial.before == "non-finite", first.trial
        assert all(
            f.trial is None or not f.trial.tried or f.trial.after != float("inf") for f in result.report.findings
        ), str(result.report)
        # as printed: the inputs in fp32 at that line, what it makes cast to the parameters' dtype
        with torch.no_grad():
            exact = model.double()(x.double())
            narrow = model.to(dtype)
            low, high = x.min(0).values, x.max(0).values
            fixed = narrow.body(((x - low) / (high - low)).to(dtype)).double()
        assert bool(fixed.isfinite().all())
        assert float((fixed - exact).norm() / exact.norm()) < 0.05
        plan = fpdoctor.plan(model.float(), x, candidate=candidate)
        summary = dict(plan.report.data["summary"])
        assert "do not fit" not in summary.get("next step", ""), summary  # the inputs (2.5e4) fit fp16
        assert "infx" not in summary.get("input rounding floor", ""), summary
        model.float()
