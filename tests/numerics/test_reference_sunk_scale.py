"""Gradients flushed to zero by a GradScaler whose own skips sank its scale below 1: the reference
step's finding does not tell a run that already scales its loss to scale its loss; it names the
overflows that sank the scale. Where no scaler scales the loss, it still says to scale it."""

from __future__ import annotations

from fpdoctor.numerics.training.reference import Comparison, Departure, finding


def _flushed(scale: float) -> Comparison:
    rows = [Departure(f"layer{i}.weight", "backward", 0.0, 0.0, 1.0, ref_absmax=1e-3) for i in range(3)]
    return Comparison(step=2921, rows={"backward": rows}, scale=scale)


def test_a_sunk_scale_is_not_told_to_scale_the_loss() -> None:
    found = finding(_flushed(1.49e-8), recipe="fp32 parameters, a GradScaler, autocast fp16", here={})
    assert found is not None
    assert found.fix.startswith("The GradScaler's scale has sunk to 1.49e-08"), found.fix
    assert "scale the loss (torch.amp.GradScaler)" not in found.fix


def test_without_a_scaler_the_flush_is_told_to_scale_the_loss() -> None:
    found = finding(_flushed(1.0), recipe="fp16 parameters", here={})
    assert found is not None and "scale the loss (torch.amp.GradScaler)" in found.fix, found.fix
