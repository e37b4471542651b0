"""A selection inside a module with no submodules (the whole model, or a leaf): a k-nearest-neighbour
regressor whose squared distances, each a little off in fp16, pick other neighbours in some rows.
The module's re-run is as far off as the whole model, but none of its own ops is far above its
rounding: the picks make the error. compare names the top-k's line with the lines in fp32 that give
the picks back, checked, and no divergence finding beside it that would say only "compute its ops
in fp32"; the fix as printed leaves no error finding."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor


class NeighbourMean(nn.Module):
    """The mean target of the k nearest stored examples, squared distances by expansion."""

    def __init__(self, keys: torch.Tensor, targets: torch.Tensor, fixed: bool = False, k: int = 4) -> None:
        super().__init__()
        self.register_buffer("keys", keys)
        self.register_buffer("targets", targets)
        self.k, self.fixed = k, fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the printed fix: the distances and the top-k in fp32
            x32, keys = x.float(), self.keys.float()
            sq = (x32 * x32).sum(-1, keepdim=True) - 2 * x32 @ keys.T + (keys * keys).sum(-1)
            near = sq.topk(self.k, dim=-1, largest=False).indices
        else:
            sq = (x * x).sum(-1, keepdim=True) - 2 * x @ self.keys.T + (self.keys * self.keys).sum(-1)
            near = sq.topk(self.k, dim=-1, largest=False).indices
        return self.targets[near].mean(-1)


class Scored(nn.Module):
    """The regressor as a leaf of a larger model: a fixed projection, then the neighbours."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        keys, targets = _data()
        self.proj = nn.Linear(48, 48, bias=False)
        with torch.no_grad():
            self.proj.weight.copy_(torch.eye(48))
        self.neighbours = NeighbourMean(keys, targets, fixed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.neighbours(self.proj(x))


def _points(g: torch.Generator, n: int) -> torch.Tensor:
    return torch.randn(48, generator=torch.Generator().manual_seed(9)) + torch.randn(n, 48, generator=g)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    # stored in fp16 already (a gallery exported from an fp16 encoder): the cast rounds none of them
    keys = _points(torch.Generator().manual_seed(0), 1500).half().float()
    return keys, (torch.sin(keys[:, 0] * 2) + keys[:, 1] * 0.5).half().float()


def _model(shape: str, fixed: bool = False) -> nn.Module:
    return (NeighbourMean(*_data(), fixed) if shape == "whole" else Scored(fixed)).eval()


@pytest.mark.parametrize("shape", ["whole", "leaf"])
def test_a_top_k_in_a_module_without_submodules_is_named_with_its_lines_checked_and_fixed_as_printed(shape: str):
    x = _points(torch.Generator().manual_seed(1), 400).half().float()  # queries from the same fp16 encoder
    result = fpdoctor.compare(_model(shape), x, candidate="fp16")
    first = result.report.findings[0]
    lines, start = inspect.getsourcelines(NeighbourMean.forward)
    at = start + next(k for k, line in enumerate(lines) if "near = sq.topk" in line and "x32" not in lines[k - 1])
    assert first.name == "selection-changed", [(f.code, f.title) for f in result.report.findings]
    assert first.evidence["location"].endswith(f":{at}"), first.evidence
    assert first.trial is not None and first.trial.tried, first.trial
    assert {at - 1, at} <= set(first.evidence["lines_raised"]), first.evidence  # the distances and the top-k
    assert first.evidence["rows_changed_after"] * 2 < first.evidence["rows_changed"], first.evidence
    assert first.evidence["error_after"] * 2 < first.evidence["error_before"], first.evidence
    # the picks are the cause: no divergence finding says "compute the module's ops in fp32" beside it
    assert not any(f.name == "precision-divergence" for f in result.report.findings), result.report.findings
    fixed = fpdoctor.compare(_model(shape, fixed=True), x, candidate="fp16")
    assert not any(f.severity == "error" for f in fixed.report.findings), fixed.report.findings
