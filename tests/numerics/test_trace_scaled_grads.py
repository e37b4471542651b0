"""Gradients of a scaled loss read as they are (numerics/trace/scaled_grads.py): a GAN's R1 penalty
under fp16 autocast and GradScaler, its gradients taken of scaler.scale(d_real.sum()) with
create_graph=True. Without torch's recipe (multiply them by 1 / scaler.get_scale()) the penalty holds
the scale squared, the scaler backs off to a scale of a few dozen, and the run looks calibrated. The
trace names the autograd.grad line first; the recipe's unscaling, applied as printed, gets no finding
and a scale that stays high."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_fpdoctor, run_python

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    FIX = "--fix" in sys.argv
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(4, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    G = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.0, 0.99))
    scaler = torch.amp.GradScaler("cpu")
    for step in range(12):
        real = torch.randn(64, 4).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16):
            fake = G(torch.randn(64, 8)).detach()
            d_real = D(real)
        (grads,) = torch.autograd.grad(scaler.scale(d_real.sum()), real, create_graph=True)
        if FIX:
            inv_scale = 1.0 / scaler.get_scale()
            grads = grads * inv_scale
        r1 = 5.0 * grads.pow(2).sum(1).mean()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.softplus(D(fake)).mean() + nn.functional.softplus(-d_real).mean() + r1
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    print(scaler.get_scale(), file=sys.stderr)
    """
)


@pytest.mark.parametrize("fixed", [False, True], ids=["read scaled", "unscaled as printed"])
def test_a_penalty_on_gradients_of_a_scaled_loss_is_named_and_the_recipe_clears_it(fixed: bool, tmp_path: Path) -> None:
    script = tmp_path / "r1.py"
    script.write_text(SCRIPT)
    report = tmp_path / "report.json"
    args = ["--fix"] if fixed else []
    result = run_fpdoctor("trace", "-o", str(report), "--", str(script), *args)
    findings = json.loads(report.read_text())["findings"] if report.exists() else []
    names = [f["name"] for f in findings]
    if fixed:
        assert "gradients-still-scaled" not in names, names
        return
    assert result.code == 1, result.err
    first = findings[0]
    assert first["name"] == "gradients-still-scaled", names
    assert first["evidence"]["location"].endswith(":14") and first["evidence"]["read_by"].startswith("pow at ")
    assert "1.0 / scaler.get_scale()" in first["fix"]
    # the scaler's skips are that penalty's: never "calibration, nothing to do" beside it
    skipped = [f for f in findings if f["name"] == "grad-scaler-calibrated"]
    assert skipped, names
    for skips in skipped:
        assert "calibrating" not in skips["title"] and "Nothing to do" not in skips["fix"], skips
        assert skips["fix"].startswith(f"Unscale those gradients as {first['code']} says")

    # as printed, the scale stays where the gradients fit; read scaled, it collapses
    runs = [run_python(str(script), *fix, timeout=120) for fix in ([], ["--fix"])]
    plain, unscaled = (float(r.stderr.strip().splitlines()[-1]) for r in runs)
    assert plain * 64 <= unscaled, (plain, unscaled)


# a WGAN-GP critic, written another way: the gradient taken out of the tuple ([0]) by a call over two
# lines, the scaler named for its network; the unscaling statement goes where the fix says
GP = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optD = torch.optim.Adam(D.parameters(), lr=2e-4, betas=(0.5, 0.9))
    scalerD = torch.amp.GradScaler("cpu")
    for it in range(10):
        real, fake = torch.randn(128, 2) + 2.0, torch.randn(128, 2)
        eps = torch.rand(128, 1)
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16):
            d_real, d_fake, d_hat = D(real).mean(), D(fake).mean(), D(x_hat)
        grads = torch.autograd.grad(outputs=scalerD.scale(d_hat.sum()), inputs=x_hat,
                                    create_graph=True)[0]
        gp = 10.0 * ((grads.norm(2, dim=1) - 1) ** 2).mean()
        optD.zero_grad(set_to_none=True)
        scalerD.scale(d_fake - d_real + gp).backward()
        scalerD.step(optD)
        scalerD.update()
    print(scalerD.get_scale(), file=sys.stderr)
    """
)


def test_watch_names_the_scaled_penalty_first_with_the_unscaling_in_the_scripts_own_names(tmp_path: Path) -> None:
    """watch traces the step after one its replay could not explain as trace does: the penalty read
    scaled leads (not the fp16 cast it overflows, whose bf16 fix left the penalty scaled), and its
    statement, pasted as printed, clears it."""
    script = tmp_path / "gp.py"
    script.write_text(GP)
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", sys.executable, str(script))
    assert result.code == 0, result.err  # the script's own exit status
    first = json.loads(report.read_text())["findings"][0]
    assert first["name"] == "gradients-still-scaled", first
    fix = first["fix"]
    assert "inv_scale = 1.0 / scalerD.get_scale(); grads = grads * inv_scale," in fix, fix
    statements = fix.split("does: ", 1)[1].split(", then", 1)[0]
    after = int(fix.split("right after line ", 1)[1].split(",", 1)[0])  # the call spans two lines: its last
    lines = GP.splitlines()
    assert "create_graph=True)[0]" in lines[after - 1], lines[after - 1]
    fixed = tmp_path / "gp_fixed.py"
    start = next(line for line in lines if "grads = torch.autograd.grad" in line)
    indent = start[: len(start) - len(start.lstrip())]  # the statement's own indentation, as a user pastes it
    fixed.write_text("\n".join([*lines[:after], indent + statements, *lines[after:]]) + "\n")  # where it says
    runs = [run_python(str(p), timeout=120) for p in (script, fixed)]
    plain, unscaled = (float(r.stderr.strip().splitlines()[-1]) for r in runs)
    assert plain * 64 <= unscaled, (plain, unscaled)  # as printed, the scale stays where the gradients fit
    again = run_fpdoctor("watch", "-o", str(report), "--", sys.executable, str(fixed))
    assert again.code == 0, again.err
    # torch's own recipe: its first scales overflow the penalty's gradients (the scaler's calibration, as
    # trace says), and no reference step redoes a loss that reads gradients: no finding at all
    fixed_report = json.loads(report.read_text())
    assert fixed_report["verdict"] == "ok", [(f["name"], f["message"][:120]) for f in fixed_report["findings"]]
    assert "a gradient penalty" in json.dumps(fixed_report["data"])  # the OK says why no reference step ran


# a GAN whose generator steps after its critic: after the critic's bad step, the generator's forward
# (which reads the critic too) comes first; the traced step must reach the critic's own loss code
TWO = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    torch.manual_seed(0)
    D = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 1))
    G = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 2))
    opt_d, opt_g = torch.optim.Adam(D.parameters(), 2e-4), torch.optim.Adam(G.parameters(), 2e-4)
    scaler = torch.amp.GradScaler("cpu")
    for it in range(8):
        real = (torch.randn(128, 2) + 2.0).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16):
            d_real = D(real)
        gx, = torch.autograd.grad(scaler.scale(d_real.sum()), real, create_graph=True)
        r1 = gx.pow(2).sum(1).mean()
        opt_d.zero_grad(set_to_none=True)
        scaler.scale(nn.functional.softplus(-d_real).mean() + 5.0 * r1).backward()
        scaler.step(opt_d)
        with torch.autocast("cpu", dtype=torch.float16):
            loss_g = nn.functional.softplus(-D(G(torch.randn(128, 4)))).mean()
        opt_g.zero_grad(set_to_none=True)
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
    """
)


def test_watch_traces_the_bad_optimizers_own_step_with_two_optimizers(tmp_path: Path) -> None:
    script = tmp_path / "gan.py"
    script.write_text(TWO)
    report = tmp_path / "report.json"
    result = run_fpdoctor("watch", "-o", str(report), "--", sys.executable, str(script))
    assert result.code == 0, result.err
    found = json.loads(report.read_text())
    first = found["findings"][0]
    assert first["name"] == "gradients-still-scaled", [f["name"] for f in found["findings"]]
    assert "gx = gx * inv_scale" in first["fix"], first["fix"]


@pytest.mark.parametrize("unscaled", [True, False], ids=["torch's recipe", "read scaled"])
def test_the_sentinel_tells_the_scalers_calibration_from_a_penalty_read_scaled(unscaled: bool) -> None:
    """The sentinel replays step_fn, loss code and all, under trace: where the penalty was unscaled as
    torch's recipe does, the first scale's overflow is the scaler's calibration and nothing is said;
    read scaled, NUM023 leads."""
    import torch
    from torch import nn

    import fpdoctor

    torch.manual_seed(0)
    critic = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.9))
    scaler = torch.amp.GradScaler("cpu")
    guard = fpdoctor.Sentinel(critic, opt)

    def step_fn(real: torch.Tensor, fake: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        x_hat = (eps * real + (1 - eps) * fake).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.float16):
            d_real, d_fake, d_hat = critic(real).mean(), critic(fake).mean(), critic(x_hat)
        (grads,) = torch.autograd.grad(scaler.scale(d_hat.sum()), x_hat, create_graph=True)
        if unscaled:
            grads = grads * (1.0 / scaler.get_scale())
        loss = d_fake - d_real + 10.0 * ((grads.norm(2, dim=1) - 1) ** 2).mean()
        scaler.scale(loss).backward()
        return loss

    g = torch.Generator().manual_seed(1)
    for _ in range(8):
        opt.zero_grad(set_to_none=True)
        guard.step(step_fn, torch.randn(128, 2, generator=g) + 2.0, torch.randn(128, 2, generator=g),
                   torch.rand(128, 1, generator=g))  # fmt: skip
    names = [f.name for f in guard.report.findings]
    if unscaled:
        assert guard.report.verdict == "ok", names
    else:
        assert names[0] == "gradients-still-scaled", names
