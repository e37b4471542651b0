"""Non-finite values no precision cures, told by what makes them, with a fix that applies: a negative
power of a count that is 0 (a GCN's deg ** -0.5 at an isolated node), and a CTC loss over an input too
short for its transcript (log 0). Each fix as printed trains."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import as_written_and_fixed, traced_script

SCRIPTS = {
    "gcn": """
        import sys, torch, torch.nn as nn
        FIX = "--fix" in sys.argv
        torch.manual_seed(0)
        n, edges = 60, torch.randint(0, 40, (2, 150))  # nodes 40-59 have no edge
        x, y = torch.randn(n, 8), torch.randint(0, 3, (n,))
        lin = nn.Linear(8, 3)
        opt = torch.optim.SGD(lin.parameters(), lr=0.1)
        for step in range(5):
            deg = torch.zeros(n).index_add_(0, edges[0], torch.ones(edges.shape[1]))
            dinv = (deg ** -0.5).masked_fill(deg == 0, 0.0) if FIX else deg ** -0.5
            w = dinv[edges[0]] * dinv[edges[1]]
            h = torch.zeros(n, 8).index_add_(0, edges[1], x[edges[0]] * w[:, None])
            loss = nn.functional.cross_entropy(lin(h + x * dinv[:, None]), y)
            opt.zero_grad(); loss.backward(); opt.step()
        print("finite" if all(torch.isfinite(p).all() for p in lin.parameters()) else "nan", file=sys.stderr)
    """,
    "ctc": """
        import sys, torch, torch.nn as nn, torch.nn.functional as F
        FIX = "--fix" in sys.argv
        torch.manual_seed(0)
        model = nn.Linear(16, 6)  # 5 labels and the blank
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        frames = torch.randn(10, 4, 16)  # 10 frames for each of 4 utterances
        targets = torch.randint(1, 6, (4, 14))
        target_lengths = torch.tensor([6, 8, 14, 5])  # the third cannot fit in 10 frames
        for step in range(5):
            logp = model(frames).log_softmax(-1)
            loss = F.ctc_loss(logp, targets, torch.full((4,), 10), target_lengths, zero_infinity=FIX)
            opt.zero_grad(); loss.backward(); opt.step()
        print("finite" if all(torch.isfinite(p).all() for p in model.parameters()) else "nan", file=sys.stderr)
    """,
}
WORDS = {"gcn": "x ** p with p < 0 is Inf at x = 0", "ctc": "zero_infinity=True"}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_non_finite_value_of_the_math_gets_a_fix_that_applies_and_trains(name: str, tmp_path: Path) -> None:
    script, found = traced_script(tmp_path, name, SCRIPTS[name])
    fixes = [f["fix"] for f in found if f["severity"] == "error"]
    assert any(WORDS[name] in fix for fix in fixes[:2]), fixes[:2]
    ran = as_written_and_fixed(script)
    assert ran == ["nan", "finite"], ran
