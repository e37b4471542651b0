"""A fix checked end to end alone passed where a residual around the model diluted a module it left
dead (trial80: a GroupNorm by hand on raw 10-bit images in fp16; "line 27 in fp32, cast back after
it" took the end-to-end error from non-finite to 0.00125, while two norms whose variance passed
65504 cast back output their bias alone). The check now also requires every module's output within
half its norm of fp64's, so the fix found is the variance's line with the normalisation that reads
it; applied as printed, no module is dead. Two models: the trial's class (a dead norm diluted 100x by
the denoiser's residual: the old check printed an untried fix), and a layer norm by hand over large
activations behind a residual (its first lines held before as well: the check must not lose it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class GroupNormByHand(nn.Module):
    def __init__(self, channels: int, groups: int = 4, fixed: bool = False) -> None:
        super().__init__()
        self.groups, self.fixed = groups, fixed
        self.weight, self.bias = nn.Parameter(torch.ones(channels)), nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        g = x.reshape(b, self.groups, -1)
        mean = g.mean(-1, keepdim=True)
        if self.fixed:  # as printed: the variance's line and the next in fp32, cast back after them
            gf, mf = g.float(), mean.float()
            var = (gf * gf).mean(-1, keepdim=True) - mf * mf
            g = ((gf - mf) / torch.sqrt(var + 1e-5)).to(x.dtype)
        else:
            var = (g * g).mean(-1, keepdim=True) - mean * mean
            g = (g - mean) / torch.sqrt(var + 1e-5)
        return g.reshape(b, c, h, w) * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class Denoiser(nn.Module):
    """Conv blocks with hand-written group norms, and the global residual a denoiser predicts around."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.inp = nn.Conv2d(1, 16, 3, padding=1)
        self.norm1, self.mid = GroupNormByHand(16, fixed=fixed), nn.Conv2d(16, 16, 3, padding=1)
        self.norm2, self.out = GroupNormByHand(16, fixed=fixed), nn.Conv2d(16, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(torch.relu(self.norm1(self.inp(x))))
        return x + self.out(torch.relu(self.norm2(h))) * 0.01


class LayerNormByHand(nn.Module):
    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        if self.fixed:
            xf, mf = x.float(), mean.float()
            var = (xf * xf).mean(-1, keepdim=True) - mf * mf
            return ((xf - mf) / torch.sqrt(var + 1e-5)).to(x.dtype)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) / torch.sqrt(var + 1e-5)


class Residual(nn.Module):
    """Large activations (a trained model's outlier features) normalised by hand, behind a residual."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 64), LayerNormByHand(fixed), nn.Linear(64, 16)
        with torch.no_grad():
            self.up.weight.mul_(300.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * self.down(self.norm(self.up(x)))


@pytest.mark.parametrize(
    ("make", "inputs"),
    [
        (Denoiser, lambda g: torch.rand(2, 1, 32, 32, generator=g) * 1023),  # raw 10-bit images
        (Residual, lambda g: torch.randn(32, 16, generator=g)),
    ],
    ids=["groupnorm-by-hand", "layernorm-by-hand"],
)
def test_a_fix_that_leaves_a_module_dead_is_not_the_checked_fix(make, inputs) -> None:
    torch.manual_seed(0)
    model, x = make().eval(), inputs(torch.Generator().manual_seed(1))
    result = fpdoctor.compare(model, x, candidate="fp16")
    first = result.report.findings[0]
    assert first.trial is not None and first.trial.tried, (first.name, first.fix)
    fixed = make(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    outs: dict[str, torch.Tensor] = {}
    for name, module in fixed.named_modules():
        if isinstance(module, (GroupNormByHand, LayerNormByHand)):
            module.register_forward_hook(lambda m, a, o, name=name: outs.__setitem__(name, o.float()))
    with torch.no_grad():
        fixed.half()(x.half())
    assert outs and all(float(o.std()) > 0.5 for o in outs.values()), {k: float(o.std()) for k, o in outs.items()}
    check = fpdoctor.compare(fixed.float(), x, candidate="fp16")
    assert check.report.verdict == "ok", str(check.report)
