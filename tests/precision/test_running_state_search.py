"""The running-state search (compare/passes.py `_Chains`) settles a loop's lines after their first
visits, so that each later call costs little: a line whose visits were all updates goes on counting,
one whose visits updated nothing is taken to go on so only after many more. A state carried only from
token 40 on (a warm-up before an average), and two lines that feed each other from token 5 on (a beam
search's scores), are still found: the first every update, the pair from its second visit that reads the same
partner line on."""

from __future__ import annotations

import torch

from fpdoctor.precision.compare.passes import _Chains

T = 200


def _states(f) -> dict[str, int]:  # type: ignore[no-untyped-def]
    chains = _Chains()
    chains.stack.append("")
    with chains:
        f()
    return {s["location"].rsplit(":", 1)[1]: s["steps"] for s in chains.states()}


def test_a_state_carried_from_a_later_token_and_two_lines_that_feed_each_other_are_found() -> None:
    torch.manual_seed(0)
    x, base = torch.randn(4, T, 8), torch.randn(4, 8)

    def late() -> torch.Tensor:
        acc = base
        for t in range(T):
            xt = x[:, t] * 2.0
            acc = (acc if t >= 40 else base) * 0.5 + xt  # warm-up: the state carried from token 40 on
        return acc

    def two_lines() -> torch.Tensor:
        scores = torch.zeros(4, 8)
        for t in range(T):
            cand = scores + x[:, t]
            scores = torch.tanh(cand if t >= 5 else base + x[:, t])
        return scores

    assert list(_states(late).values()) == [T - 40]
    # counted from the carry's second sighting of the same partner line
    assert sorted(_states(two_lines).values()) == [T - 6, T - 6]
