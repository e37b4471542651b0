"""An op that overflows on a line that also calls a module (`return self.proj((h @ g) / ...)`): the
check computes the line in fp32, and the module it calls with it (its weights in fp32), its output
cast back. The fix said "cast back only what line 12 returns", which a user read as "after the
fp16 Linear" (it takes fp32 input: a dtype error) or "before it" (not what ran). It now says what
the check ran, and names casting back before the call as the alternative not tried."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Projection(nn.Module):
    """A projection of the user's own: its ops run at its own lines, not the caller's."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class GramPool(nn.Module):
    """A pooling by the features' Gram matrix over 2048 positions: its products pass fp16's max.
    `fixed`: as printed; `own`: the projection a module of the user's, cast back before it (as printed)."""

    def __init__(self, d: int = 32, fixed: bool = False, own: bool = False) -> None:
        super().__init__()
        self.inp, self.fixed, self.own = nn.Linear(d, d), fixed, own
        self.proj = Projection(d) if own else nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = 4 * (F.elu(self.inp(x)) + 1)
        if self.fixed and self.own:
            h32 = h.float()
            g = h32.transpose(1, 2) @ h32
            return self.proj(((h32 @ g) / g.sum(-1).unsqueeze(1)).to(h.dtype))
        if self.fixed:  # as printed: the two lines in fp32, the module the second calls in fp32, cast back
            h32 = h.float()
            g = h32.transpose(1, 2) @ h32
            w, b = self.proj.weight.float(), self.proj.bias.float()
            return F.linear((h32 @ g) / g.sum(-1).unsqueeze(1), w, b).to(h.dtype)
        g = h.transpose(1, 2) @ h
        return self.proj((h @ g) / g.sum(-1).unsqueeze(1))


class Net(nn.Module):
    def __init__(self, fixed: bool = False, own: bool = False) -> None:
        super().__init__()
        self.pool, self.out = GramPool(fixed=fixed, own=own), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.pool(x))


def test_the_fix_of_a_line_that_calls_a_module_says_what_the_check_ran_and_works_as_printed() -> None:
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 2048, 32, generator=torch.Generator().manual_seed(1))
    first = fpdoctor.compare(model, x, candidate="fp16").report.findings[0]
    assert "overflows" in first.fix and first.trial is not None and first.trial.tried, first.fix
    assert "the check ran the torch module it calls (self.proj) in fp32 too, its output cast back" in first.fix
    assert "not tried: cast back before that call instead, `self.proj(x.to(p.dtype))`" in first.fix

    fixed = Net(fixed=True).eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        plain = copy.deepcopy(model).half()(x.half())
        out = copy.deepcopy(fixed).half()(x.half())
    assert not bool(torch.isfinite(plain).all())
    rel = float((out.double() - exact).norm() / exact.norm())
    assert rel <= 1.05 * float(first.trial.after), (rel, first.trial.after)


def test_a_module_of_the_users_on_that_line_reads_the_values_cast_back_as_printed() -> None:
    """Its ops run at its own lines, which the check did not raise: it read them cast back, and the
    fix says so (the review of the change above: "ran in fp32" was false for it)."""
    torch.manual_seed(0)
    model, x = Net(own=True).eval(), torch.randn(2, 2048, 32, generator=torch.Generator().manual_seed(1))
    first = fpdoctor.compare(model, x, candidate="fp16").report.findings[0]
    assert "a module of yours it calls (self.proj) reads them cast back, as the check ran it" in first.fix, first.fix
    assert "torch module" not in first.fix
    fixed = Net(fixed=True, own=True).eval()
    fixed.load_state_dict(model.state_dict())
    with torch.no_grad():
        exact = copy.deepcopy(model).double()(x.double())
        out = copy.deepcopy(fixed).half()(x.half())
    rel = float((out.double() - exact).norm() / exact.norm())
    assert rel <= 1.05 * float(first.trial.after), (rel, first.trial.after)
