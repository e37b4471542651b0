"""`fpdoctor watch` on a forward that returns an output its loss does not read (a discrete autoencoder's
logits beside its reconstruction): no gradient reaches that output, and the reference step replays the
backward from the others, where it once said "not compared" with a guess at torch.autograd.grad."""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
x = torch.randn(512, 16)


class AE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.dec = nn.Linear(16, 8), nn.Linear(8, 16)

    def forward(self, x):
        z = self.enc(x)
        return self.dec(torch.tanh(z)), z.view(-1, 2, 4)  # the codes' logits, returned for logging


model = AE()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(12):
    idx = torch.randint(0, 512, (64,))
    recon, logits = model(x[idx])
    loss = F.mse_loss(recon, x[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_an_output_the_loss_does_not_read_leaves_the_reference_step_judged(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    report = report_of(tmp_path, "watch", "--", "python", str(script))
    reference = report["data"]["reference_step"]
    assert 1 in reference["compared_steps"] and not reference["not_compared"], reference
    assert report["verdict"] == "ok", report["findings"]
