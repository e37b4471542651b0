"""`fpdoctor watch` on two recipes that train silently less (before: OK, no findings):
- part of the forward run without gradients (TRN028): a projection computed under torch.inference_mode()
  "for the metrics", or detached before the head, while the optimizer holds it; it never trains. The
  line that stops the gradients is named; the fix as printed trains it. A backbone frozen with
  requires_grad_(False), or left out of the optimizer, is no finding.
- an adaptive optimizer whose eps dominates its denominator (TRN027): AdamW(eps=0.1) for 1e-8 takes a
  tiny share of its step. The default eps is no finding."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import report_of, run_python

# a two-tower scorer: a projection of the query, a head over it; fp16 autocast + GradScaler
SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F

class Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 48))
        self.head = nn.Linear(48, 4)

    def features(self, q):
        FEATURES

    def forward(self, q):
        return self.head(F.gelu(self.features(q)))

torch.manual_seed(0)
q = torch.randn(1024, 24)
y = (q[:, :3].sum(1) * 1.5).round().clamp(-1, 2).long() + 1
net = Scorer()
FREEZE
opt = OPTIMIZER
scaler = torch.amp.GradScaler("cpu")
for step in range(60):
    idx = torch.randint(0, 1024, (64,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(net(q[idx]), y[idx])
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
with torch.no_grad():
    print(float(F.cross_entropy(net(q), y)))
"""
PLAIN = "return self.proj(q)"
ADAMW = "torch.optim.AdamW(net.parameters(), lr=3e-3)"


def _script(tmp_path: Path, features: str = PLAIN, optimizer: str = ADAMW, freeze: str = "") -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.replace("FEATURES", features).replace("OPTIMIZER", optimizer).replace("FREEZE", freeze))
    return path


def _named(report: dict, name: str) -> list[dict]:
    return [f for f in report["findings"] if f["name"] == name]


@pytest.mark.parametrize(
    "features",
    ["with torch.inference_mode():\n            return self.proj(q).clone()", "return self.proj(q).detach()"],
    ids=["inference_mode", "detach"],
)
def test_a_projection_run_without_gradients_is_named_with_its_line_and_the_fix_trains(
    tmp_path: Path, features: str
) -> None:
    path = _script(tmp_path, features)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    (found,) = _named(report, "parameters-without-gradient")
    assert found["evidence"]["modules"] == ["proj"] and found["evidence"]["steps"] == [1, 12, 24]
    line = 1 + path.read_text().splitlines().index(features.splitlines()[0].join(["        ", ""]))
    assert f"at line {line} of {path}" in found["fix"] and "net.proj.requires_grad_(False)" in found["fix"]
    stuck = float(run_python(str(path), check=True).stdout)
    fixed = _script(tmp_path)  # as printed: the projection's forward with gradients
    again = report_of(tmp_path, "watch", "--", "python", str(fixed))
    assert not _named(again, "parameters-without-gradient") and again["verdict"] == "ok", again["findings"]
    assert float(run_python(str(fixed), check=True).stdout) < 0.9 * stuck


def test_a_backbone_frozen_on_purpose_or_left_out_is_no_finding(tmp_path: Path) -> None:
    for freeze, optimizer in (
        ("net.proj.requires_grad_(False)", ADAMW),
        ("", "torch.optim.AdamW(net.head.parameters(), lr=3e-3)"),
    ):
        report = report_of(
            tmp_path, "watch", "--", "python", str(_script(tmp_path, optimizer=optimizer, freeze=freeze))
        )
        assert not _named(report, "parameters-without-gradient"), (freeze, optimizer, report["findings"])


def test_an_eps_that_dominates_adams_denominator_is_named_and_the_default_is_not(tmp_path: Path) -> None:
    path = _script(tmp_path, optimizer="torch.optim.AdamW(net.parameters(), lr=3e-3, eps=0.1)")
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    (found,) = _named(report, "optimizer-eps-too-large")
    assert found["evidence"]["eps"] == 0.1 and found["evidence"]["share"] < 0.1, found["evidence"]
    assert "set eps=1e-8" in found["fix"]
    slow = float(run_python(str(path), check=True).stdout)
    fixed = _script(tmp_path, optimizer="torch.optim.AdamW(net.parameters(), lr=3e-3, eps=1e-8)")  # as printed
    again = report_of(tmp_path, "watch", "--", "python", str(fixed))
    assert not _named(again, "optimizer-eps-too-large") and again["verdict"] == "ok", again["findings"]
    assert float(run_python(str(fixed), check=True).stdout) < 0.9 * slow


def test_heads_taken_in_turn_and_an_output_the_loss_does_not_read_are_no_finding(tmp_path: Path) -> None:
    """Two heads alternating every step (each has a gradient at one of the sampled steps), and a pooled
    output the loss does not read (no line stops its gradients: an encoder's pooler beside the hidden
    states)."""
    script = """
import torch
from torch import nn
import torch.nn.functional as F

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(10, 20)
        self.pooler = nn.Linear(20, 20)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return h, self.pooler(h.mean(0, keepdim=True))

torch.manual_seed(0)
enc = Encoder()
heads = nn.ModuleDict({"a": nn.Linear(20, 2), "b": nn.Linear(20, 1)})
params = [*enc.parameters(), *heads.parameters()]
opt = torch.optim.AdamW(params, lr=1e-3)
for step in range(40):
    x = torch.randn(16, 10)
    hidden, _ = enc(x)
    if step % 2:
        loss = F.cross_entropy(heads["a"](hidden), torch.randint(0, 2, (16,)))
    else:
        loss = F.mse_loss(heads["b"](hidden), torch.randn(16, 1))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
    path = tmp_path / "multi.py"
    path.write_text(script)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not _named(report, "parameters-without-gradient"), report["findings"]
