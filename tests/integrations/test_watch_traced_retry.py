"""A loss that divides by a count that is 0 on some batches only: the watch replays the bad step,
finds the NaN made after the model, and traces the next step to name the op and its line; that next
batch is fine, so the steps after it are traced in turn until one makes the NaN again (at most
TRIES). The report then leads with the division at its line, the forward's NaN ahead of its
backward's Inf, and the replay's verdict carries its fix."""

from __future__ import annotations

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(4096, 12)
y = (x[:, 0] > 1.2).float()  # positives are rare
model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(40):
    if step % 6 == 3:
        idx = torch.nonzero(y == 0).squeeze(1)[step * 16 : step * 16 + 16]  # no positive in this batch
    else:
        idx = torch.randint(0, 4096, (64,))
    out = model(x[idx]).squeeze(-1)
    pos = y[idx]
    bce = F.binary_cross_entropy_with_logits(out, pos)
    recall = (torch.sigmoid(out) * pos).sum() / pos.sum()
    loss = bce + 0.1 * (1 - recall)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_next_bad_batch_is_traced_when_the_first_traced_step_was_fine(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    findings = report_of(tmp_path, "watch", "--", "python", str(script))["findings"]
    line = next(n for n, text in enumerate(SCRIPT.splitlines(), 1) if "/ pos.sum()" in text)
    first = findings[0]
    assert first["name"] == "nonfinite-produced" and first["where"]["phase"] == "forward", [
        (f["name"], f["title"][:80]) for f in findings
    ]
    assert f"train.py:{line}" in first["message"] and first["evidence"]["traced_step"] == 10, first["message"]
    verdict = next(f for f in findings if f["name"] == "deterministic-nonfinite")
    assert verdict["fix"].startswith("the step traced at step 10 names it"), verdict["fix"]
