"""compare's candidate pass watches ops only where it must: inside the module calls whose fp64 op
outputs came near the format's max, and, re-run from their inputs, the calls whose output turned
non-finite in the candidate's run."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import near_limit
from fpdoctor.precision.compare.near_limit import OpRanges

FP16_MAX = 65504.0


class Grow(nn.Module):
    """Multiplies by 1.0006 a thousand times: fp16 rounds the factor up to 1 + 2^-10, so its
    output comes out about 45% above the fp64 one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(1000):
            x = x * 1.0006
        return x


class Scale(nn.Module):
    """(x - offset) * factor in three multiplies (the last one is where fp16 overflows)."""

    def __init__(self, factor: float, offset: float = 0.0) -> None:
        super().__init__()
        self.factor, self.offset = factor, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x - self.offset) * 16.0
        y = y * 16.0
        return y * (self.factor / 256.0)  # the overflow


_SOURCE, _FIRST = inspect.getsourcelines(Scale.forward)
OVERFLOW_LINE = _FIRST + next(n for n, text in enumerate(_SOURCE) if "# the overflow" in text)


class Chain(nn.Module):
    def __init__(self, factor: float, offset: float = 0.0) -> None:
        super().__init__()
        self.grow, self.scale = Grow(), Scale(factor, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.grow(x))


GROWN = float(Grow()(torch.ones(1, dtype=torch.float64)))  # 1.0006 ** 1000


@pytest.mark.parametrize(
    ("fp64_peak", "below"),
    [
        (62000.0, GROWN),  # near the max in fp64 already: the pass watches `scale`
        # far below it in fp64 (not watched): a cancellation that fp16's larger input makes 80x
        # larger, overflowing only as the candidate runs
        (FP16_MAX / 32, 0.002),
    ],
)
def test_an_overflow_only_in_the_candidates_run_is_named_with_its_op(fp64_peak, below):
    model, x = Chain(fp64_peak / below, GROWN - below), torch.ones(8)
    assert float(model.double()(x.double())[0]) == pytest.approx(fp64_peak, rel=1e-6)
    assert not torch.isfinite(model.half()(x.half())).any()  # the candidate's run overflows in `scale` ...
    fed = torch.full((8,), GROWN, dtype=torch.float64).half()
    assert torch.isfinite(model.scale(fed)).all()  # ... which, fed the fp64 inputs, does not
    model = model.float()

    result = fpdoctor.compare(model, x, candidate="fp16")
    found = result.overflows["scale"]
    assert found["op"] == "aten.mul.Tensor" and found["location"] == f"{__file__}:{OVERFLOW_LINE}"
    assert found["reference_absmax"] > FP16_MAX  # the fp32 copy, fed the candidate's inputs
    assert "grow" not in result.overflows


class Tiny(nn.Module):
    """Many tiny ops, values far from fp16's max; one submodule optionally near it."""

    def __init__(self, near: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Tanh() for _ in range(20)))
        self.hot = Scale(200000.0) if near else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(50):
            x = torch.tanh(x * 0.9 + 0.1)
        return self.hot(self.body(x)) * 0.001


def _candidate_ops(monkeypatch) -> list[str]:
    """The module of every op the candidate pass's ranges see through their dispatch mode."""
    seen: list[str] = []
    dispatch = OpRanges.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if self._dtypes == near_limit.AT_RISK:  # the candidate's recorder (the fp64 pass's is no mode)
            seen.append(self._stack[-1][0] if self._stack else "<outside>")
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(OpRanges, "__torch_dispatch__", counted)
    return seen


def test_a_healthy_many_op_model_runs_its_candidate_pass_under_no_dispatch_mode(monkeypatch):
    seen = _candidate_ops(monkeypatch)
    result = fpdoctor.compare(Tiny(near=False), torch.rand(4, 16), candidate="fp16")
    assert result.report.by_name("overflow-risk") == []
    assert seen == []


def test_only_the_module_near_the_max_is_watched_and_its_risk_still_found(monkeypatch):
    seen = _candidate_ops(monkeypatch)
    x = torch.full((4, 16), 0.9)
    result = fpdoctor.compare(Tiny(near=True), x, candidate="fp16")
    assert seen and set(seen) == {"hot"}  # its three multiplies, nothing of the loop or the body
    (risk,) = result.report.by_name("overflow-risk")
    assert risk.where["module"] == "hot" and risk.evidence["reference_share"] > 0.5
    assert risk.where["op"] == "aten.mul.Tensor"  # (its line is this file's spy above: a frame of the user's)


def test_a_module_that_raises_inside_a_watched_call_leaves_no_mode_behind():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    class Fails(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 60000.0
            if y.dtype == torch.float16:
                raise RuntimeError("no fp16 kernel")
            return y

    result = fpdoctor.compare(nn.Sequential(Fails()), torch.ones(4), candidate="fp16")
    assert "no fp16 kernel" in result.report.data["not_checked"]["candidate run"]
    assert _get_current_dispatch_mode_stack() == []
