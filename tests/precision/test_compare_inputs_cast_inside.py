"""A model that casts its raw inputs itself (a centring in fp32, then the cast to its own dtype): run
by compare with its inputs rounded to the candidate first, as a cast model's caller would, the output
is lost; rounding the inputs explains it, and the candidate fed them as given does not lose it. The
finding says so with that run checked, not "find the large value" of the use check."""

from __future__ import annotations

import re

import torch
from torch import nn

import fpdoctor


class _Gauge(nn.Module):
    """Readings near 1013 hPa and 288 K, centred on reference values before the MLP (as the user
    fixed it): the subtraction in fp32, then the features cast to the MLP's dtype."""

    def __init__(self, cast_inside: bool) -> None:
        super().__init__()
        self.cast_inside = cast_inside
        self.register_buffer("ref", torch.tensor([1013.25, 1013.25, 288.15]))
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast_inside:
            x = x.float()
            feats = torch.stack([x[:, 0] - x[:, 1], x[:, 0] - self.ref[0], (x[:, 2] - self.ref[2]) / 10], -1)
            return self.mlp(feats.to(self.mlp[0].weight.dtype)).squeeze(-1)
        feats = torch.stack([x[:, 0] - x[:, 1], x[:, 0] - self.ref[0], (x[:, 2] - self.ref[2]) / 10], -1)
        return self.mlp(feats).squeeze(-1)


def _readings() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    pa = 1013 + 5 * torch.randn(512, generator=g)
    return torch.stack([pa, pa + 2 * torch.randn(512, generator=g), 288 + 10 * torch.randn(512, generator=g)], 1)


def _model(cast_inside: bool) -> nn.Module:
    torch.manual_seed(0)
    return _Gauge(cast_inside).eval()


def test_a_model_that_casts_its_inputs_is_told_to_get_them_unrounded_checked() -> None:
    x = _readings()
    result = fpdoctor.compare(_model(True), x, candidate="bf16")
    first = result.report.findings[0]
    assert first.severity == "error" and first.evidence["kind"] == "input-rounding", str(result.report)
    assert first.trial is not None and first.trial.tried, first.trial
    assert first.trial.after * 10 <= first.trial.before
    assert first.fix.startswith("Pass the inputs to the bf16 model unrounded")
    assert (
        "keep `ref` out of the cast: hold it as a plain fp32 tensor attribute" in first.fix
    )  # 1013.25 is 1016 in bf16
    # as printed: the reference values kept across the cast, the bf16 model fed the fp32 readings as they come
    model = _model(True)
    with torch.no_grad():
        exact = model.double()(x.double())
        model.float()
        scope = {"model": model, "torch": torch}
        save, cast, put_back = re.findall(r"`([^`]*)`", first.fix.split("saved before it (")[1])[:3]
        for line in (save, cast, put_back):
            exec(line, scope)
        assert model.ref.dtype == torch.float32 and model.mlp[0].weight.dtype == torch.bfloat16
        got = model(x)
    rel = float((got.double() - exact).norm() / exact.norm())
    assert rel * 10 <= first.trial.before and rel < 0.05


def test_a_model_that_cannot_take_its_inputs_unrounded_gets_the_inputs_finding_untried() -> None:
    """Its MLP reads what the inputs become without a cast: fed fp32 inputs a bf16 copy cannot run."""
    result = fpdoctor.compare(_model(False), _readings(), candidate="bf16")
    first = result.report.findings[0]
    assert first.severity == "error" and first.evidence["kind"] == "input-rounding", str(result.report)
    assert not first.fix.startswith("Pass the inputs to the bf16 model unrounded")


class _Counting(_Gauge):
    """The gauge that also counts the rows it has seen in a float buffer, updated in place."""

    def __init__(self) -> None:
        super().__init__(True)
        self.register_buffer("seen", torch.tensor(1000.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(x.shape[0])
        return super().forward(x)


def test_the_fed_as_given_run_leaves_the_users_buffers_as_they_were() -> None:
    torch.manual_seed(0)
    model = _Counting().eval()
    before = {n: b.clone() for n, b in model.named_buffers()}
    fpdoctor.compare(model, _readings(), candidate="bf16")
    assert all(torch.equal(before[n], b) for n, b in model.named_buffers())
