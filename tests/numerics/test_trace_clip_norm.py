"""Pure fp16 training (model.half(), no GradScaler) with torch.nn.utils.clip_grad_norm_: the total
gradient norm passes fp16's 65504, so clipping multiplies every gradient by 1/inf = 0 and the loss
stops moving (trial77). The printed fix was "compute every op of the line in fp32 (its operands
.float() before it)": clip_grad_norm_ scales the gradients in place, so .float() copies would be
clipped and the gradients not. The fix is the norm taken in fp32 and the gradients scaled by it,
checked by the same experiment; written as printed, the run trains. Two recipes: a summed-MSE MLP
with SGD and momentum, and a conv denoiser with an MSE summed over every pixel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 32)).half()
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 3, 1)
    ).half()


def _batches(kind: str, steps: int):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if kind == "mlp":
            x = torch.randn(1024, 64, generator=g)
            yield x, torch.tanh(x[:, :32]) * 64  # the norm past 65504 at width 256 too
        else:  # a denoiser of 16 images, its loss summed over every pixel
            clean = torch.rand(16, 3, 16, 16, generator=g) * 4
            yield clean + 0.5 * torch.randn(16, 3, 16, 16, generator=g), clean


def _clip_in_fp32(model: nn.Module, max_norm: float) -> None:
    """The fix as printed."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))


def _train(kind: str, steps: int, *, fixed: bool = False, traced: bool = False):
    model = _model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=0.05 if kind == "mlp" else 0.01, momentum=0.9)
    loss_fn = nn.MSELoss(reduction="sum")
    losses = []
    trace = fpdoctor.Trace(model) if traced else None
    with trace if trace is not None else torch.enable_grad():
        for x, y in _batches(kind, steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x.half()).float(), y)
            loss.backward()
            if fixed:
                _clip_in_fp32(model, 1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss))
    return losses, (trace.report if trace is not None else None)


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_clip_grad_norm_past_fp16_is_fixed_by_a_norm_in_fp32_that_trains_as_printed(kind: str) -> None:
    losses, report = _train(kind, 20, traced=True)
    assert report is not None
    first = report.findings[0]
    assert first.fix.startswith("clip_grad_norm_ at "), (first.name, first.fix)
    assert "torch.linalg.vector_norm(g.float())" in first.fix and first.trial is not None and first.trial.tried
    assert ".float() before the first of them" not in first.fix  # no copy that would be clipped instead
    assert losses[-1] > 0.95 * losses[0], losses  # clipped to nothing: the loss does not move
    fixed, _ = _train(kind, 40, fixed=True)  # untraced: a longer run costs little
    assert fixed[-1] < 0.85 * losses[-1], (fixed, losses)


def test_updates_rounded_away_after_zeroed_gradients_are_told_as_their_consequence() -> None:
    """trial77: after clip_grad_norm_ zeroed the gradients (NUM008 at step 65), TRN010 at step 91 measured
    what the momentum left and was reported as a cause of its own; it now says it follows, fix first."""
    from fpdoctor import catalog
    from fpdoctor.numerics.api import _after_zeroed

    zeroed = catalog.make("nonfinite-zeroed", message="...", evidence={"step": 65})
    rounded = catalog.make(
        "update-rounded-away", message="Step 91: updates rounded away.", evidence={"kind": "rounded-away", "step": 91}
    )
    told = _after_zeroed(rounded, [zeroed])
    assert told.evidence["after_zeroed_step"] == 65 and told.fix.startswith("Fix nonfinite-zeroed first")
    before = catalog.make(
        "update-rounded-away", message="Step 9.", evidence={"kind": "rounded-away", "step": 9}, fix="masters"
    )
    assert _after_zeroed(before, [zeroed]) is before  # before the zeroing: a cause of its own
