"""`fpdoctor watch` on pure fp16 training with Adam's default eps (1e-8, 0 in fp16): the first update
makes weights Inf. The steps after it were traced from those weights, and the report led with what the
trace found there ("a parameter already held Inf: check the data pipeline or the checkpoint"), ahead of
the cause the live line had named (NUM009). Weights already NaN/Inf are not traced from."""

from __future__ import annotations

from tests.conftest import report_of

SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
centers = torch.randn(6, 32) * 0.35
y = torch.randint(0, 6, (4096,))
x = (centers[y] + torch.randn(4096, 32)).half()
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 6)).half()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(20):
    idx = torch.randint(0, 4096, (64,))
    loss = F.cross_entropy(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_the_cause_of_weights_made_nonfinite_leads_and_no_trace_from_them_blames_the_data(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    names = [f["name"] for f in report["findings"]]
    assert names[0] == "fp16-adam-eps", names
    assert "nonfinite-input" not in names, names
