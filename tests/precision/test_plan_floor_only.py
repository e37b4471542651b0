"""A model that reads raw values far from zero and centres them itself (pressures near 1013 hPa and
temperatures near 288 K less stored references, a few units apart): in bf16 the inputs' rounding is
the whole error, and no set of modules kept in fp32 changes it. plan kept nothing, verified against
twice that floor, and printed "apply the plan" as the fix, checked 0.44 -> 0.44, exit 0 (trial136):
a fix that changes nothing. It now says no module set is the fix, the run is an error, its code says
so, and apply_plan refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _readings(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    pa = 1013 + 5 * torch.randn(n, generator=g)
    pb = pa + 2.0 * torch.randn(n, generator=g)
    ta = 288 + 10 * torch.randn(n, generator=g)
    tb = ta + 1.5 * torch.randn(n, generator=g)
    pa3 = pa + 1.5 * torch.randn(n, generator=g)
    wind = (
        2.0
        + 1.6 * (pa - pb).abs()
        + 0.8 * (pa3 - pa).abs()
        + 0.15 * (ta - tb).abs()
        + 0.3 * torch.randn(n, generator=g)
    )
    return torch.stack([pa, pb, ta, tb, pa3], 1), wind


class Nowcast(nn.Module):
    """Next-hour wind from two stations' raw readings (hPa, K), centred on stored references inside."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("p_ref", torch.tensor(1013.25))
        self.register_buffer("t_ref", torch.tensor(288.15))
        self.mlp = nn.Sequential(nn.Linear(6, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pa, pb, ta, tb, pa3 = x.unbind(-1)
        feats = torch.stack([
            pa - self.p_ref,
            pa - pb,
            pa3 - pa,
            ta - tb,
            (ta - self.t_ref) / 10.0,
            (pb - self.p_ref),
        ], -1)  # fmt: skip
        return self.mlp(feats).squeeze(-1)


@pytest.fixture(scope="module")
def trained() -> Nowcast:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = Nowcast()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        x, y = _readings(256, g)
        loss = (model(x) - y).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_a_floor_from_the_inputs_past_the_tolerance_is_no_plan_and_an_error(trained: Nowcast) -> None:
    x, _ = _readings(512, torch.Generator().manual_seed(42))
    result = fpdoctor.plan(trained, x, candidate="bf16", metric="rel")
    report, the_plan = result.report, result.plan
    assert report.verdict == "error", str(report)
    rows = dict(report.data["summary"])
    assert rows["keep in fp32"].startswith("no module set is the fix"), rows
    assert not any(f.fix.startswith("apply the plan") for f in report.findings), [f.fix for f in report.findings]
    assert the_plan.to_code().startswith("# no set of modules kept in fp32 is the fix")
    with pytest.raises(ValueError, match="no set of modules kept in fp32 is the fix"):
        fpdoctor.apply_plan(Nowcast().eval(), the_plan)
