"""A gradient past fp16's range before any loss scale: under fp16 autocast the backward casts each
gradient to the dtype of the value it belongs to, and a regression on targets in large units (prices,
joules) makes gradients no scale fits. The first finding is the stalled scaler; its fix names the
gradient's cast (not a mask fill the user never wrote), says bf16 with its check and the targets'
units, and bf16 as printed trains. Two forms: a heteroscedastic NLL on raw prices (the gradient cast
by type promotion's backward), a summed MSE on raw energies (autocast's own cast to fp32). Its
forward twin: a module's input autocast casts to fp16 past its range (raw pressures in pascals), no
line's cast either: told as autocast's, with bf16 checked, never as a mask value to write."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_fpdoctor, run_python

HEAD = """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    BF16 = "--bf16" in sys.argv
    torch.manual_seed(0)
    dtype = torch.bfloat16 if BF16 else torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=not BF16)
    skipped = 0
"""
TAIL = """
        opt.zero_grad(set_to_none=True)
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.is_enabled() and scaler.get_scale() < before
    print(f"skipped {skipped}", file=sys.stderr)
"""
SCRIPTS = {
    # prices in thousands, not standardised: the log-variance's gradient is ~7e4 unscaled
    "prices": """
    net = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(10):
        x = torch.randn(128, 6)
        y = 3000 + 800 * x[:, :1]
        with torch.autocast("cpu", dtype=dtype):
            out = net(x)
            mu, logvar = out[:, :1], out[:, 1:]
            loss = ((y - mu) ** 2 / torch.exp(logvar) + logvar).mean()
    """,
    # energies in joules as the simulator writes them, a summed MSE (autocast runs mse_loss in fp32)
    "energies": """
    net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for step in range(10):
        x = torch.randn(64, 8)
        energy = 40000 + 5000 * x[:, :1]
        with torch.autocast("cpu", dtype=dtype):
            pred = net(x)
            loss = F.mse_loss(pred, energy, reduction="sum")
    """,
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_a_gradient_past_fp16s_range_is_told_by_its_cast_with_bf16_checked(name: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(HEAD) + textwrap.dedent(SCRIPTS[name]) + textwrap.dedent(TAIL))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    first = json.loads(report.read_text())["findings"][0]
    assert first["name"] == "grad-scaler-stalled", first
    fix = first["fix"]
    assert "gradient cast back" in fix and "standardise" in fix, fix
    assert "torch.autocast(device, dtype=torch.bfloat16) (checked" in fix, fix
    assert "mask fill" not in fix and "clamp the values" not in fix, fix
    assert first["fix_trial"]["status"] == "checked" and "bf16" in first["fix_trial"]["changed"], first["fix_trial"]

    # bf16 as printed: every fp16 step skipped, none in bf16
    runs = [run_python(str(script), *arm, timeout=120) for arm in ([], ["--bf16"])]
    assert [r.stderr.strip() for r in runs] == ["skipped 10", "skipped 0"], [r.stderr for r in runs]


PRESSURE = """
    net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for step in range(10):
        pressure = 101325.0 + 2000.0 * torch.randn(64, 4)  # pascals, as the sensor writes them
        target = (pressure.mean(-1, keepdim=True) - 101325.0) / 2000.0
        with torch.autocast("cpu", dtype=dtype):
            loss = F.mse_loss(net(pressure).float(), target)
"""


def test_a_modules_input_past_fp16s_range_is_told_as_autocasts_cast_with_bf16_checked(tmp_path: Path) -> None:
    script = tmp_path / "pressure.py"
    script.write_text(textwrap.dedent(HEAD) + textwrap.dedent(PRESSURE) + textwrap.dedent(TAIL))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    first = json.loads(report.read_text())["findings"][0]
    assert first["name"] == "grad-scaler-stalled", first
    fix = first["fix"]
    # the model's input as the batch holds it: the data's units are the cause, a rescale the fix (no re-run of
    # the step can judge a change of units); bf16 beside it, checked, and run as printed below
    assert fix.startswith("The values autocast casts to float16") and "are the data the model is fed" in fix, fix
    assert fix.index("standardise them") < fix.index("Autocast to bf16, which has fp32's range, also runs (checked"), (
        fix
    )
    assert "mask fill" not in fix and "Write the limit" not in fix, fix
    assert first["fix_trial"]["status"] == "not-tried" and "bf16 the step is finite" in first["fix_trial"]["reason"], (
        first["fix_trial"]
    )
    runs = [run_python(str(script), *arm, timeout=120) for arm in ([], ["--bf16"])]
    assert [r.stderr.strip() for r in runs] == ["skipped 10", "skipped 0"], [r.stderr for r in runs]


@pytest.mark.parametrize(
    ("line", "written"),
    [
        ("loss = F.mse_loss(net(pressure).float(), target)", False),  # a widening cast of the output
        ("s, t = self.net(xm).chunk(2, -1)", False),
        ("z = net(x.to(device))", False),
        ("x = pressure.type_as(w)", True),
        ("y = x.to(w)", True),
        ("y = x.to(torch.float16)", True),
        ("h = a.half()", True),
        ("t = torch.zeros(3, dtype=torch.float16)", True),
        # a move to a device, however it is named, is no cast: autocast's casts on such a line are autocast's
        ("logits = model(x[idx].to(args.device, non_blocking=True))", False),
        ("y = x.to(local_rank)", False),
        ("y = x.to(accelerator.device)", False),
        ("m = copy.deepcopy(model).to(dt)", True),
    ],
)
def test_a_cast_the_line_writes_is_the_users_and_one_it_does_not_is_autocasts(line: str, written: bool) -> None:
    from fpdoctor.numerics.engine.reruns import _CAST_WRITTEN

    assert bool(_CAST_WRITTEN.search(line)) is written


RETRIEVAL = """
    import sys, torch, torch.nn as nn, torch.nn.functional as F
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    users, items = nn.Embedding(500, 64), nn.Embedding(2000, 64)
    opt = torch.optim.Adam([*users.parameters(), *items.parameters()], lr=3e-3)
    scaler = torch.amp.GradScaler("cpu")
    temperature, finite = 0.005, True
    for step in range(8):
        u, i = torch.randint(0, 500, (128,)), torch.randint(0, 2000, (128,))
        with torch.autocast("cpu", dtype=torch.float16):
            ue, ie = users(u) * 4, items(i) * 4
            logits = (ue @ ie.T).float() / temperature if FIX else ue @ ie.T / temperature
            loss = F.cross_entropy(logits, torch.arange(128))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        finite = finite and bool(torch.isfinite(loss))
    print("finite" if finite else "nan", file=sys.stderr)
"""


def test_an_op_on_a_line_with_a_matmul_under_autocast_is_told_how_float_survives_autocast(tmp_path: Path) -> None:
    """`.float()` on a matmul's operands does nothing under autocast (it casts them back): the fix says
    to take .float() of the product, or to run the line with autocast off; as printed, it trains."""
    script = tmp_path / "retrieval.py"
    script.write_text(textwrap.dedent(RETRIEVAL))
    report = tmp_path / "report.json"
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script))
    assert result.code == 1, result.err
    first = json.loads(report.read_text())["findings"][0]
    assert "((a @ b).float())" in first["fix"] and "enabled=False" in first["fix"], first["fix"]
    runs = [run_python(str(script), *arm, timeout=120) for arm in ([], ["--fix"])]
    assert [r.stderr.strip() for r in runs] == ["nan", "finite"], [r.stderr for r in runs]


WIDENED = """
import torch
from torch import nn
import torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 784), nn.Sigmoid())
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu")
for step in range(24):
    x, z = torch.rand(256, 784), torch.randn(256, 32)
    with torch.autocast("cpu", dtype=torch.float16):
        recon = model(z)
    loss = F.binary_cross_entropy(recon.float(), x, reduction="sum") * 1e5  # CAST
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
"""


def test_the_gradient_cast_back_by_a_widening_cast_is_named_at_the_casts_line_not_the_backwards(tmp_path: Path) -> None:
    """recon.float() before the loss: its backward casts the gradient back to fp16, past its range; the
    fix names that line (it named the line of the backward() call)."""
    script = tmp_path / "vae.py"
    script.write_text(WIDENED)
    cast = next(i for i, line in enumerate(WIDENED.splitlines(), 1) if line.endswith("# CAST"))
    report = tmp_path / "report.json"
    run_fpdoctor("trace", "-o", str(report), "--", str(script))
    first = json.loads(report.read_text())["findings"][0]
    assert first["name"] == "grad-scaler-stalled", first
    assert first["fix"].startswith("The gradient cast back at ") and f"vae.py:{cast} to float16" in first["fix"], first[
        "fix"
    ]
