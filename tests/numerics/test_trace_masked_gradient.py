"""The torch.where trap: an op whose gradient is infinite or 0/0 at a finite input (sqrt at 0, a norm
of a zero vector, acos at 1), whose value there a mask discards afterwards. The forward stays finite;
the mask's zero gradient goes through the op's backward, 0 x inf = NaN. The first finding names the
forward op on the user's line (not autograd's div) with the fix that keeps those inputs out of it,
and the fix as printed trains. Two forms: a uniformity loss's pairwise distances by a power 1/2, the
diagonal masked by a multiply; a contrastive loss's pairwise sqrt distances, the diagonal discarded
by torch.where."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import as_written_and_fixed, traced_script

SCRIPTS = {
    # a uniformity loss: every pair's distance by a power 1/2, the diagonal (0) masked by a multiply
    "pow": """
        import sys, torch, torch.nn as nn
        FIX = "--fix" in sys.argv
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(8):
            z = model(torch.randn(24, 16))
            d2 = ((z[:, None] - z[None]) ** 2).sum(-1)
            dist = d2.clamp_min(1e-12) ** 0.5 if FIX else d2 ** 0.5
            off = 1.0 - torch.eye(24)
            loss = (torch.exp(-dist) * off).sum() / off.sum()
            opt.zero_grad(); loss.backward(); opt.step()
        ok = all(torch.isfinite(p).all() for p in model.parameters())
        print("finite" if ok else "nan", file=sys.stderr)
    """,
    # a contrastive loss by hand: pairwise distances, the diagonal (0) discarded by torch.where
    "sqrt": """
        import sys, torch, torch.nn as nn
        FIX = "--fix" in sys.argv
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(8):
            emb = model(torch.randn(32, 16))
            labels = torch.randint(0, 3, (32,))
            eye = torch.eye(32, dtype=torch.bool)
            d2 = ((emb[:, None] - emb[None]) ** 2).sum(-1)
            dist = torch.sqrt(d2.clamp_min(1e-12)) if FIX else torch.sqrt(d2)
            dist = torch.where(eye, torch.zeros_like(dist), dist)
            same = (labels[:, None] == labels[None]) & ~eye
            loss = torch.where(same, dist, torch.relu(2.0 - dist)).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        ok = all(torch.isfinite(p).all() for p in model.parameters())
        print("finite" if ok else "nan", file=sys.stderr)
    """,
}
FORWARD = {"pow": ("aten.pow", "clamp_min(eps) ** p"), "sqrt": ("aten.sqrt", "clamp_min(eps)")}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_gradient_a_mask_cannot_stop_names_the_forward_op_and_its_fix_trains(name: str, tmp_path: Path) -> None:
    script, found = traced_script(tmp_path, name, SCRIPTS[name])
    first = found[0]
    op, words = FORWARD[name]
    assert first["name"] == "nonfinite-produced" and first["evidence"]["step"] == 1, first
    assert f"the backward of {op}" in first["message"] and f"the backward of {op}" in first["title"]
    assert "0 x inf = NaN" in first["fix"] and words in first["fix"], first["fix"]
    assert "guard the denominator" not in first["fix"]

    # the fix as printed: the plain script ends with NaN weights, the fixed one trains
    ran = as_written_and_fixed(script)
    assert ran == ["nan", "finite"], ran


def test_a_gradient_cast_back_past_its_range_is_told_by_the_cast_not_the_forward_op() -> None:
    """Under fp16 autocast a division's backward casts its fp32 gradient back to the fp16 input's
    dtype: an Inf there is the gradient's size (raw data, a tiny exp), not a zero denominator."""
    from fpdoctor.numerics.trace import blame
    from fpdoctor.numerics.trace.tracer import Record

    cast = Record(0, "aten._to_copy.default", "backward", None, 0, False, "DivBackward0", "aten.div.Tensor",
                  ("vae.py", 28, "loss_fn"), [])  # fmt: skip
    assert "guard the denominator" not in blame._advice(cast) and "cast" in blame._advice(cast)
    made = Record(0, "aten.div.Tensor", "backward", None, 0, False, "SqrtBackward0", "aten.sqrt.default",
                  ("loss.py", 15, "f"), [])  # fmt: skip
    assert "0 x inf = NaN" in blame._advice(made)
