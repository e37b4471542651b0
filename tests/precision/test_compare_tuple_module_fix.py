"""A module that returns a tuple (a streaming centring that returns its running mean beside the
centred values) is kept in fp32 by a printed call whose cast back works on that tuple: applied as
printed, the candidate's error falls as the check said."""

from __future__ import annotations

import re

import torch
from torch import nn

import fpdoctor


class _RunningCentre(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = torch.zeros_like(x[:, 0])
        out = []
        for t in range(x.shape[1]):
            mean = mean + (x[:, t] - mean) / (t + 1)
            out.append(x[:, t] - mean)
        return torch.stack(out, 1), mean


class _Tagger(nn.Module):
    def __init__(self, fixed: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.centre = _RunningCentre()
        self.head = nn.Linear(8, 4)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed is not None:  # the printed call, as the user pastes it
            centred, _ = eval(self.fixed, {"torch": torch, "self": self, "x": x})
        else:
            centred, _ = self.centre(x)
        return self.head(centred)


def _frames() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return 6.0 + torch.randn(2, 400, 8, generator=g)


def test_a_tuple_returning_module_is_kept_in_fp32_by_a_call_that_runs_as_printed() -> None:
    x = _frames()
    result = fpdoctor.compare(_Tagger().eval(), x, candidate="bf16")
    found = next(f for f in result.report.findings if f.where.get("module") == "centre")
    assert found.trial is not None and found.trial.tried, str(result.report)
    assert "it holds no parameters" in found.fix  # its own form: no weights to restore, no parameter's dtype
    call = re.search(r"\(`(torch\.utils\._pytree\.tree_map\(.*?)`\)", found.fix).group(1)
    assert call.startswith("torch.utils._pytree.tree_map(")
    model = _Tagger(fixed=call).eval()
    with torch.no_grad():
        exact = model.double()(x.double())
        got = model.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    error = float((got.double() - exact).norm() / exact.norm())
    assert error <= 2 * found.trial.after and error * 4 < found.trial.before
