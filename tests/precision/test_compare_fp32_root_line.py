"""An fp32 candidate whose error the model's own ops make (no submodule): the worst op's line in fp64
is tried end to end before it is printed, walking up to the lines that make what it reads; where no
span of lines cures it, the error is carried from step to step and that fix is never printed.

A bend computed as ((x + 3000)^2 - 9e6) / 6000: the square cancels, but `y = x + 3000` rounds x first,
so the squaring line alone in fp64 does nothing and the two lines together cure it. A Kalman filter
with the textbook covariance update `P = (I - K H) P`, tiny measurement noise and no process noise:
fp32 loses P's positive-definiteness over the steps; the gain's bmm shows the error, but no fp64 line
of one step cures it (the Joseph form does: a stable form is the user's to write)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare.compare import _lines_above
from fpdoctor.precision.compare.passes import carried_and_raised
from fpdoctor.preserve import RngState


class Bend(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 3000.0
        return (y * y - 9e6) / 6000.0 - x


class Kalman(nn.Module):
    """Constant-velocity tracking of 2-D positions; `joseph`: the stable covariance update."""

    def __init__(self, joseph: bool = False) -> None:
        super().__init__()
        dt = 0.1
        f = torch.eye(4)
        f[0, 2] = f[1, 3] = dt
        h = torch.zeros(2, 4)
        h[0, 0] = h[1, 1] = 1.0
        self.register_buffer("F", f)
        self.register_buffer("H", h)
        self.register_buffer("R", 1e-4 * torch.eye(2))
        self.register_buffer("P0", 1e6 * torch.eye(4))
        self.register_buffer("I", torch.eye(4))
        self.joseph = joseph

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(z.shape[0], 4, dtype=z.dtype)
        x[:, :2] = z[:, 0]
        p = self.P0.expand(z.shape[0], 4, 4).clone()
        out = []
        for t in range(z.shape[1]):
            x = x @ self.F.T
            p = self.F @ p @ self.F.T
            s = self.H @ p @ self.H.T + self.R
            k = p @ self.H.T @ torch.linalg.inv(s)
            x = x + (k @ (z[:, t] - x @ self.H.T).unsqueeze(-1)).squeeze(-1)
            if self.joseph:
                a = self.I - k @ self.H
                p = a @ p @ a.transpose(-1, -2) + k @ self.R @ k.transpose(-1, -2)
            else:
                p = (self.I - k @ self.H) @ p
            out.append(x)
        return torch.stack(out, dim=1)


def _tracks(steps: int = 400) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    pos, vel = torch.randn(8, 2, generator=g) * 50 + 500.0, torch.randn(8, 2, generator=g) * 5
    zs = []
    for _ in range(steps):
        vel = vel + 0.003 * torch.randn(8, 2, generator=g)
        pos = pos + vel * 0.1
        zs.append(pos + 0.01 * torch.randn(8, 2, generator=g))
    return torch.stack(zs, dim=1)


def test_the_lines_that_make_what_the_worst_op_reads_are_walked_up_to_and_checked():
    x = torch.rand(64, 256, generator=torch.Generator().manual_seed(0))
    result = fpdoctor.compare(Bend(), x, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "", first
    start = Bend.forward.__code__.co_firstlineno + 1  # `y = x + 3000.0`
    assert f"compute lines {start}-{start + 1} of" in first.fix and "in fp64" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 1e-3 * first.trial.before


def test_a_state_that_loses_its_properties_over_the_steps_gets_no_fix_that_does_nothing():
    z = _tracks()
    result = fpdoctor.compare(Kalman(), z, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "", first
    assert "compute line" not in first.fix and "the error is not made where it shows" in first.fix, first.fix
    assert "Joseph form" in first.fix
    assert first.trial is not None and not first.trial.tried and "was tried and leaves" in first.trial.reason
    # the stable form the fix names takes the error down, as the trial would have shown
    exact = Kalman().double()(z.double())
    before = float((Kalman()(z).double() - exact).norm() / exact.norm())
    after = float((Kalman(joseph=True)(z).double() - exact).norm() / exact.norm())
    assert after * 10 < before, (before, after)


class Offset(nn.Module):
    """The cancelling line is forward's first: the walk up from it stops at forward's own `def` (what runs
    above it is another method's), and the line alone in fp64 is the fix."""

    def scale(self) -> float:
        return 6000.0

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return (y * y - 9e6) / self.scale() - (y - 3000.0)


def test_the_walk_up_stays_in_the_function():
    line = Offset.forward.__code__.co_firstlineno + 1
    assert _lines_above(__file__, line, 4) == [line]
    assert _lines_above(__file__, line + 1, 4)[:2] == [line + 1, line]  # blank lines and code above are walked
    y = 3000.0 + torch.rand(64, 256, generator=torch.Generator().manual_seed(0))
    first = fpdoctor.compare(Offset(), y, candidate="fp32", reference="fp64").report.findings[0]
    assert f"compute line {line} of" in first.fix and first.trial is not None and first.trial.tried, first.fix


def test_a_covariance_carried_through_two_lines_of_chained_products_is_searched_as_a_state():
    """`p = F @ p @ F.T` reads its own first product within one line: no state of its own, so the carry
    through the update `p = a @ p` and back is still found (both lines kept in float64 by the search)."""
    z = _tracks(60)
    model = Kalman().eval()
    truth = model.double()(z.double())
    _, lines, _ = carried_and_raised(
        model.float(), z, torch.float32, truth=truth.reshape(-1), norm=float(truth.norm()), rng=RngState.capture(),
        device=None, noise=None, keep=[],
    )  # fmt: skip
    source, start = inspect.getsourcelines(Kalman.forward)
    update = start + next(i for i, text in enumerate(source) if "p = (self.I - k @ self.H) @ p" in text)
    assert f"{__file__}:{update}" in lines, sorted(lines)
