"""The model's own code around its submodules (compare/own_code.py): a deterministic DDIM sampler
whose schedule (a cumulative product of 1 - beta over 1000 steps) and state are computed in bf16
around a bf16 denoiser. Its cumprod alone is ~33x its floor, the sampler's output 11x what came in:
no divergence, no line's fix enough alone, and compare said OK. The model's own ops in fp32 (its
denoiser in bf16) are now checked, named with the forward's lines, and the fix applied as printed
(the schedule's buffer a plain fp32 attribute, the state in fp32, the denoiser called on a bf16 copy
of it) brings the error down and compare's re-check (--inputs-as-given) says OK."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import own_code


class _Eps(nn.Module):
    """An epsilon-prediction MLP with a sinusoidal timestep embedding."""

    def __init__(self, dim: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.inp, self.emb = nn.Linear(dim, hidden), nn.Linear(64, hidden)
        self.body = nn.Sequential(nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        f = torch.exp(-math.log(1e4) * torch.arange(32, device=x.device) / 32)
        a = t.float()[:, None] * f[None]
        return self.body(self.inp(x) + self.emb(torch.cat([a.sin(), a.cos()], -1).to(x.dtype)))


class Sampler(nn.Module):
    """Deterministic DDIM over a linear beta schedule; `fixed`: the fix as compare prints it. Layouts
    the check must see through: `listed`, the denoiser inside an nn.ModuleList (never called itself);
    `learned`, the schedule an nn.Parameter of the sampler; `squash`, a weightless child (nn.Tanh) on
    the state, which is own code."""

    def __init__(
        self, fixed: bool = False, steps: int = 1000, sample: int = 25, *, listed: bool = False,
        learned: bool = False, squash: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.fixed, self.listed = fixed, listed
        if listed:
            self.nets = nn.ModuleList([_Eps()])
        else:
            self.eps = _Eps()
        self.squash = nn.Tanh() if squash else None
        betas = torch.linspace(1e-4, 0.02, steps)
        if learned:
            self.betas = nn.Parameter(betas)
        elif fixed:
            self.betas = betas.float()  # a plain fp32 tensor attribute: the model's cast leaves it
        else:
            self.register_buffer("betas", betas)
        self.register_buffer("ts", torch.arange(steps - 1, -1, -(steps // sample)))

    @property
    def net(self) -> nn.Module:
        return self.nets[0] if self.listed else self.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = next(self.net.parameters())
        if self.fixed:
            x = x.float()
        ab = torch.cumprod(1 - self.betas.to(x.device), 0)
        for i, t in enumerate(self.ts):
            a = ab[t]
            b = ab[self.ts[i + 1]] if i + 1 < len(self.ts) else torch.ones_like(a)
            tt = t.expand(x.shape[0])
            e = self.net(x.to(p.dtype), tt).float() if self.fixed else self.net(x, tt)
            x0 = (x - (1 - a).sqrt() * e) / a.sqrt()
            x = b.sqrt() * x0 + (1 - b).sqrt() * e
        return 4 * self.squash(x / 4) if self.squash is not None else x


def _sampler(fixed: bool = False, **layout: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Sampler(fixed, **layout).eval()
    with torch.no_grad():  # a prediction of unit size, as a trained one makes
        for layer in (model.net.inp, *model.net.body[1::2]):
            layer.weight.mul_(0.5)
    return model, torch.randn(64, 32, generator=torch.Generator().manual_seed(1))


def _error(model: nn.Module, x: torch.Tensor, *, given: bool) -> float:
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        out = copy.deepcopy(model).to(torch.bfloat16)(x if given else x.to(torch.bfloat16))
    return float((out.double() - exact).norm() / exact.norm())


def test_a_samplers_own_code_in_bf16_is_named_with_a_fix_that_works_as_printed() -> None:
    model, x = _sampler()
    report = fpdoctor.compare(model, x, candidate="bf16").report
    first = report.findings[0]
    assert first.evidence.get("kind") == "own-code", str(report)
    assert first.evidence["own_op"] == "aten.cumprod.default" and first.evidence["isolated_ratio"] > 16
    first_line = inspect.getsourcelines(Sampler.forward)[1]
    assert f"lines {first_line}-" in first.fix and "(Sampler.forward)" in first.fix
    assert "`betas`" in first.fix and "a plain fp32 tensor attribute" in first.fix and "`eps`" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 4 <= first.trial.before
    assert first.severity == "error"  # fp32 own code cures it: the cause, as a line's cure confirms one
    # why the 33x row is no divergence, in the text too (the table's note is cut at 20 characters)
    assert "16x a divergence takes" in dict(report.data["summary"])["why `<root>` is no divergence"]

    fixed, _ = _sampler(fixed=True)
    fixed.load_state_dict(model.state_dict(), strict=False)  # `betas` is no longer in the state dict
    before, after = _error(model, x, given=False), _error(fixed, x, given=True)
    assert after * 4 <= before and after <= 2 * first.trial.after, (before, after)
    again = fpdoctor.compare(fixed, x, candidate="bf16", inputs_as_given=True).report
    assert not [f for f in again.findings if f.severity in ("error", "warning")], str(again)


def test_the_same_sampler_in_fp16_keeps_its_own_code_within_its_floor() -> None:
    """fp16's finer spacing holds the schedule's factors near 1: its worst own op is within 16x its
    floor, so no check runs, and no own-code finding."""
    model, x = _sampler()
    result = fpdoctor.compare(model, x, candidate="fp16")
    assert not [f for f in result.report.findings if f.evidence.get("kind") == "own-code"], str(result.report)
    root = result.rows[-1]
    assert root.module == "" and root.ratio is not None and root.ratio < 16


@pytest.mark.parametrize("layout", ["listed", "learned", "squash"])
def test_the_check_sees_through_the_layouts_users_write(layout: str) -> None:
    """A denoiser inside a ModuleList (the check hooked the list, never called: it failed), the schedule
    a learned parameter of the sampler (the fix named buffers only: as printed, 50x the checked figure),
    a weightless child on the state (it ran as the candidate: the check did not cure)."""
    model, x = _sampler(**{layout: True})
    report = fpdoctor.compare(model, x, candidate="bf16").report
    first = report.findings[0]
    assert first.evidence.get("kind") == "own-code", str(report)
    assert first.trial is not None and first.trial.tried
    # the squashed state keeps less of the sampler's error (0.0028 -> 0.0010): a warning, the denoiser's the rest
    falls = 2 if layout == "squash" else 4
    assert first.trial.after * falls <= first.trial.before
    assert first.severity == ("warning" if layout == "squash" else "error")
    assert first.evidence["submodules"] == (["nets.0"] if layout == "listed" else ["eps"])
    if layout == "learned":  # kept as it trains: an fp32 parameter assigned again after the cast
        assert first.evidence["kept_in_fp32"] == ["betas"] and "nn.Parameter(value.float())" in first.fix


def test_plan_keeps_compares_own_code_fix() -> None:
    """plan turned the error into "apply the plan", a plan that keeps nothing (0.0154 -> 0.0154)."""
    model, x = _sampler()
    report = fpdoctor.plan(model, x, candidate="bf16").report
    found = [f for f in report.findings if f.evidence.get("kind") == "own-code"]
    assert len(found) == 1 and found[0].trial is not None and found[0].trial.tried, str(report)
    assert "apply_plan" not in found[0].fix and found[0].trial.after * 4 <= found[0].trial.before


def test_a_smaller_fall_is_a_warning_and_none_is_a_note() -> None:
    model, _ = _sampler()
    args = {"fmt": "bf16", "dtype": "torch.bfloat16", "floor": 0.0016, "op": "aten.cumprod.default",
            "location": None, "ratio": 33.0, "came": 0.0016, "on": "x"}  # fmt: skip
    assert own_code.finding(model, ["eps"], before=0.0184, after=0.0070, **args).severity == "warning"
    assert own_code.finding(model, ["eps"], before=0.0184, after=0.0040, **args).severity == "error"
    assert "under the 2x fall a cause takes" in own_code.reason(0.0184, 0.0120, [])
