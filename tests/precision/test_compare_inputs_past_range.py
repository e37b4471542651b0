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
    """Messages summed into their cluster with scatter_add_, then a Linear on the sums."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.msg = nn.Linear(8, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        m = torch.relu(self.msg(x))
        sums = torch.zeros(int(cluster.max()) + 1, m.shape[1], dtype=m.dtype).scatter_add_(
            0, cluster[:, None].expand_as(m), m
        )
        return self.out(sums)


class Graph(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool, self.head = Pool(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, cluster: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(x, cluster))


def test_the_module_that_sums_past_the_range_is_named_not_the_one_that_reads_the_sums() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = 40 * torch.randn(20000, 8, generator=g)
    cluster = torch.cat([torch.zeros(15000, dtype=torch.long), torch.randint(1, 500, (5000,), generator=g)])
    result = fpdoctor.compare(Graph().eval(), (x, cluster), candidate="fp16")
    assert result.first_divergent == "pool", str(result.report)
    out = next(r for r in result.rows if r.module == "pool.out")
    assert not out.diverged and out.unconfirmed is not None and "made upstream" in out.unconfirmed
