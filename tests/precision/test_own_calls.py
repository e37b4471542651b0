"""The fp64 pass's own ops watched from torch functions (own_calls.OwnCalls): the same figures as
the dispatch mode watching every aten op (container_ops.OwnOps alone)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.compare import compare as steps
from fpdoctor.precision.compare import own_calls
from fpdoctor.precision.metrics import due


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
    monkeypatch.setattr(own_calls, "LONG", 10**9)  # every call watched, as the dispatch mode watches them
    monkeypatch.setattr(steps, "OwnCalls", lambda ops, **kw: made.append(own_calls.OwnCalls(ops, **kw)) or made[-1])
    watched = fpdoctor.compare(model, x, candidate="bf16")
    assert made and len(made[-1].plans) > 5  # calls learnt, and their repeats not dispatched
    root = next(r for r in watched.rows if r.module == "")
    assert root.own["judged"] > (10 if kind is MaskedLater else 20)
    monkeypatch.setattr(steps, "OwnCalls", lambda ops, **kw: ops)  # every aten op through the dispatch mode
    dispatched = fpdoctor.compare(model, x, candidate="bf16")
    assert _figures(watched) == _figures(dispatched)


class Gate(nn.Module):
    """A leaf of the user's own arithmetic: its ops are judged on each call."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x * 3.0) * x.exp()


class Long(nn.Module):
    """A loop of more than own_calls.LONG calls of its own, which calls a module of its own each step, and
    an op after it that loses more than any in the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.gate, self.head = nn.Linear(16, 16), Gate(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        state = torch.zeros_like(h[:, 0])
        outs = []
        for t in range(h.shape[1]):
            state = state * 0.95 + h[:, t].softmax(-1) * 0.05
            outs.append(self.gate(state).tanh())
        tail = (state + 300.0) - 300.0  # after the loop: the sum keeps few of the state's digits in bf16
        return self.head(torch.stack(outs, 1)) + tail.mean(-1, keepdim=True)[:, None]


def test_a_long_loop_is_watched_up_to_long_calls_and_what_it_calls_all_the_way():
    torch.manual_seed(0)
    model, x = Long().eval(), torch.randn(2, 1200, 16)
    made = []
    original = steps.OwnCalls
    steps.OwnCalls = lambda ops, **kw: made.append(original(ops, **kw)) or made[-1]
    try:
        watched = fpdoctor.compare(model, x, candidate="bf16")
        steps.OwnCalls = lambda ops, **kw: ops  # every call of the loop through the dispatch mode
        dispatched = fpdoctor.compare(model, x, candidate="bf16")
    finally:
        steps.OwnCalls = original
    assert made and made[-1].cut, "the loop passed LONG calls"
    assert "own ops of a long loop" in watched.report.data["not_checked"], watched.report.data["not_checked"]
    root, whole = (next(r for r in result.rows if r.module == "") for result in (watched, dispatched))
    assert root.own["judged"] < whole.own["judged"]  # its later calls were not watched
    # the worst op is the one after the loop, judged as without the cut
    assert (root.own["op"], root.own["location"]) == (whole.own["op"], whole.own["location"])
    assert root.own["op"] == "aten.sub.Tensor", root.own
    assert root.own["error_rel"] == pytest.approx(whole.own["error_rel"], rel=0.5)
    # the module it calls after the cut: watched on every call, as without it
    gates = [
        _figures(result)[k] for result in (watched, dispatched) for k, r in enumerate(result.rows) if r.module == "gate"
    ]
    assert len(gates) == 2 * 1200 and gates[:1200] == gates[1200:]


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


def test_a_forward_of_many_distinct_calls_is_watched_to_its_end(monkeypatch):
    """More than LONG calls, each from a line of its own (a deep model written as functions): no loop to cut."""
    lines = "".join(f"    x = x * {1 + k * 1e-4}\n" for k in range(own_calls.LONG + 100))
    namespace: dict = {}
    exec(compile(f"def forward(self, x):\n{lines}    return self.head(x)\n", "<unrolled>", "exec"), namespace)
    unrolled = type("Unrolled", (nn.Module,), {"forward": namespace["forward"]})
    model = unrolled()
    model.head = nn.Linear(16, 4)
    made = []
    monkeypatch.setattr(steps, "OwnCalls", lambda ops, **kw: made.append(own_calls.OwnCalls(ops, **kw)) or made[-1])
    result = fpdoctor.compare(model.eval(), torch.randn(8, 16), candidate="bf16")
    root = next(r for r in result.rows if r.module == "")
    # one op on one shape, judged on its first calls and every power of two of its count: to the last call
    assert not made[-1].cut and root.own["judged"] == sum(due(k) for k in range(own_calls.LONG + 100)), root.own
