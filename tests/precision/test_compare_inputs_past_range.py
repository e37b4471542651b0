"""A module fed values past the format's range did not make its NaN/Inf: a graph layer sums 15,000
messages into one hub node with scatter_add_ (past fp16's 65504), and the Linear after it reads
them. Re-run on its fp64 inputs rounded to fp16, that Linear is non-finite too, but only because
those inputs are Inf in fp16: compare names the aggregation's module and its op, with the Linear's
row saying the Inf comes in."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor


class Pool(nn.Module):
    """Messages summed into their cluster with scatter_add_, then a Linear on the sums (`scaled`: on the
    sums scaled down, so that the sums alone in fp32 are a fix)."""

    def __init__(self, scaled: bool, d: int = 32) -> None:
        super().__init__()
        self.scaled = scaled
        self.msg = nn.Linear(8, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        m = torch.relu(self.msg(x))
        at = cluster[:, None].expand_as(m)
        sums = torch.zeros(int(cluster.max()) + 1, m.shape[1], dtype=m.dtype).scatter_add_(0, at, m)
        sums = sums / (1 + sums.abs().amax(1, keepdim=True)) if self.scaled else sums  # back into range
        return self.out(sums)


class Graph(nn.Module):
    def __init__(self, scaled: bool = False) -> None:
        super().__init__()
        self.pool, self.head = Pool(scaled), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(x, cluster))


def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    cluster = torch.cat([torch.zeros(15000, dtype=torch.long), torch.randint(1, 500, (5000,), generator=g)])
    return 40 * torch.randn(20000, 8, generator=g), cluster


def test_the_module_that_sums_past_the_range_is_named_not_the_one_that_reads_the_sums() -> None:
    torch.manual_seed(0)
    result = fpdoctor.compare(Graph().eval(), _graph(), candidate="fp16")
    assert result.first_divergent == "pool", str(result.report)
    out = next(r for r in result.rows if r.module == "pool.out")
    assert not out.diverged and out.unconfirmed is not None and "made upstream" in out.unconfirmed


def test_a_sum_that_writes_into_its_own_input_is_found_overflowing_and_its_lines_checked() -> None:
    # scatter_add_ into zeros: its inputs are read finite before it writes
    torch.manual_seed(0)
    result = fpdoctor.compare(Graph(scaled=True).eval(), _graph(), candidate="fp16")
    first = result.report.findings[0]
    assert "scatter_add_" in first.message and first.trial is not None and first.trial.tried, first.fix
