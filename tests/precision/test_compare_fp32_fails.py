"""Models that do not run in fp32 where fp64 runs: a factorisation of a kernel matrix that fp32
holds as singular. Compared against fp64, "that line in fp32" would change nothing. compare names
the conditioning and tries the line in fp64: where that runs (a 1-D Gaussian process, its jitter
1e-6), the fix is checked and gives, as printed, the error the check gave; where the matrix is
already singular as fp32 builds it (kriging on a 2-D grid, its jitter 1e-7), the line alone still
fails and the fix says so: the matrix built in fp64 too, which then runs."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import fpdoctor


class Process(nn.Module):
    """A Gaussian process's posterior mean at query points (an RBF kernel of lengthscale 0.05)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        sites = torch.sort(torch.rand(500, generator=g)).values
        self.register_buffer("sites", sites)
        self.register_buffer("readings", torch.sin(12 * sites) + 0.1 * torch.randn(500, generator=g))
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = torch.exp(-((self.sites[:, None] - self.sites[None]) ** 2) / (2 * 0.05**2))
        k = k + 1e-6 * torch.eye(len(self.sites), dtype=x.dtype)
        chol = torch.linalg.cholesky(k.double()).to(x.dtype) if self.fixed else torch.linalg.cholesky(k)
        weights = torch.cholesky_solve(self.readings[:, None].to(x.dtype), chol)
        cross = torch.exp(-((x[:, None] - self.sites[None]) ** 2) / (2 * 0.05**2))
        return (cross @ weights).squeeze(-1)


class Kriging(nn.Module):
    """The field at query points from readings on a grid (an RBF kernel wider than the grid's step)."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        g = torch.linspace(0, 1, 16)
        grid = torch.cartesian_prod(g, g)
        self.register_buffer("sites", grid)
        self.register_buffer("readings", torch.sin(6 * grid[:, 0]) * torch.cos(4 * grid[:, 1]))
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sites = self.sites.double() if self.fixed else self.sites  # the fix as printed: the matrix built in fp64
        k = torch.exp(-torch.cdist(sites, sites).pow(2) / (2 * 0.2**2))
        k = k + 1e-7 * torch.eye(len(sites), dtype=k.dtype)
        chol = torch.linalg.cholesky(k).to(x.dtype)
        weights = torch.cholesky_solve(self.readings[:, None].to(x.dtype), chol)
        return (torch.exp(-torch.cdist(x, self.sites).pow(2) / (2 * 0.2**2)) @ weights).squeeze(-1)


def _line(kind: type[nn.Module]) -> int:
    lines, start = inspect.getsourcelines(kind.forward)
    return start + next(k for k, text in enumerate(lines) if "chol = torch.linalg.cholesky(k" in text)


@pytest.mark.parametrize("kind", [Process, Kriging])
def test_a_factorisation_that_fails_in_fp32_gets_the_conditioning_and_fp64(kind):
    queries = torch.rand(64, 1 if kind is Process else 2, generator=torch.Generator().manual_seed(0))
    if kind is Process:
        queries = queries.squeeze(-1)
    with pytest.raises(RuntimeError):
        kind()(queries)  # the symptom, in fp32
    result = fpdoctor.compare(kind(), queries, candidate="fp32", reference="fp64")
    first = result.report.findings[0]
    assert first.title == "The model does not run in fp32", [(f.code, f.title) for f in result.report.findings]
    assert first.evidence["location"].endswith(f":{_line(kind)}"), first.evidence
    assert "numerically singular in fp32" in first.fix and "in fp32, its operands .float()" not in first.fix
    fixed = fpdoctor.compare(kind(fixed=True), queries, candidate="fp32", reference="fp64")
    assert not any(f.title == "The model does not run in fp32" for f in fixed.report.findings)
    if kind is Kriging:  # the line alone in fp64 still fails: the fix says so, and builds the matrix there too
        assert "that line alone in fp64 still fails (checked)" in first.fix and not first.trial.tried, first.fix
        return
    assert "compute that line in fp64" in first.fix and first.trial.tried, first.trial
    assert fixed.rows[-1].propagated == pytest.approx(first.trial.after, rel=0.05), fixed.rows[-1].propagated
