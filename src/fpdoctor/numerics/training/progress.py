"""Progress judged against the reference: a run whose loss has stopped improving, and what the same
steps in a known-good recipe do from the same state.

Every `WINDOW` finite steps the judge compares the mean loss of the window's two halves. An
improvement within the noise (twice the standard error of the difference: each step's batch is
another) is "flat". A flat window is a question, not a finding: a converged run is flat too. The
question is answered by an experiment from the step's state, on stand-ins: `STEPS` optimizer steps
on the step's own batch, twice: as the run is (the weights in their own dtype, the step's
autocast) and in the reference recipe (fp32 weights and math, autocast off), the same optimizer
class, hyperparameters and state in both. Where the reference lowers that batch's loss by `GAIN`
of it and the run's recipe by under `SHARE` of what the reference does, the recipe is what stops
the progress: `training-not-progressing`. Where both move alike the run has converged, or its
learning rate is the question; no finding, and the report says what was judged.

Cost: the loss of each finite step kept (a float), and per flat window 2 x (STEPS + 1) forward
and backward passes and 2 x STEPS optimizer steps on copies; the window doubles after each
experiment (200, 400, 800, ... steps), so a converged run pays for one per doubling of its length.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.training.control import _autocast_off, _inputs_in_fp32
from fpdoctor.numerics.training.reference import _Fp32Math, _grads_saved
from fpdoctor.numerics.updates.measure import no_global_optimizer_hooks
from fpdoctor.numerics.updates.whatif import copy_optimizer
from fpdoctor.preserve import preserved
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import named_parameters, reparametrized

WINDOW = 200  # finite steps whose two halves' mean losses are compared
STEPS = 8  # optimizer steps of each arm of the experiment
GAIN = 0.02  # the reference lowers the batch's loss by 2% of it in STEPS steps: progress is there to make
SHARE = 0.25  # and the run's recipe makes under a quarter of that


@dataclass(frozen=True)
class Flat:
    """A window of losses whose second half is no better than its first, within the noise."""

    first: int  # the window's first and last step
    last: int
    before: float  # mean loss of the first half, of the second
    after: float
    noise: float  # twice the standard error of the difference of the two means


def flat(steps: list[int], losses: list[float]) -> Flat | None:
    """The window as `Flat` when it did not improve by more than its noise; None when it did."""
    half = len(losses) // 2
    if half < 2:
        return None
    a, b = losses[:half], losses[half:]
    noise = 2.0 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    before, after = statistics.fmean(a), statistics.fmean(b)
    if before - after > noise:
        return None
    return Flat(steps[0], steps[-1], before, after, noise)


@dataclass(frozen=True)
class Arms:
    """The batch's loss before and after STEPS steps, in the run's recipe and in the reference's."""

    steps: int
    run: tuple[float, float]
    reference: tuple[float, float]

    @staticmethod
    def _gain(pair: tuple[float, float]) -> float:
        return pair[0] - pair[1]

    def recipe_stops_progress(self) -> bool:
        ref, ours = self._gain(self.reference), self._gain(self.run)
        if not all(math.isfinite(v) for v in (*self.run, *self.reference)):
            return False
        return ref > GAIN * abs(self.reference[0]) and ours < SHARE * ref


def run_arms(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    window: list[MicroBatch],
    step_fn: Callable[..., Any],
    contexts: Callable[[], list[contextlib.AbstractContextManager[Any]]],
    *,
    steps: int = STEPS,
    divide: float = 1.0,
) -> Arms:
    """Both arms from the step's state, on stand-ins: the user's parameters, their `.grad`, buffers,
    optimizer and RNG are as they were afterwards. `divide`: the loss scale the step's backward was
    multiplied by (a GradScaler's), divided out of each arm's gradients before its optimizer step, as
    scaler.step() does."""
    named = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
    results = []
    with _grads_saved(model):
        for reference in (False, True):
            weights = {
                n: p.detach().to(torch.float32 if reference else p.dtype, copy=True).requires_grad_(True)
                for n, p in named
            }
            opt = copy_optimizer(optimizer, {id(p): weights[n] for n, p in named})
            micro_batches = _inputs_in_fp32(window) if reference else window
            losses = []
            with torch.enable_grad(), preserved(model), reparametrized(model, weights, tie_weights=True):
                for i in range(steps + 1):
                    for w in weights.values():
                        w.grad = None
                    losses.append(_window_loss(micro_batches, step_fn, contexts, reference=reference))
                    if i < steps:
                        if divide != 1.0:
                            for w in weights.values():
                                if w.grad is not None:
                                    w.grad.div_(divide)
                        with no_global_optimizer_hooks():
                            opt.step()
            results.append((losses[0], losses[-1]))
    return Arms(steps, results[0], results[1])


def _window_loss(
    window: list[MicroBatch],
    step_fn: Callable[..., Any],
    contexts: Callable[[], list[contextlib.AbstractContextManager[Any]]],
    *,
    reference: bool,
) -> float:
    """One optimizer step's forward and backward (its micro-batches, their RNG); the mean loss,
    NaN where a micro-batch returns none."""
    losses = []
    for micro in window:
        micro.rng.restore()
        with _recipe(contexts, reference=reference):
            loss = step_fn(*micro.args, **micro.kwargs)
        if not isinstance(loss, (torch.Tensor, float, int)):
            return math.nan
        losses.append(float(torch.as_tensor(loss).detach().float().mean()))
    return statistics.fmean(losses) if losses else math.nan


@contextlib.contextmanager
def _recipe(contexts: Callable[[], list[contextlib.AbstractContextManager[Any]]], *, reference: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for context in contexts():
            stack.enter_context(context)
        if reference:
            stack.enter_context(_autocast_off())
            stack.enter_context(_Fp32Math())
        yield


def finding(flat_: Flat, arms: Arms, *, recipe: str, here: dict[str, Any], loss_is: str | None = None) -> Finding:
    """`training-not-progressing`: the loss flat over the window, the reference recipe moving it.
    `loss_is`: what the arms' losses are where they are not the loss function's (an estimate)."""
    (r0, r1), (f0, f1) = arms.run, arms.reference
    message = (
        f"Over steps {flat_.first}-{flat_.last} the loss did not improve (mean {flat_.before:.4g} in the first "
        f"half, {flat_.after:.4g} in the second; noise {flat_.noise:.2g}). From step {flat_.last}'s state, "
        f"{arms.steps} optimizer steps on its own batch in the reference recipe (fp32 weights and math, no "
        f"autocast) lower that batch's loss {f0:.4g} -> {f1:.4g}; the same steps in your recipe ({recipe}) "
        f"{r0:.4g} -> {r1:.4g}{f' ({loss_is})' if loss_is else ''}. The progress is there to make, and the "
        "recipe's precision does not make it."
    )
    fix = (
        "Find the part of the recipe that loses the step: the reference step's finding (TRN015) where the "
        "gradients depart; updates rounded away (TRN010) where bf16/fp16 weights do not move; otherwise a sum "
        "or residual computed in bf16/fp16 whose small terms round away in the forward (keep it, or the "
        "weights, in fp32)"
    )
    return catalog.make(
        "training-not-progressing",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "optimizer", "step": flat_.last, **here},
        evidence={
            "window": [flat_.first, flat_.last],
            "loss_first_half": flat_.before,
            "loss_second_half": flat_.after,
            "noise": flat_.noise,
            "steps_tried": arms.steps,
            "recipe_loss": [r0, r1],
            "reference_loss": [f0, f1],
        },
        trial=Trial.checked(
            f"{arms.steps} steps on step {flat_.last}'s batch in fp32 without autocast (the reference recipe)",
            metric="the batch's loss after the steps",
            before=r1,
            after=f1,
            on=f"step {flat_.last}'s batch, from its weights and optimizer state",
        ),
    )
