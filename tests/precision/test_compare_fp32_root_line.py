"""An fp32 candidate whose error the model's own ops make (no submodule): the worst op's line in fp64
is tried end to end before it is printed, walking up to the lines that make what it reads; where no
span of lines cures it, the error is carried from step to step and that fix is never printed.

A bend computed as ((x + 3000)^2 - 9e6) / 6000: the square cancels, but `y = x + 3000` rounds x first,
so the squaring line alone in fp64 does nothing and the two lines together cure it. A Kalman filter
with the textbook covariance update `P = (I - K H) P`, tiny measurement noise and no process noise:
fp32 loses P's positive-definiteness over the steps; the gain's bmm shows the error, but no fp64 line
of one step cures it: the recurrence that carries P from step to step (its prediction, the gain's two
lines, its update) kept in fp64 from the first step does, as the fix prints it (the Joseph form does
too: a stable form is the user's to write). Where the walk fails and the line is on no recurrence,
no fix is printed as checked."""

from __future__ import annotations

import inspect
import math

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
    """Constant-velocity tracking of 2-D positions; `joseph`: the stable covariance update; `wide`: the
    recurrence kept in fp64 as the fix prints it (P and its lines in fp64, the gain cast back for x)."""

    def __init__(self, joseph: bool = False, wide: bool = False) -> None:
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
        self.wide = wide

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(z.shape[0], 4, dtype=z.dtype)
        x[:, :2] = z[:, 0]
        p = self.P0.expand(z.shape[0], 4, 4).clone()
        f, h, r, i = (self.F, self.H, self.R, self.I)
        if self.wide:  # the operands the recurrence's lines read from the rest of the model, .double()
            p, f, h, r, i = p.double(), f.double(), h.double(), r.double(), i.double()
        out = []
        for t in range(z.shape[1]):
            x = x @ self.F.T
            p = f @ p @ f.T
            s = h @ p @ h.T + r
            k = p @ h.T @ torch.linalg.inv(s)
            x = x + (k.to(z.dtype) @ (z[:, t] - x @ self.H.T).unsqueeze(-1)).squeeze(-1)
            if self.joseph:
                a = self.I - k @ self.H
                p = a @ p @ a.transpose(-1, -2) + k @ self.R @ k.transpose(-1, -2)
            else:
                p = (i - k @ h) @ p
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


def _line(text: str) -> int:
    source, start = inspect.getsourcelines(Kalman.forward)
    return start + next(i for i, line in enumerate(source) if text in line)


def test_a_state_carried_through_a_recurrence_is_kept_in_fp64_from_the_first_step_as_printed():
    z = _tracks()
    result = fpdoctor.compare(Kalman(), z, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "", first
    # the prediction, the gain's two lines and the update; the state's estimate (x) reads the gain cast back
    cycle = [_line("p = f @ p @ f.T"), _line("s = h @ p @ h.T + r"), _line("k = p @ h.T"), _line("p = (i - k @ h) @ p")]
    assert first.evidence["recurrence"]["lines"] == [f"{__file__}:{n}" for n in cycle], first.evidence
    assert first.evidence["recurrence"]["readers"] == [f"{__file__}:{_line('x = x + (k.to')}"], first.evidence
    assert "the error is carried from one run of these lines to the next" in first.fix, first.fix
    assert "in fp64 from the first run" in first.fix
    assert f"lines {cycle[0]}-{cycle[2]} and {cycle[3]} of {__file__}" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    # as printed: those lines in fp64, what the estimate's line reads cast back, gives the figure checked
    exact = Kalman().double()(z.double())
    before = float((Kalman()(z).double() - exact).norm() / exact.norm())
    wide = float((Kalman(wide=True)(z).double() - exact).norm() / exact.norm())
    assert wide * 100 < before and wide < 3 * first.trial.after + 1e-7, (before, wide, first.trial)
    # the stable form the fix names beside it takes the error down too
    joseph = float((Kalman(joseph=True)(z).double() - exact).norm() / exact.norm())
    assert joseph * 10 < before, (before, joseph)


class RLS(nn.Module):
    """Recursive least squares tracking an 8-tap channel from badly scaled inputs, forgetting factor
    0.99: the gain reads the inverse correlation P's recurrence, and the taps' recurrence reads the gain.
    The worst op is the taps' error line; both recurrences in fp64 are the fix (the taps' alone is not).
    `wide`: the fix as printed."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.register_buffer("P0", torch.eye(8) / 1e-4)
        self.wide = wide

    def forward(self, u: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        w = torch.zeros(u.shape[0], 8, dtype=u.dtype)
        p = self.P0.expand(u.shape[0], 8, 8).clone()
        if self.wide:  # the operands the recurrence's lines read from the rest of the model, .double()
            w, p, u, d = w.double(), p.double(), u.double(), d.double()
        out = []
        for t in range(u.shape[1]):
            x = u[:, t]
            px = (p @ x.unsqueeze(-1)).squeeze(-1)
            k = px / (0.99 + (x * px).sum(-1, keepdim=True))
            e = d[:, t] - (w * x).sum(-1)
            w = w + k * e.unsqueeze(-1)
            p = (p - k.unsqueeze(-1) * px.unsqueeze(-2)) / 0.99
            out.append(w)
        return torch.stack(out, 1).float() if self.wide else torch.stack(out, 1)


def test_the_recurrences_an_op_reads_from_are_kept_in_fp64_with_its_own():
    g = torch.Generator().manual_seed(0)
    u = torch.randn(16, 1500, 8, generator=g) * torch.logspace(0, -2, 8)
    d = (u * torch.randn(16, 8, generator=g)[:, None]).sum(-1) + 1e-3 * torch.randn(16, 1500, generator=g)
    first = fpdoctor.compare(RLS(), (u, d), candidate="fp32", reference="fp64").report.findings[0]
    source, start = inspect.getsourcelines(RLS.forward)
    at = {text: start + next(i for i, line in enumerate(source) if text in line) for text in ("px = (p", "p = (p -")}
    lines = [f"{__file__}:{n}" for n in range(at["px = (p"], at["p = (p -"] + 1)]
    assert first.evidence["recurrence"]["lines"] == lines, first.evidence  # P's, the gain's and the taps' lines
    assert f"lines {at['px = (p']}-{at['p = (p -']} of {__file__}" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 1000 < first.trial.before
    exact = RLS().double()(u.double(), d.double())
    wide = float((RLS(wide=True)(u, d).double() - exact).norm() / exact.norm())
    assert wide < 3 * first.trial.after + 1e-7, (wide, first.trial)


class FarOffset(nn.Module):
    """The offset that rounds x is added five lines above the cancelling line: beyond the walk up, and on
    no recurrence (no loop): no fix is printed as checked, and the fallback says where else to look."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x + 3000.0
        a = x * 2.0
        b = a.sin()
        c = b * 0.5
        d = c + 1.0
        return (y * y - 9e6) / 6000.0 - x + d


def test_no_recurrence_and_no_span_that_cures_it_prints_no_fix_as_checked():
    x = torch.rand(64, 256, generator=torch.Generator().manual_seed(0))
    first = fpdoctor.compare(FarOffset(), x, candidate="fp32", reference="fp64").report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "", first
    assert "the error is not made where it shows" in first.fix and "recurrence" not in first.evidence, first.fix
    assert first.trial is not None and not first.trial.tried and "was tried and leaves" in first.trial.reason


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
    assert f"{__file__}:{_line('p = (i - k @ h) @ p')}" in lines, sorted(lines)


class RunningTotal(nn.Module):
    """A running total of readings near 1e4 whose loop body is one line, returned as it is (no line
    outside the loop reads it), less the offset its readings carry, five lines below (beyond the walk
    up); `clock`: a tensor step counter carried beside it, which the total reads and the fix does not
    need."""

    def __init__(self, clock: bool = False) -> None:
        super().__init__()
        self.clock = clock

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.zeros(x.shape[0], dtype=x.dtype)
        n = torch.zeros((), dtype=x.dtype)
        for t in range(x.shape[1]):
            s = s + x[:, t] * (1.0 + 0.0 * n) if self.clock else s + x[:, t]
            n = n + 1.0
        a = x.mean(1) * 2.0
        b = a.sin()
        c = b * 0.5
        d = c + 1.0
        return s - 1e4 * x.shape[1] / 2 + d


def test_a_one_line_loop_body_returned_as_it_is_gets_its_recurrence_and_a_counter_is_left_out():
    x = 1e4 + torch.rand(4, 3000, generator=torch.Generator().manual_seed(0))
    source, start = inspect.getsourcelines(RunningTotal.forward)
    total = start + next(i for i, line in enumerate(source) if "s = s + x[:, t]" in line)
    for clock in (False, True):
        first = fpdoctor.compare(RunningTotal(clock), x, candidate="fp32", reference="fp64").report.findings[0]
        assert first.evidence["recurrence"]["lines"] == [f"{__file__}:{total}"], (clock, first.evidence)
        assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before


class Returned(nn.Module):
    """A running sum returned as it is: no line outside the loop reads what the recurrence makes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.zeros(x.shape[0], dtype=x.dtype)
        for t in range(x.shape[1]):
            s = s + x[:, t]
            s = s * 1.0
        return s


def test_a_recurrence_that_nothing_outside_reads_is_fixed_without_a_cast_back():
    x = torch.rand(16, 4000, generator=torch.Generator().manual_seed(0))
    first = fpdoctor.compare(Returned(), x, candidate="fp32", reference="fp64").report.findings[0]
    assert first.evidence["recurrence"]["readers"] == [] and "cast what" not in first.fix, first.fix
    assert first.trial is not None and first.trial.tried


class Resonator(nn.Module):
    """A two-pole resonator tuned to a slow tone (pole radius 0.99995), its coefficients made in forward
    from its frequency and radius, then read at every step: rounded to fp32 they move the pole, which
    no recursion in fp64 undoes. `wide`: the fix as printed (the coefficients' lines and the recursion
    in fp64, the output cast back)."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        self.register_buffer("freq", torch.tensor([0.002, 0.003]))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        freq = self.freq.double() if self.wide else self.freq
        c1 = 2 * 0.99995 * torch.cos(2 * math.pi * freq)
        c2 = torch.full_like(freq, -(0.99995**2))
        x = x.double() if self.wide else x
        y1 = x.new_zeros(x.shape[0], 2)
        y2 = x.new_zeros(x.shape[0], 2)
        out = []
        for t in range(x.shape[1]):
            y = c1 * y1 + c2 * y2 + x[:, t, None]
            y2, y1 = y1, y
            out.append(y)
        return torch.stack(out, 1).float() if self.wide else torch.stack(out, 1)


def test_what_a_recurrence_reads_every_step_is_computed_in_fp64_with_it_as_printed():
    x = torch.randn(2, 1500, generator=torch.Generator().manual_seed(0))
    first = fpdoctor.compare(Resonator(), x, candidate="fp32", reference="fp64").report.findings[0]
    source, start = inspect.getsourcelines(Resonator.forward)
    made = [start + i for i, line in enumerate(source) if line.strip().startswith(("c1 =", "c2 ="))]
    assert {f"{__file__}:{n}" for n in made} <= set(first.evidence["recurrence"]["fed"]), first.evidence
    assert "which make what it reads, in fp64 too" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    exact = Resonator().double()(x.double())
    wide = float((Resonator(wide=True)(x).double() - exact).norm() / exact.norm())
    assert wide < 3 * first.trial.after + 1e-7, (wide, first.trial)


class FarTracker(nn.Module):
    """GPS fixes in metres far from the origin (a UTM northing of 5.4e6): the estimate at that offset
    rounds every step in fp32 (its spacing there 0.5 m, against 1 m of noise) while the worst op is on
    the covariance's cycle, whose fp64 cures nothing. The fix is the cycle that makes the output: the
    estimate's two lines in fp64 from the first step. `wide`: that fix as printed."""

    def __init__(self, wide: bool = False) -> None:
        super().__init__()
        f = torch.eye(4)
        f[0, 2] = f[1, 3] = 0.1
        h = torch.zeros(2, 4)
        h[0, 0] = h[1, 1] = 1.0
        self.register_buffer("F", f)
        self.register_buffer("H", h)
        self.register_buffer("Q", 1e-8 * torch.eye(4))
        self.register_buffer("R", torch.eye(2))
        self.register_buffer("P0", 10.0 * torch.eye(4))
        self.register_buffer("I", torch.eye(4))
        self.wide = wide

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(z.shape[0], 4, dtype=torch.float64 if self.wide else z.dtype)
        x[:, :2] = z[:, 0]
        p = self.P0.expand(z.shape[0], 4, 4).clone()
        out = []
        for t in range(z.shape[1]):
            x = x @ (self.F.double() if self.wide else self.F).T
            p = self.F @ p @ self.F.T + self.Q
            s = self.H @ p @ self.H.T + self.R
            k = p @ self.H.T @ torch.linalg.inv(s)
            if self.wide:
                x = x + (k.double() @ (z[:, t].double() - x @ self.H.double().T).unsqueeze(-1)).squeeze(-1)
            else:
                x = x + (k @ (z[:, t] - x @ self.H.T).unsqueeze(-1)).squeeze(-1)
            p = (self.I - k @ self.H) @ p
            out.append(x.to(z.dtype))
        return torch.stack(out, dim=1)


def test_a_state_rounded_at_its_offset_is_the_recurrence_that_makes_the_output_kept_in_fp64():
    g, f64 = torch.Generator().manual_seed(0), torch.float64
    start = torch.tensor([448_250.0, 5_411_730.0], dtype=f64) + 100 * torch.randn(2, 2, generator=g, dtype=f64)
    vel, steps = torch.randn(2, 2, generator=g, dtype=f64), 0.1 * torch.arange(500, dtype=f64)
    z = start[:, None] + vel[:, None] * steps[None, :, None] + torch.randn(2, 500, 2, generator=g, dtype=f64)
    first = fpdoctor.compare(FarTracker(), z, candidate="fp32", reference="fp64").report.findings[0]
    assert first.name == "precision-divergence" and first.where["module"] == "", first
    source, start_line = inspect.getsourcelines(FarTracker.forward)
    at = {t: start_line + next(i for i, s in enumerate(source) if t in s) for t in ("x = x @", "x = x + (k @", "k = p")}
    assert first.evidence["own_op_location"] == f"{__file__}:{at['k = p']}", first.evidence  # the covariance's
    assert first.evidence["recurrence"]["lines"] == [f"{__file__}:{at['x = x @']}", f"{__file__}:{at['x = x + (k @']}"]
    assert "keep the recurrence that makes the output in fp64" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 10 < first.trial.before
    exact = FarTracker().double()(z)
    wide = float((FarTracker(wide=True)(z.float()).double() - exact).norm() / exact.norm())
    assert wide < 3 * first.trial.after + 1e-8, (wide, first.trial)


class Pendulums(nn.Module):
    """Four coupled pendulums driven by a sine, semi-implicit Euler, the clock kept as `t = t + dt`: fp32's
    clock drifts and the drive's phase with it. The coupling is written into `nb` in place by lines outside
    the recurrence (`nb[1:] += ...`): kept in fp64, `nb` is written as it is, not a copy cast down.
    `wide`: the fix as printed (the recurrence's lines in fp64, the lines outside reading its values cast
    back)."""

    def __init__(self, steps: int = 2000, wide: bool = False) -> None:
        super().__init__()
        self.register_buffer("omega0_sq", torch.tensor([39.2, 32.7, 28.0, 24.5]))
        self.register_buffer("drive_w", torch.tensor(5.65))
        self.dt, self.steps, self.wide = 1e-3, steps, wide

    def accel(self, th: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        nb = torch.zeros_like(th)
        low = th.float() if self.wide else th  # what the lines outside read of the recurrence, cast back
        nb[1:] += low[:-1] - low[1:]
        nb[:-1] += low[1:] - low[:-1]
        drive = 1.5 * torch.cos(self.drive_w * (t.float() if self.wide else t))
        return -self.omega0_sq * torch.sin(th) + 2.0 * nb - 0.3 * w + drive

    def forward(self, th: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        t = torch.zeros((), dtype=th.dtype)
        if self.wide:
            th, w, t = th.double(), w.double(), t.double()
        out = []
        for step in range(self.steps):
            w = w + self.dt * self.accel(th, w, t)
            th = th + self.dt * w
            t = t + self.dt
            if (step + 1) % 40 == 0:
                out.append(th.float() if self.wide else th)
        return torch.stack(out)


def test_a_recurrence_whose_state_lines_outside_write_into_in_place_is_checked_as_printed():
    th, w = torch.tensor([0.1, 0.0, -0.1, 0.05]), torch.zeros(4)
    first = fpdoctor.compare(Pendulums(), (th, w), candidate="fp32", reference="fp64").report.findings[0]
    assert first.name == "precision-divergence" and "recurrence" in first.evidence, first.fix
    source, start = inspect.getsourcelines(Pendulums)
    clock = f"{__file__}:{start + next(i for i, s in enumerate(source) if 't = t + self.dt' in s)}"
    assert clock in first.evidence["recurrence"]["lines"], first.evidence
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    exact = Pendulums().double()(th.double(), w.double())
    wide = float((Pendulums(wide=True)(th, w).double() - exact).norm() / exact.norm())
    assert wide < 3 * first.trial.after + 1e-9, (wide, first.trial)


class Chain(nn.Module):
    """Six masses on springs between two walls, integrated with RK4 (a cycle of more lines than a state's
    update: the forces' lines and the four stages), positions held as absolute coordinates near 3 m whose
    small motions fp32 rounds every step. The loop's state (x, v, t) held in fp64 is the fix. `wide`: as
    printed (x, v, t .double() before the loop, the output cast back)."""

    def __init__(self, steps: int = 600, wide: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("k", 40.0 + 20.0 * torch.rand(7, generator=g))
        self.register_buffer("walls", torch.tensor([0.0, 3.5]))
        self.dt, self.steps, self.wide = 5e-4, steps, wide

    def forces(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        left = torch.cat([self.walls[:1], x])
        right = torch.cat([x, self.walls[1:]])
        extension = right - left - 0.5
        tension = self.k * extension
        f = tension[1:] - tension[:-1]
        pulse = 30.0 * torch.exp(-(((t - 0.05) / 0.02) ** 2))
        drive = torch.cat([pulse.reshape(1), torch.zeros_like(x[1:])])
        return f + drive

    def forward(self, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dt, t = self.dt, torch.zeros((), dtype=x.dtype)
        if self.wide:
            x, v, t = x.double(), v.double(), t.double()
        out = []
        for step in range(self.steps):
            a1 = self.forces(x, t)
            x2, v2 = x + 0.5 * dt * v, v + 0.5 * dt * a1
            a2 = self.forces(x2, t + 0.5 * dt)
            x3, v3 = x + 0.5 * dt * v2, v + 0.5 * dt * a2
            a3 = self.forces(x3, t + 0.5 * dt)
            x4, v4 = x + dt * v3, v + dt * a3
            a4 = self.forces(x4, t + dt)
            x = x + dt / 6.0 * (v + 2 * v2 + 2 * v3 + v4)
            v = v + dt / 6.0 * (a1 + 2 * a2 + 2 * a3 + a4)
            t = t + dt
            if (step + 1) % 50 == 0:
                out.append(torch.stack([x, v]))
        return torch.stack(out).float() if self.wide else torch.stack(out)


def test_a_loop_whose_cycle_is_most_of_the_forward_gets_its_state_held_in_fp64_as_printed():
    x, v = 0.5 * torch.arange(1, 7, dtype=torch.float32), torch.zeros(6)
    first = fpdoctor.compare(Chain(), (x, v), candidate="fp32", reference="fp64").report.findings[0]
    assert first.name == "precision-divergence" and "loop_state" in first.evidence, first.fix
    assert first.evidence["loop_state"]["names"] == ["x", "v", "t"], first.evidence
    assert "hold `x`, `v`, `t` in fp64 from the first step" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 100 < first.trial.before
    exact = Chain().double()(x.double(), v.double())
    wide = float((Chain(wide=True)(x, v).double() - exact).norm() / exact.norm())
    assert wide < 3 * first.trial.after + 1e-9, (wide, first.trial)
