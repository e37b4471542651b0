"""A sampler whose noise schedule is built in the model's dtype: in fp16, 1 - abar[t] is 0 at the
first steps, the score divides by its square root and the samples turn NaN. The fix is the schedule
in fp32, its entries read as they are: `betas[t]` is a 0-dim tensor, and an op that reads it beside
fp16 tensors stays fp16 with the fp32 value's digits. Cast back to fp16 where each step reads them,
the entries lose those digits again (1 - betas[t] near 1, in fp16's spacing of 4.9e-4 there) and
the samples keep almost twice the error. compare checks both and prints the one that leaves less,
naming the line that picks the dtype; applied as printed, the fixed sampler's error is the one the
check gave."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor


class Langevin(nn.Module):
    """Annealed Langevin-style steps of 2-D points under a small score net."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 2))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float32 if self.fixed else x.dtype)
        abar = torch.exp(torch.cumsum(torch.log1p(-betas), 0))
        for t in range(39, -1, -1):
            eps = self.net(torch.cat([x, torch.full_like(x[:, :1], t / 1000)], 1))
            score = -eps / torch.sqrt(1 - abar[t])
            x = (x + betas[t] * score) / torch.sqrt(1 - betas[t])
        return x


@pytest.fixture(scope="module")
def points() -> torch.Tensor:
    return torch.randn(128, 2, generator=torch.Generator().manual_seed(1))


def test_a_schedule_built_in_fp16_gets_the_dtype_line_and_its_entries_read_as_they_are(points):
    result = fpdoctor.compare(Langevin(), points, candidate="fp16")
    first = result.report.findings[0]
    assert first.code == "NUM001", [(f.code, f.title) for f in result.report.findings]
    lines, start = inspect.getsourcelines(Langevin.forward)
    picked = start + next(k for k, line in enumerate(lines) if "torch.linspace" in line)
    assert f"torch.float32 where line {picked} picks the dtype" in first.fix, first.fix
    assert "with no cast" in first.fix and first.trial is not None and first.trial.tried, first.fix
    checked = first.trial.after
    # applied as printed (the dtype picked at that line, nothing else changed): the error the check gave
    fixed = fpdoctor.compare(Langevin(fixed=True), points, candidate="fp16")
    assert not [f for f in fixed.report.findings if f.code == "NUM001"], fixed.report.findings
    assert fixed.rows[-1].propagated == pytest.approx(checked, rel=0.02), (fixed.rows[-1].propagated, checked)


def test_only_a_line_that_makes_a_tensor_with_its_dtype_is_said_to_pick_it(tmp_path):
    from fpdoctor.precision.compare.nonfinite import _dtype_chosen

    source = tmp_path / "lines.py"
    source.write_text(
        "betas = torch.linspace(1e-4, 0.02, 1000, dtype=dtype)\n"
        "score = (eps / torch.sqrt(1 - abar[t])).to(dtype=x.dtype)\n"
        "same = x.dtype == torch.float16\n"
        "eye = torch.eye(len(s), dtype=x.dtype)\n"
    )
    assert _dtype_chosen([(str(source), n) for n in range(1, 5)]) == [1, 4]
