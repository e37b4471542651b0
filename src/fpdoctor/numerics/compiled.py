"""A bad step of a compiled model: seen in the compiled program, or only in its eager re-run.

The step check (loss and gradient flags) reads what the compiled program computed; a replay runs
under `trace`, where compiled code runs eagerly (the ops are the model's own, not the fused
kernels). So every finding says where it was seen (`evidence.seen_in`): "compiled" or "eager
replay". When the eager replay is finite, the step is run once more compiled, as it ran (same
batch, RNG state and weights; the graphs already compiled for these shapes, so nothing is
recompiled): non-finite again means the compiled program makes NaN/Inf that the model's eager
math does not (`compiled-only-nonfinite`); finite means the fault followed the run's history,
as for an eager model (`transient-fault-suspected`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.gradcheck import grads_of, loss_flag, nonfinite_flag
from fpdoctor.numerics.replay import MicroBatch, OutputsOnly
from fpdoctor.preserve import preserved
from fpdoctor.report.model import Finding

COMPILED = "compiled"
EAGER_REPLAY = "eager replay"
EAGER = "eager"  # under trace: compiled code ran eagerly, in place of the compiled program
# what the step check itself saw: the compiled program's loss and gradients
_SEEN_BY_THE_CHECK = ("nonfinite-loss", "nonfinite-gradient", "loss-spike", "transient-fault-suspected")


def seen_in(found: Sequence[Finding], where: str, names: Sequence[str] | None = None) -> list[Finding]:
    """`found` with evidence.seen_in = `where` (those named in `names` only, when given)."""
    return [
        replace(f, evidence={**f.evidence, "seen_in": where}) if names is None or f.name in names else f for f in found
    ]


def label_step_findings(found: Sequence[Finding]) -> list[Finding]:
    """A compiled model's step findings: those of the step check were seen in the compiled program."""
    names = [f.name for f in found if "seen_in" not in f.evidence and f.name in _SEEN_BY_THE_CHECK]
    return seen_in(found, COMPILED, names)


def rerun_compiled(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
) -> tuple[bool, float]:
    """The window run again as it ran, compiled and untraced: (non-finite, the loss). Gradients
    and buffers are put back by the caller and `preserved`; nothing reaches the weights."""
    loss_value = math.nan
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            stack.enter_context(preserved(model))
            for micro in window:
                for p in params:
                    p.grad = None
                micro.rng.restore()
                loss = step_fn(*micro.args, **micro.kwargs)
                device = params[0].device if params else torch.device("cpu")
                unseen = loss is None or isinstance(loss, OutputsOnly)
                bad_outputs = isinstance(loss, OutputsOnly) and not loss.finite
                seen = torch.as_tensor(math.nan if bad_outputs else 0.0) if unseen else torch.as_tensor(loss)
                flags = torch.stack([loss_flag(seen, device), nonfinite_flag(grads_of(params), device)])
                loss_bad, grad_bad = flags.tolist()
                loss_value = math.nan if unseen else float(seen.detach().float().mean())
                if loss_bad or grad_bad:
                    return True, loss_value
    finally:
        for p in params:
            p.grad = None
    return False, loss_value


def compiled_only_finding(
    step: int, kind: str | None, eager_loss: float, compiled_loss: float, here: dict[str, Any]
) -> Finding:
    """The compiled step is non-finite twice; the same step run eagerly is finite."""
    return catalog.make(
        "compiled-only-nonfinite",
        message=(
            f"Step {step} was non-finite in the compiled program, and again when run compiled a second time with "
            "the same batch, RNG state and weights; run eagerly under trace it was finite"
            + (f" (loss {eager_loss:.4g})" if math.isfinite(eager_loss) else "")
            + ": the compiled kernels compute something the model's eager ops do not (a fusion, a decomposition, "
            "a lowering or a reduction in lower precision)."
        ),
        where={"module": None, "op": None, "phase": None, "step": step, **here},
        evidence={
            "kind": kind,
            "step": step,
            "count": 1,
            "numel": 1,
            "seen_in": COMPILED,
            "eager_replay_loss": eager_loss,
            "compiled_rerun_loss": compiled_loss,
        },
    )
