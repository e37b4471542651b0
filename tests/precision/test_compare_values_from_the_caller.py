"""A module whose error is forced by what its caller passes it: whole numbers the caller counts in
the model's dtype (time steps 1..2048 by a cumsum in bf16, exact only to 256), read by a time
encoding's cos and, beside it, as the divisor of a running mean. The walk upstream of the cos goes
past the module into its caller's lines, and on to the other lines that read those whole numbers;
the check raises them all, and the module that reads them in fp32 from its caller is not re-run on
inputs rounded to bf16. Applied as printed (the count in fp32, the table a plain fp32 attribute, the
mean in fp32, each result cast back), compare says OK, with the end-to-end error the check gave."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor


class _Time(nn.Module):
    def __init__(self, fixed: bool, width: int = 32) -> None:
        super().__init__()
        if fixed:  # as printed: a plain fp32 attribute, which the model's cast leaves as it is
            self.w = torch.logspace(0, -3, width)
        else:
            self.register_buffer("w", torch.logspace(0, -3, width))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cos(t.unsqueeze(-1) * self.w)


class _Sensor(nn.Module):
    def __init__(self, fixed: bool = False, features: int = 6, width: int = 32) -> None:
        super().__init__()
        self.fixed = fixed
        self.inp, self.time, self.out = nn.Linear(features, width), _Time(fixed, width), nn.Linear(2 * width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        wide = torch.float32 if self.fixed else None
        steps = torch.ones_like(h[..., 0], dtype=wide).cumsum(1)  # the time step, 1..T
        h = h + self.time(steps).to(h.dtype)
        mean = (h.to(wide) if self.fixed else h).cumsum(1) / steps.unsqueeze(-1)  # running mean
        return self.out(torch.cat([h, mean.to(h.dtype)], -1))


def _line(text: str) -> int:
    source, start = inspect.getsourcelines(_Sensor.forward)
    return start + next(i for i, line in enumerate(source) if text in line)


def _model(fixed: bool) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return _Sensor(fixed).eval(), torch.randn(2, 2048, 6)


@pytest.mark.filterwarnings("ignore")
def test_whole_numbers_a_caller_passes_are_named_at_its_lines_checked_and_the_fix_is_ok() -> None:
    result = fpdoctor.compare(*_model(False), candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "precision-divergence" and first.evidence["diverged"] == ["time"], str(result.report)
    lines = {int(x.rpartition(":")[2]) for x in first.evidence["feeding_lines"]}
    assert {_line("cumsum(1)  # the time"), _line("# running mean")} <= lines, lines
    assert first.trial is not None and first.trial.tried
    before, after = float(first.trial.before), float(first.trial.after)
    assert after * 10 < before and after < 0.01, first.fix
    assert "whole numbers up to 2048" in first.message
    fixed = fpdoctor.compare(*_model(True), candidate="bf16")
    assert fixed.report.verdict == "ok" and not fixed.report.findings, str(fixed.report)  # not re-run on rounded inputs
    root = next(r for r in fixed.rows if r.module == "")
    assert root.propagated == pytest.approx(after, rel=0.05)  # applied as printed, the figure the check gave


class _Frames(nn.Module):
    """Frame features with a time embedding the way diffusers writes it (t.float() inside, fp32
    frequencies, the result cast to its Linear's dtype); the caller counts the frames in x's dtype."""

    def __init__(self, fixed: bool = False, width: int = 32) -> None:
        super().__init__()
        self.fixed = fixed
        self.inp, self.proj, self.out = nn.Linear(8, width), nn.Linear(width, width), nn.Linear(width, 5)

    def embed(self, t: torch.Tensor) -> torch.Tensor:
        freqs = torch.exp(-9.2 * torch.arange(16, dtype=torch.float32) / 16)
        args = t[:, None].float() * freqs[None]
        return self.proj(torch.cat([args.cos(), args.sin()], -1).to(self.proj.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frame = torch.arange(x.shape[1], dtype=torch.float32 if self.fixed else x.dtype)  # the frame index
        return self.out(torch.relu(self.inp(x) + self.embed(frame)))


@pytest.mark.filterwarnings("ignore")
def test_whole_numbers_a_reader_widens_are_kept_in_fp32_not_cast_back() -> None:
    """The embedding widens the frame index itself: made in fp32 and cast back, it is rounded again
    before it is read, so the check that casts back cures nothing; kept fp32 it does, and the fix says
    not to cast it back. Applied as printed (dtype=torch.float32 at that line), compare says OK."""
    torch.manual_seed(0)
    broken, x = _Frames().eval(), torch.randn(2, 3000, 8)
    result = fpdoctor.compare(broken, x, candidate="bf16")
    first = result.report.findings[0]
    assert first.name == "whole-numbers-rounded", str(result.report)
    assert first.evidence["location"].endswith(f":{_frames_line()}")
    assert "not cast back" in first.fix and first.trial is not None and first.trial.tried
    assert float(first.trial.after) * 10 < float(first.trial.before)
    torch.manual_seed(0)
    fixed = fpdoctor.compare(_Frames(fixed=True).eval(), x, candidate="bf16")
    assert fixed.report.verdict == "ok", str(fixed.report)


def _frames_line() -> int:
    source, start = inspect.getsourcelines(_Frames.forward)
    return start + next(i for i, line in enumerate(source) if "# the frame index" in line)
