"""The fp64 pass's own ops watched from torch functions (own_calls.OwnCalls): the same figures as
the dispatch mode watching every aten op (container_ops.OwnOps alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import compare as steps
from fpdoctor.precision.compare import own_calls


class Loop(nn.Module):
    """A running state over tokens in the container's own forward, with views and an index by a
    mask (its output's shape depends on the values) among its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, 16)
        h = self.proj(x)
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            state = state * 0.95 + h[:, t].softmax(-1)
            picked = state[state[:, 0] > 0] if t % 7 == 0 else state  # its shape depends on the values
            outs.append(state + picked.sum() * 1e-3)
        return self.head(torch.stack(outs, 1))


class Shrinking(nn.Module):
    """A running state whose rows drop to one after 40 tokens: the same call sites, new shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            rows = 2 if t < 40 else 1
            state = state[:rows] * 0.95 + h[:rows, t].softmax(-1)
            outs.append(state.sum(0))
        return self.head(torch.stack(outs, 0))


class MaskedLater(nn.Module):
    """A per-token loop whose attention gets a mask (a keyword) only from token 20 on: the same
    positional shapes at the same call site, other ops."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        k = h.unsqueeze(1)
        mask = torch.zeros(1, h.shape[1], dtype=torch.bool)
        mask[:, :5] = True
        outs = [
            nn.functional.scaled_dot_product_attention(h[:, None, t : t + 1], k, k, attn_mask=mask if t >= 20 else None)
            for t in range(h.shape[1])
        ]
        return torch.cat(outs, 2).sum(1)


def _figures(result: fpdoctor.CompareResult) -> list[tuple]:
    return [(r.module, r.call, r.propagated, r.isolated, r.floor, r.own) for r in result.rows]


@pytest.mark.parametrize("kind", [Loop, Shrinking, MaskedLater])
def test_the_function_level_watch_gives_the_dispatch_modes_figures(monkeypatch, kind):
    torch.manual_seed(0)
    model, x = (
        kind().eval(),
        torch.randn(2 if kind is not MaskedLater else 4, 300 if kind is not MaskedLater else 64, 16),
    )
    made = []
    monkeypatch.setattr(steps, "OwnCalls", lambda ops: made.append(own_calls.OwnCalls(ops)) or made[-1])
    watched = fpdoctor.compare(model, x, candidate="bf16")
    assert made and len(made[-1].plans) > 5  # calls learnt, and their repeats not dispatched
    root = next(r for r in watched.rows if r.module == "")
    assert root.own["judged"] > (10 if kind is MaskedLater else 20)
    monkeypatch.setattr(steps, "OwnCalls", lambda ops: ops)  # every aten op through the dispatch mode
    dispatched = fpdoctor.compare(model, x, candidate="bf16")
    assert _figures(watched) == _figures(dispatched)


def test_a_signature_tells_apart_what_changes_the_ops_and_leaves_out_an_index_position():
    a, b = torch.randn(3, 4), torch.randn(4, 3).t()
    sig = own_calls._signature
    assert sig(torch.add, (a, 1), {}) != sig(torch.add, (a, 1.0), {}) != sig(torch.add, (a, True), {})
    assert sig(torch.add, (a, a), {}) != sig(torch.add, (a, b), {})  # strides
    assert sig(torch.add, (a, a), {}) != sig(torch.add, (a, a.double()), {})
    assert sig(torch.add, (a, object()), {}) is None
    assert own_calls.basic_index((slice(None), 3, None, Ellipsis))
    assert not own_calls.basic_index((slice(None), torch.tensor([0, 1])))
    assert not own_calls.basic_index(True)
    assert own_calls._plan(["mm", "add", "mm", None]) == (("mm", 2), ("add", 1))  # nothing after nonzero
    assert own_calls._plan(["mm", None, "add"]) is None  # add's input shapes may change with the values
