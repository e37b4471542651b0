"""An overflow's Inf made finite by a saturating op is harmless where the exact value saturates too:
the tanh-approximated GELU's x**3 overflows fp16 for |x| > 40, and tanh of the exact argument (some
thousands) is 1 in fp16 just as tanh(inf) is. trace re-runs the ops from the overflow to the tanh in
fp64 and reports no nonfinite-zeroed there; where the exact argument does not saturate (tanh of
1e-5 * x**3, about 1 for x near 50), the values are destroyed and it still does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import report_of

SCRIPT = """
import math
import torch
from torch import nn
torch.manual_seed(0)
def act(x):
    return ACT
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 64), nn.Linear(64, 4)
    def forward(self, x):
        return self.fc2(act(self.fc1(x)))
model = Block().half().eval()
x = (torch.randn(256, 16) * 40).half()  # pre-activations reach 50-150
with torch.no_grad():
    out = model(x)
print("finite", bool(torch.isfinite(out).all()))
"""
GELU = "0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))"
SQUASHED = "x * torch.tanh(1e-5 * x ** 3)"


def _trace(tmp_path: Path, script: Path) -> dict:
    return report_of(tmp_path, "trace", "--", str(script))


@pytest.mark.parametrize(("act", "destroyed"), [(GELU, False), (SQUASHED, True)])
def test_an_inf_made_finite_is_reported_only_where_the_exact_value_differs(tmp_path, act, destroyed):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT.replace("ACT", act))
    names = [f["name"] for f in _trace(tmp_path, script)["findings"]]
    assert ("nonfinite-zeroed" in names) is destroyed, names


def test_a_line_harmless_on_its_first_call_and_destroying_on_a_later_one_is_reported(tmp_path):
    """x * tanh(1e-5 * x ** 3) on 2000 first (tanh saturates anyway), then on 50 (tanh(1.25) = 0.85,
    fp16 gives 1): the later call decides for the line."""
    script = tmp_path / "twice.py"
    script.write_text(
        "import torch\n"
        "def act(x):\n"
        "    return x * torch.tanh(1e-5 * x ** 3)\n"
        "ya = act(torch.full((4, 8), 2000.0).half())\n"
        "yb = act(torch.full((4, 8), 50.0).half())\n"
        "print(float(yb[0, 0]))\n"
    )
    names = [f["name"] for f in _trace(tmp_path, script)["findings"]]
    assert "nonfinite-zeroed" in names, names


def test_a_gelu_reused_on_small_values_after_an_overflow_is_still_harmless(tmp_path):
    """The same activation on a layer whose x**3 overflows, then on small values: the second call
    reads no Inf of its own, and does not undo what the first was judged."""
    script = tmp_path / "reuse.py"
    script.write_text(
        SCRIPT.replace("ACT", GELU).replace(
            "return self.fc2(act(self.fc1(x)))", "return self.fc2(act(self.fc1(x) * 0.001) + act(self.fc1(x)))"
        )
    )
    names = [f["name"] for f in _trace(tmp_path, script)["findings"]]
    assert "nonfinite-zeroed" not in names, names
