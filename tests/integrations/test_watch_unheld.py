"""`fpdoctor watch` on an optimizer built before a layer was replaced (TRN025): it steps the old
layer's tensors, which no forward uses, while the new layer gets a gradient every step and never
moves; nothing is NaN (before: OK). An optimizer over part of the model on purpose (a linear probe
that leaves a trainable backbone out) and a GAN's two optimizers are no finding; the fix as printed
(the optimizer built after the replacement) trains and is OK."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.conftest import report_of, run_python

# a pretrained conv encoder whose classifier is re-made for a new task under bf16 autocast
SCRIPT = """
import torch
from torch import nn
import torch.nn.functional as F

class Net(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, 8, 5, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(4), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return self.classifier(self.features(x))

torch.manual_seed(0)
x = torch.randn(512, 1, 32)
y = (x[:, 0, :8].mean(1) > 0).long() + (x[:, 0, 8:16].mean(1) > 0).long()
net = Net(10)
optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
net.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))
losses = []
for step in range(60):
    idx = torch.randint(0, 512, (64,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(net(x[idx]), y[idx])
    optim.zero_grad()
    loss.backward()
    optim.step()
    losses.append(loss.item())
print(json.dumps([sum(losses[:10]) / 10, sum(losses[-10:]) / 10]))
""".replace("import torch\n", "import json\nimport torch\n", 1)

OPTIMIZER = "optim = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)\n"


def _losses(path: Path) -> list[float]:
    out = run_python(str(path), check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_an_optimizer_built_before_the_classifier_was_replaced_is_named_and_its_fix_trains(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    first = report["findings"][0]
    assert first["name"] == "parameters-outside-optimizer", [f["name"] for f in report["findings"]]
    assert first["evidence"]["missing"] == [f"classifier.{i}.{w}" for i in (0, 2) for w in ("weight", "bias")]
    assert first["evidence"]["orphans"] == [[32, 32], [32], [10, 32], [10]]
    line = 1 + SCRIPT.splitlines().index(
        "net.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))"
    )
    assert f"(line {line} of {path}: `net.classifier = " in first["fix"], first["fix"]
    assert "optim.add_param_group({'params': net.classifier.parameters()})" in first["fix"]
    flat = _losses(path)
    # as printed: the optimizer's line moved after the line that replaces `classifier`
    moved = SCRIPT.replace(OPTIMIZER, "").replace("losses = []\n", OPTIMIZER + "losses = []\n")
    assert re.search(r"net.classifier = .*\noptim = ", moved)
    path.write_text(moved)
    fixed = report_of(tmp_path, "watch", "--", "python", str(path))
    assert fixed["verdict"] == "ok", [f["name"] for f in fixed["findings"]]
    trained = _losses(path)
    assert trained[1] < 0.8 * flat[1], (flat, trained)  # the new classifier learns


def test_an_optimizer_over_part_of_the_model_and_two_optimizers_of_a_gan_are_no_finding(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    # a linear probe by leaving the backbone out: it gets gradients, on purpose held by no optimizer
    probe = SCRIPT.replace(OPTIMIZER, "").replace(
        "losses = []\n", "optim = torch.optim.SGD(net.classifier.parameters(), lr=0.1, momentum=0.9)\nlosses = []\n"
    )
    path.write_text(probe)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not [f for f in report["findings"] if f["name"] == "parameters-outside-optimizer"]
    gan = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
bce = nn.BCEWithLogitsLoss()
for step in range(30):
    real = torch.randn(32, 2) + 3
    fake = G(torch.randn(32, 4))
    # the discriminator's loss reaches G too (fake not detached): G's gradients are G's optimizer's
    d_loss = bce(D(real), torch.ones(32, 1)) + bce(D(fake), torch.zeros(32, 1))
    opt_d.zero_grad(); opt_g.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = bce(D(G(torch.randn(32, 4))), torch.ones(32, 1))
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
"""
    path.write_text(gan)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not [f for f in report["findings"] if f["name"] == "parameters-outside-optimizer"], report["findings"]


def test_heads_taken_in_turn_over_a_backbone_left_out_are_no_finding(tmp_path: Path) -> None:
    """A probe of three heads called one a step over a backbone the optimizer leaves out: the heads not
    called this step are still the ModuleList's, not tensors left behind by a replacement."""
    script = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(12, 24), nn.ReLU())
heads = nn.ModuleList(nn.Linear(24, 3) for _ in range(3))
opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
for step in range(30):
    x = torch.randn(16, 12)
    loss = F.cross_entropy(heads[step % 3](encoder(x)), torch.randint(0, 3, (16,)))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
    path = tmp_path / "probe.py"
    path.write_text(script)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    assert not [f for f in report["findings"] if f["name"] == "parameters-outside-optimizer"], report["findings"]


def test_an_item_of_a_sequential_replaced_after_the_optimizer_is_named_by_its_index(tmp_path: Path) -> None:
    replaced = SCRIPT.replace(
        "net.classifier = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))",
        "net.classifier[2] = nn.Linear(32, 3)",
    )
    path = tmp_path / "train.py"
    path.write_text(replaced)
    report = report_of(tmp_path, "watch", "--", "python", str(path))
    (found,) = [f for f in report["findings"] if f["name"] == "parameters-outside-optimizer"]
    assert found["evidence"]["missing"] == ["classifier.2.weight", "classifier.2.bias"]
    assert "replaces `classifier[2]`" in found["fix"] and "`net.classifier[2] = nn.Linear(32, 3)`" in found["fix"]
    # the part it lacks, not the whole classifier (add_param_group refuses a parameter held twice)
    assert "optim.add_param_group({'params': net.classifier[2].parameters()})" in found["fix"]
