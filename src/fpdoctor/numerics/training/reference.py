"""The reference step: the user's training step computed again under a known-good recipe (fp32
parameters and math, no autocast, no loss scaling) from the same weights, batch and RNG, and the
gradients the optimizer receives compared with it, parameter by parameter.

A rule finds what someone foresaw; a reference finds what differs. Nothing here names a cause in
advance: a departure far beyond what the recipe's rounding makes (a factor of two in a
gradient's norm, or a cosine under 0.9) is a finding whatever its reason, located by the stage
where the two runs part:

  backward   the gradients as the backward left them (the loss scale divided out)
  optimizer  the gradients as step_fn handed them to the optimizer (after its clipping)
  intended   the update the optimizer makes of them, and
  kept       the update the weights kept by the next step (reference_update.py)

The user's own gradient processing runs in the reference too (step_fn does it, on the
reference's gradients): processing done as intended is no departure. Where the backward agrees
and the optimizer's gradients do not, what step_fn did between them departs (clipping a gradient
that is still scaled). Both runs are made on stand-ins of the parameters (the user's recipe on
copies at their own dtype, the reference on fp32 copies) whose gradients fpdoctor's own hooks
read: the user's tensors carry nothing, and their `.grad` is as step_fn left it.

It costs two forward-and-backward passes on a reference step (and, where the gradients agree, the
optimizer stepped on copies): the first judged step, then again after EVERY steps, or, with that
default period, after as many steps as keep its measured cost under SHARE of their measured time
(`paced`: a reference step that costs 6 plain steps waits 1200). A period given by the user is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fpdoctor import catalog
from fpdoctor.numerics.observe import amp
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.training import between
from fpdoctor.numerics.training.control import _autocast_off, _inputs_in_fp32
from fpdoctor.preserve import preserved
from fpdoctor.report.model import Finding, Severity, Trial
from fpdoctor.torchprivate import named_parameters, pytree, reparametrized, scaler_states

EVERY = 500  # the least period: steps 1, 501, 1001, ... where its cost is under SHARE of theirs
# and, with that default, steps 10 and 100: a recipe changes early (a clip that starts after a warm-up, a
# layer unfrozen), and a short run would otherwise be compared at its first step alone (4-6 steps' time
# each, twice in a run: 0.1% of 10,000 steps)
EARLY = (10, 100)
SHARE = 0.005  # of the steps' time: the default period stretches until a reference step costs no more
RATIO = 2.0  # a gradient's norm more than twice or under half the reference's departs
COSINE = 0.9  # or its direction: bf16 autocast keeps a gradient's cosine with fp32's above 0.99
TINY = 1e-30  # a reference gradient this small has no direction to compare
NEGLIGIBLE = 1e-3  # of the model's gradient rms: a parameter's reference gradient made of rounding
STRAY = 0.1  # of it: the step's own gradient there is judged all the same (a gradient from nowhere)
STAGES = ("backward", "optimizer", "intended", "kept")  # the last two: updates (reference_update.py)
SHOWN = 8  # departed parameters the evidence lists, worst first
# Processing that scales every gradient by a factor f with f * loss scale at most this read their size
# while still scaled: a clip of the unscaled gradients shrinking them 2^10 times is not a recipe
SCALED_SHRINK = 1024.0
# unscaled gradients all multiplied by CLIP_FACTOR or less, their total norm left at CLIP_LIMIT or less: a clip
# whose max_norm is far below the gradients' norm (1e-3 typed for 1.0); max_norm 0.1 to 10 is the usual range
CLIP_FACTOR = 0.1
CLIP_LIMIT = 0.05
STALLED = 64.0  # every gradient the optimizer took this many times smaller than the reference's: an error
FP16_TINY = 2.0**-14  # fp16's smallest normal value
SPARE = 1024.0  # a scaled reference gradient this far above it flushes to 0 by no rounding of its own


@dataclass(frozen=True)
class Departure:
    """One parameter's gradient against the reference's at one stage."""

    name: str
    stage: str
    ratio: float  # |user| / |reference|
    cosine: float
    zeros: float  # share of the reference's non-zero elements that are zero in the user's
    # an update's norm over its weight's, the user's and the reference's (the update stages only)
    to_weight: float | None = None
    ref_to_weight: float | None = None
    ref_absmax: float | None = None  # the reference's largest |gradient| (the gradient stages)

    def departs(self) -> bool:
        return not (1.0 / RATIO <= self.ratio <= RATIO) or self.cosine < COSINE

    def text(self) -> str:
        flushed = f", {self.zeros:.0%} of its elements 0 where the reference's are not" if self.zeros >= 0.01 else ""
        return f"`{self.name}` {self.ratio:.3g}x the reference's norm, cosine {self.cosine:.3f}{flushed}"


@dataclass
class Comparison:
    """The reference step's outcome: per stage, every parameter compared, worst first."""

    step: int
    rows: dict[str, list[Departure]] = field(default_factory=dict)
    not_compared: str | None = None  # why the step could not be compared
    scale: float = 1.0  # the loss scale the step used
    # the what-if when only the optimizer's gradients depart: the user's recipe again, at loss scale 1
    at_scale_one: list[Departure] | None = None
    # that what-if computed, not run (watch: no step_fn holds the processing): the uniform factor the
    # processing put on every gradient, taken as a clip of their norm at loss scale 1
    scale_one_modelled: bool = False
    # the clip it was taken for: "norm" (one factor on every gradient) or "value" (each value held at one bound)
    modelled_clip: str = "norm"
    # watch: the code between the backward and the step left the optimizer no gradient (every one
    # multiplied by 0) where the backward made them: a clip whose norm overflowed (max_norm / inf)
    zeroed_between: bool = False
    # watch: one factor on every gradient, far below 1, from unscaled gradients: a clip of their total norm to
    # a threshold far below it, (their norm, what the clip left) (a max_norm typed 1e-3 for 1.0)
    clipped: tuple[float, float] | None = None
    backward_grads: dict[str, torch.Tensor] | None = None  # the step's own backward, unscaled (watch)
    # only the backward stage compared: step_fn is a framework's forward and backward (compare_step)
    backward_only: bool = False
    # the update stages (reference_update.py): the reference's gradients as step_fn handed them on,
    # held until the update is compared (then dropped); why the updates were not compared
    reference_grads: dict[str, torch.Tensor] | None = None
    update_not_compared: str | None = None
    # the reference update's gradients: "reference" (the fp32 step's, processed by step_fn) or "own"
    # (the step's own: a replay of the backward alone, watch)
    update_reference: str = "reference"
    optimizer: str = ""  # the optimizer and the dtypes of its weights and state
    at_fp32: list[Departure] | None = None  # the what-if when the optimizer's own update departs
    kept_vs_intended: dict[str, tuple[float, float]] = field(default_factory=dict)
    written: list[Any] = field(default_factory=list)  # calls seen writing the weights after the step
    written_kind: str = ""  # what they wrote: "weights", "gradients", "unknown"; "unwatched"; "": none seen
    # parameters held within bounds by the user's code between the steps (a weight clipping), with the
    # calls' places: the reference's weights were held by the same bounds before the kept stage's comparison
    constrained: dict[str, list[str]] = field(default_factory=dict)

    def departed(self, stage: str) -> list[Departure]:
        return [d for d in self.rows.get(stage, []) if d.departs()]

    def first_stage(self) -> str | None:
        """The stage where the runs part first; None when they agree everywhere."""
        return next((s for s in STAGES if self.departed(s)), None)


def check_every(every: Any) -> int:
    """`reference_every` as a user gave it: an int >= 0 (0: off), else a one-line ValueError."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"reference_every must be an int >= 0 (every N-th step; 0: off), got {every!r}")
    return every


def due(step: int, every: int = EVERY) -> bool:
    return every > 0 and ((step - 1) % every == 0 or (every == EVERY and step in EARLY))


def paced(every: int, cost: float, step_time: float) -> int:
    """The steps to wait after a reference step that cost `cost` seconds, with steps of `step_time`:
    `every`, or more with the default period, until its cost is under SHARE of the steps between."""
    if every != EVERY or cost <= 0 or step_time <= 0:
        return every
    return max(every, math.ceil(cost / (SHARE * step_time)))


class _Backward:
    """The gradient each stand-in holds when the backward has accumulated into it (a post-accumulate
    hook on fpdoctor's own copies); with micro-batches, the last call holds their sum."""

    def __init__(self, stand_ins: dict[str, torch.Tensor]) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self._handles = [
            t.register_post_accumulate_grad_hook(self._hook(name)) for name, t in stand_ins.items() if t.requires_grad
        ]

    def _hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(t: torch.Tensor) -> None:
            if t.grad is not None:
                self.grads[name] = t.grad.detach().float().clone()

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _stand_ins(model: nn.Module, fp32: bool) -> dict[str, torch.Tensor]:
    """A fresh leaf per trainable parameter: fp32 copies (the reference), or copies at the
    parameter's own dtype (the user's recipe); a tied parameter is named once."""
    made: dict[str, torch.Tensor] = {}
    for name, p in named_parameters(model):
        if p.requires_grad:
            made[name] = p.detach().to(torch.float32 if fp32 else p.dtype, copy=True).requires_grad_(True)
    return made


def _run(
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
    reference: bool,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(gradients as the backward left them, as step_fn returned them) of one run of the window."""
    stand_ins = _stand_ins(model, fp32=reference)
    backward = _Backward(stand_ins)
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            stack.enter_context(preserved(model))  # its RNG draws and buffer writes stay here
            # the optimizer's lists first: under reparametrized the model names the stand-ins
            stack.enter_context(_optimizer_on(optimizer, model, stand_ins))
            stack.enter_context(reparametrized(model, stand_ins, tie_weights=True))
            stack.enter_context(_scaler_ready(scaler))
            if reference:
                stack.enter_context(_autocast_off())
                stack.enter_context(_Fp32Math())
            for micro in _inputs_in_fp32(window) if reference else window:
                micro.rng.restore()
                step_fn(*micro.args, **micro.kwargs)
    finally:
        backward.remove()
    returned = {n: t.grad.detach().float() for n, t in stand_ins.items() if t.grad is not None}
    return backward.grads, returned


_LOW = (torch.float16, torch.bfloat16)


class _Fp32Math(TorchFunctionMode):
    """Every fp16/bf16 tensor a call reads is read in fp32, and a cast to fp16/bf16 is a cast to
    fp32: the step's own casts (`x.half()`, `.to(torch.bfloat16)`) keep the reference in fp32."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in ("half", "bfloat16") and args and isinstance(args[0], torch.Tensor):
            return args[0].float()
        if name in ("__get__", "__set__", "__delete__"):  # an attribute (`.grad`) of the tensor itself, not math
            return func(*args, **(kwargs or {}))
        args, kwargs = pytree.tree_map(_up, (tuple(args), dict(kwargs or {})))
        return func(*args, **kwargs)


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    # by identity: any object passes here, and some (a profiler's record) cannot be compared
    return torch.float32 if value is torch.float16 or value is torch.bfloat16 else value


def _scaled_large(flushed: list[Departure], scale: float) -> Departure | None:
    """The gradient made 0 whose reference, scaled by `scale`, is largest, where that is SPARE times fp16's
    smallest normal or more (no underflow makes it 0); None otherwise, or where none was made 0."""
    sized = [d for d in flushed if d.zeros >= 1.0 and d.ref_absmax is not None]
    large = max(sized, key=lambda d: d.ref_absmax or 0.0, default=None)
    if large is None or (large.ref_absmax or 0.0) * scale < SPARE * FP16_TINY:
        return None
    return large


def _row(name: str, stage: str, got: torch.Tensor, ref: torch.Tensor) -> Departure | None:
    ref_norm = float(ref.norm())
    if not math.isfinite(ref_norm) or ref_norm < TINY or got.shape != ref.shape:
        return None
    got_norm = float(got.norm())
    if not math.isfinite(got_norm):
        return None  # non-finite gradients are the step judge's own finding
    # in fp64: the product of two fp32 gradients of 1e-28 underflows fp32 (a cosine of 0 for equal vectors)
    cosine = float((got.double() * ref.double()).sum()) / (got_norm * ref_norm) if got_norm > 0 else 0.0
    live = ref != 0
    zeros = float(((got == 0) & live).sum()) / max(int(live.sum()), 1)
    return Departure(name, stage, got_norm / ref_norm, cosine, zeros, ref_absmax=float(ref.abs().max()))


def compare_step(
    step: int,
    model: nn.Module,
    *,
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: Callable[[float | None], list[contextlib.AbstractContextManager[Any]]],
    live: dict[str, torch.Tensor],
    scale: float | None,
    unscaled: bool,
    backward_only: bool = False,
    scale_carried: bool = False,
) -> Comparison:
    """The step's gradients (`live`: as step_fn handed them to the optimizer; scaled by `scale`
    unless step_fn unscaled them) against the reference step's. `contexts(scale)`: what a run
    of the window runs under, at that loss scale (None: the step's own).

    `backward_only`: step_fn is a framework's forward and backward, not the user's whole step (a
    callback's, or `fpdoctor watch`'s replay from the gradients that reached the model's outputs):
    the gradient processing after it (clipping, unscaling) is the framework's and not in it, so
    the backward stage alone is compared. `scale_carried`: step_fn's backward starts from kept
    output gradients that carry the step's loss scale whatever the scaler says: both runs divide
    it out."""
    out = Comparison(step)
    run = functools.partial(_run, model, optimizer=optimizer, scaler=scaler, step_fn=step_fn, window=window)
    with _grads_saved(model):
        ours_backward, ours_returned = run(contexts=contexts(None), reference=False)
        ref_backward, ref_returned = run(contexts=contexts(1.0), reference=True)
    scale = scale if scale is not None and math.isfinite(scale) and scale > 0 else 1.0
    if backward_only:
        if not ours_backward:
            out.not_compared = (
                "the step's forward and backward, run again on copies of the parameters, reached none of them"
            )
            return out
        if scale_carried:
            ref_backward = {n: g / scale for n, g in ref_backward.items()}
        out.rows["backward"] = gradient_rows("backward", ours_backward, ref_backward, scale)
        out.scale = scale
        out.backward_only = True
        out.reference_grads = ref_backward  # for what the optimizer takes (processed_scaled), then dropped
        out.backward_grads = {n: g / scale for n, g in ours_backward.items()}
        return out
    for name, got in live.items():
        mine = ours_returned.get(name)
        if mine is None or float((mine - got).norm()) > 1e-3 * float(got.norm()) + TINY:
            # the step's own gradients are not what step_fn computes on the stand-ins: it reads
            # tensors it holds itself (a list of the parameters taken before), so a run on copies
            # is not the user's step
            out.not_compared = (
                f"a run of step_fn on copies of the parameters does not give the step's own gradients (`{name}` "
                "differs): step_fn handles tensors it holds itself, so the reference cannot stand in for them"
            )
            return out
    out.rows["backward"] = gradient_rows("backward", ours_backward, ref_backward, scale)
    out.rows["optimizer"] = gradient_rows("optimizer", ours_returned, ref_returned, 1.0 if unscaled else scale)
    out.scale = scale
    out.reference_grads = ref_returned
    if out.first_stage() == "optimizer" and scale != 1.0:
        # what step_fn does between the backward and the optimizer may read the loss scale (a clip
        # before unscale_): the user's recipe once more at scale 1 says whether it is the cause
        with _grads_saved(model):
            _, at_one = run(contexts=contexts(1.0), reference=False)
        out.at_scale_one = [d for d in gradient_rows("optimizer", at_one, ref_returned, 1.0) if d.departs()]
    return out


def gradient_rows(
    stage: str, ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], divide: float
) -> list[Departure]:
    """Each parameter's gradient against the reference's, worst first; a parameter whose reference
    gradient is negligible beside the model's (NEGLIGIBLE of the rms over every parameter: a bias
    before a normalisation, whose gradient is 0 but for rounding) is judged only when the step's
    own gradient there is not (STRAY of that rms)."""
    names = [n for n in ours if n in ref]
    total = sum(float(ref[n].double().square().sum()) for n in names)
    count = sum(ref[n].numel() for n in names)
    rms = math.sqrt(total / count) if count else 0.0
    rows = []
    for n in names:
        got = ours[n] / divide
        if _rms(ref[n]) < NEGLIGIBLE * rms and _rms(got) < STRAY * rms:
            continue
        rows.append(_row(n, stage, got, ref[n]))
    return sorted((r for r in rows if r is not None), key=_badness, reverse=True)


def worst_cosine(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float | None:
    """The lowest cosine of a parameter's gradient with the reference's (by `_rows`'s rule of which
    are judged); None where none is."""
    rows = gradient_rows("optimizer", ours, ref, 1.0)
    return min(d.cosine for d in rows) if rows else None


def _rms(t: torch.Tensor) -> float:
    return float(t.double().square().mean().sqrt()) if t.numel() else 0.0


def _badness(d: Departure) -> float:
    ratio = max(d.ratio, 1.0 / d.ratio) if d.ratio > 0 else math.inf
    return max(ratio / RATIO, (1.0 - d.cosine) / (1.0 - COSINE))


@contextlib.contextmanager
def _grads_saved(model: nn.Module) -> Iterator[None]:
    """The user's `.grad` of every parameter out of the runs' reach (None while they run) and back as
    it was: a `scaler.unscale_` or an in-place clip in step_fn must not reach the step's gradients."""
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        for p, _ in saved:
            p.grad = None
        yield
    finally:
        for p, g in saved:
            p.grad = g


@contextlib.contextmanager
def _optimizer_on(
    optimizer: torch.optim.Optimizer, model: nn.Module, stand_ins: dict[str, torch.Tensor]
) -> Iterator[None]:
    """The optimizer's parameter lists hold the stand-ins while a run lasts, so that what step_fn asks
    of the optimizer (`scaler.unscale_(optimizer)`, clipping its groups' parameters) acts on them."""
    by_id = {id(p): stand_ins[n] for n, p in named_parameters(model) if n in stand_ins}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [by_id.get(id(p), p) for p in group["params"]]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


@contextlib.contextmanager
def _scaler_ready(scaler: Any) -> Iterator[None]:
    """The scaler's per-optimizer state fresh for a run (step_fn may unscale again) and back after."""
    states = scaler_states(scaler) if amp.enabled(scaler) else None
    saved = None if states is None else {k: dict(v) for k, v in states.items()}
    try:
        if states is not None:
            states.clear()  # the same defaultdict: its factory makes fresh states
        yield
    finally:
        if states is not None and saved is not None:
            states.clear()
            states.update(saved)


def processed_scaled(comparison: Comparison, taken: dict[str, torch.Tensor], *, adaptive: bool = True) -> None:
    """watch's replay compares the backward alone; the gradients the optimizer takes (`taken`,
    unscaled) are compared here. Where the code between the backward and the step multiplied every
    gradient by 0 (the backward's are not 0: a clip coefficient max_norm / inf, its norm overflowed),
    the optimizer stage departs whatever the loss scale: no processing intends it. Where a GradScaler
    scaled the loss and that code put one factor on every gradient (a clip of their total norm), so
    far below 1 that it read their size while still scaled (SCALED_SHRINK), the optimizer stage
    departs, and the fix (unscale first) is checked by that clip applied at loss scale 1. Where no
    scaler ran, or the norm the clip left is a threshold as written (1e-3) read from unscaled gradients
    and not one read from scaled ones (1.0 / scale), such a factor is a clip to a threshold far below
    their norm (CLIP_FACTOR, CLIP_LIMIT): `clipped`, for an optimizer that follows the gradients' size
    (not `adaptive`: Adam divides the factor out). (The scaler's own state cannot tell: scaler.step
    unscales before the optimizer's step either way.) Rows and the what-if go into
    `comparison`; nothing where the factors differ (processing of its own) or are near 1."""
    back, ref, scale = comparison.backward_grads, comparison.reference_grads, comparison.scale
    comparison.backward_grads = None
    if not back or not ref:
        return
    names = [n for n in taken if n in back and n in ref]
    norms = [(float(taken[n].double().norm()), float(back[n].double().norm())) for n in names]
    factors = [t / b for t, b in norms if b > TINY]
    if factors and all(f == 0 for f in factors):
        comparison.rows["optimizer"] = gradient_rows("optimizer", {n: taken[n] for n in names}, ref, 1.0)
        comparison.zeroed_between = True
        return
    if len(factors) < 2:
        return
    mid = sorted(factors)[len(factors) // 2]
    after = math.sqrt(sum(t * t for t, _ in norms))
    if scale <= 1.0 or (_written(after) and not _written(after * scale)):  # the clip read the gradients unscaled
        uniform = all(abs(f - mid) <= 0.05 * mid for f in factors)
        if uniform and 0 < mid <= CLIP_FACTOR and after <= CLIP_LIMIT and not adaptive:
            rows = gradient_rows("optimizer", {n: taken[n] for n in names}, ref, 1.0)
            if any(d.departs() for d in rows):
                comparison.rows["optimizer"] = rows
                comparison.clipped = (math.sqrt(sum(b * b for _, b in norms)), after)
        return
    if _value_clip(comparison, {n: taken[n] for n in names}, back, ref, scale):
        return
    if not 0 < mid * scale <= SCALED_SHRINK or any(abs(f - mid) > 0.05 * mid for f in factors):
        return
    rows = gradient_rows("optimizer", {n: taken[n] for n in names}, ref, 1.0)
    if not any(d.departs() for d in rows):
        return
    # the clip that made the factor, as unscaling first would have run it: its threshold is what the
    # scaled gradients were clipped to, their total norm being scale times the backward's
    total = math.sqrt(sum(b * b for _, b in norms))
    limit = math.sqrt(sum(t * t for t, _ in norms)) * scale
    fixed = {n: back[n] * min(1.0, limit / total) for n in names}
    comparison.rows["optimizer"] = rows
    comparison.at_scale_one = [d for d in gradient_rows("optimizer", fixed, ref, 1.0) if d.departs()]
    comparison.scale_one_modelled = True


def _written(threshold: float) -> bool:
    """Whether a clip's threshold is one a script writes: one or two significant digits (1.0, 0.5, 1e-3,
    0.25), within what clip_grad_norm_'s max_norm / (norm + 1e-6) leaves of it."""
    return threshold > 0 and any(
        abs(threshold - float(f"{threshold:.{d}g}")) <= 1e-3 * threshold for d in (1, 2)
    )  # fmt: skip


def _value_clip(
    comparison: Comparison, taken: dict[str, torch.Tensor], back: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
    scale: float,
) -> bool:  # fmt: skip
    """A clip of each value (clip_grad_value_) that read the gradients while scaled: every value the
    optimizer took is within one bound, the bound times the scale is a threshold of the code's
    (at most SCALED_SHRINK times the backward's largest value), a tenth of the values sit on it,
    and the optimizer stage departs. The fix is checked as that clip of the backward's gradients at
    loss scale 1. False where it is not such a clip."""
    with torch.no_grad():
        bound = max(float(t.abs().max()) for t in taken.values())
        biggest = max(float(b.abs().max()) for b in back.values())
        if not 0 < bound * scale <= SCALED_SHRINK * biggest or bound >= biggest:
            return False
        on = sum(int((t.abs() >= bound * (1 - 1e-3)).sum()) for t in taken.values())
        if on < 0.1 * sum(t.numel() for t in taken.values()):
            return False
        rows = gradient_rows("optimizer", taken, ref, 1.0)
        if not any(d.departs() for d in rows):
            return False
        threshold = bound * scale
        fixed = {n: back[n].clamp(-threshold, threshold) for n in taken}
    comparison.rows["optimizer"] = rows
    comparison.at_scale_one = [d for d in gradient_rows("optimizer", fixed, ref, 1.0) if d.departs()]
    comparison.scale_one_modelled, comparison.modelled_clip = True, "value"
    return True


def unscaled_already(scaler: Any, optimizer: Any) -> bool:
    """step_fn called `scaler.unscale_(optimizer)`: the optimizer's gradients are unscaled."""
    states = scaler_states(scaler) if amp.enabled(scaler) else None
    stage = (states or {}).get(id(optimizer), {}).get("stage")
    return getattr(stage, "name", None) == "UNSCALED"


def _between() -> between.Between | None:
    """The user's lines between the backward and the step in progress that process the gradients and
    do not unscale them; None where there are none or the source cannot be read (never raised)."""
    try:
        seen = between.read()
    except Exception:
        return None
    if seen is None:
        return None
    before = tuple(itertools.takewhile(lambda line: "unscale_" not in line[1], seen.lines))
    return dataclasses.replace(seen, lines=before) if before and seen.before is not None else None


def _clearing() -> tuple[between.Between, tuple[int, str]] | None:
    """The statement between the backward and the step in progress that clears the gradients
    (`p.grad.zero_()`, zero_grad()), with what was read; None where there is none (never raised)."""
    try:
        seen = between.read()
        found = between.clearing(seen) if seen is not None else None
    except Exception:
        return None
    return (seen, found) if seen is not None and found is not None else None


def finding(comparison: Comparison, *, recipe: str, here: dict[str, Any]) -> Finding | None:
    """`gradients-depart-from-reference` where the runs part; None where they agree."""
    stage = comparison.first_stage()
    if stage not in ("backward", "optimizer"):  # the update stages: reference_update.finding
        return None
    departed = comparison.departed(stage)
    compared = len(comparison.rows[stage])
    worst = "; ".join(d.text() for d in departed[:3]) + ("; ..." if len(departed) > 3 else "")
    # under watch no step_fn holds the processing: it is the code between the backward and the step
    actor = (
        "your code"
        if comparison.scale_one_modelled or comparison.zeroed_between or comparison.clipped is not None
        else "step_fn"
    )
    where_text = {
        "backward": "as the backward left them (the loss scale divided out)",
        "optimizer": f"as {actor} handed them to the optimizer, while the backward's agree",
    }[stage]
    message = (
        f"At step {comparison.step}, the gradients of {len(departed)} of {compared} parameters depart from the "
        f"reference step's (the same step from the same weights, batch and RNG in fp32, no autocast, no loss "
        f"scaling) {where_text}: {worst}. Your recipe is {recipe}; its rounding alone keeps a gradient within a "
        f"factor {RATIO:g} of the reference's norm and its cosine above {COSINE:g}."
    )
    flushed = [d for d in departed if d.zeros >= 0.5]
    stalled = len(departed) == compared and all(0 < d.ratio <= 1 / STALLED for d in departed)
    if stalled:
        message += (
            f" Every gradient the optimizer took is {1 / max(d.ratio for d in departed):.3g}x or more smaller than "
            "the reference's: an optimizer that follows the gradient's size (SGD) steps that much less, and one that "
            "divides by it (Adam) steps less once the gradients near its eps."
        )
    trial: Trial
    title: str | None = None  # the catalogue's, unless a branch names the cause in it
    if stage == "optimizer" and comparison.at_scale_one is not None:
        left = comparison.at_scale_one
        message += (
            f" What {actor} does between the backward and the optimizer (clipping, a division) acts on "
            f"gradients still multiplied by the loss scale ({comparison.scale:g})."
        )
        fix = (
            "Unscale before you process the gradients: call scaler.unscale_(optimizer) after the backward and "
            "before clip_grad_norm_ (or anything that reads their size)"
        )
        seen = _between()
        if seen is not None:  # the code's own lines and names: where the call goes
            message += (
                f" Between the backward (line {seen.backward}) and the optimizer's step (line {seen.step}) of "
                f"{os.path.basename(seen.path)} your code runs {seen.listed()}."
            )
            assert seen.before is not None
            first, text = seen.before
            fix = (
                f"Unscale before you process the gradients: insert {seen.scaler or 'scaler'}.unscale_("
                f"{seen.optimizer or 'optimizer'}) before line {first} of {os.path.basename(seen.path)} (`{text}`), "
                f"after the backward at line {seen.backward}"
            )
        changed = (
            "the step's backward gradients put through the same clip of their norm at loss scale 1 (every "
            "parameter was scaled by one factor: a clip of the total norm, computed, not run)"
            if comparison.scale_one_modelled and comparison.modelled_clip == "norm"
            else "the step's backward gradients put through the same clip of each value at loss scale 1 (every value "
            "the optimizer took was held within one bound: a clip of each value, computed, not run)"
            if comparison.scale_one_modelled
            else "the same step at loss scale 1 (what unscaling first gives the processing)"
        )
        trial = Trial.checked(
            changed,
            metric="parameters whose gradients depart from the reference's", before=len(departed),
            after=len(left), on=f"step {comparison.step}",
        )  # fmt: skip
        if left:
            fix += f"; at scale 1, {len(left)} still depart, so the scale is not all of it"
    elif stage == "optimizer" and comparison.clipped is not None:
        norm, after = comparison.clipped
        message += (
            f" One factor, {after / norm:.3g}, is on every gradient the optimizer took: a clip of their total norm "
            f"({norm:.3g}, unscaled) to {after:.3g}, {norm / after:.3g}x below it. Every "
            "update is that much smaller than the learning rate says, at every step whose norm passes the threshold."
        )
        fix = (
            f"Raise the clip's max_norm: {after:.3g} is {norm / after:.3g}x below the gradients' norm ({norm:.3g}); "
            "1.0 is the usual value (a threshold typed 1e-3 for 1.0 does this)"
        )
        seen = _between()
        clip = next((x for x in seen.lines if "clip_grad_norm" in x[1]), None) if seen is not None else None
        if seen is not None and clip is not None:  # the script's own clip line, between the backward and the step
            # a threshold passed by name (a command-line flag's default): where its value is set is the place
            named = re.search(r"max_norm\s*=\s*([A-Za-z_][\w.]*)", clip[1])
            given = f" (the value of `{named.group(1)}` there: raise it where it is set)" if named else ""
            fix = (
                f"Raise max_norm in line {clip[0]} of {os.path.basename(seen.path)} (`{clip[1]}`){given}: "
                f"{after:.3g} is {norm / after:.3g}x below the gradients' norm ({norm:.3g}); 1.0 is the usual value"
            )
        title = f"The optimizer took gradients clipped {norm / after:.3g}x below their norm"
        trial = Trial.untried(
            "read from the gradients the optimizer took and the backward's at the reference step: the clip's "
            "threshold is the script's, which fpdoctor does not change in a running job"
        )
    elif stage == "optimizer" and comparison.zeroed_between and (cleared := _clearing()) is not None:
        seen, (line, text) = cleared
        name = os.path.basename(seen.path)
        message += (
            f" Every gradient the optimizer took is 0 while the backward's are not: line {line} (`{text}`), between "
            f"the backward (line {seen.backward}) and the optimizer's step (line {seen.step}) of {name}, clears them, "
            "and the weights do not move."
        )
        fix = (
            f"move line {line} of {name} from between loss.backward() and the optimizer's step to just after that "
            "step (or before the step's first forward)"
        )
        trial = Trial.untried(
            "the script's own line is the evidence, with the gradients the optimizer took (all 0): moving a line "
            "of the script is the fix, and only the script can run it"
        )
    elif stage == "optimizer" and comparison.zeroed_between:
        message += (
            " Every gradient the optimizer took is 0 while the backward's are not: your code between the backward "
            "and the step multiplied them all by 0, and the weights do not move. A clip does that when the norm it "
            "divides by is Inf: a norm computed in fp16/bf16 overflows (torch's clip_grad_norm_ returns the total norm "
            "in the gradients' dtype, Inf in fp16 past 65504; a norm written by hand overflows sooner, its sum of "
            "squares past 65504 once the norm passes 256), and max_norm / inf is 0."
        )
        fix = (
            "Compute the norm your code divides the gradients by in fp32: the squares summed from g.float() (where "
            "torch.nn.utils.clip_grad_norm_ takes fp16 gradients, its total norm overflows: compute it from "
            "g.float() by hand and multiply each g by min(1, max_norm / (norm + 1e-6))); `fpdoctor trace` on the "
            "script names the op that overflows and checks its fix"
        )
        trial = Trial.untried(
            "watch does not run your code between the backward and the step; `fpdoctor trace` runs it and checks "
            "the fix at the op"
        )
    elif stage == "backward" and (large := _scaled_large(flushed, comparison.scale)) is not None:
        # a whole gradient 0 whose reference, scaled as the step scaled it, is a normal fp16 number with 10 bits
        # to spare: no underflow of its own makes it 0; the forward made the values it is made of 0 (an Inf that
        # rsqrt or a division made 0, a saturated activation), which the reference step does not locate
        reach = (large.ref_absmax or 0.0) * comparison.scale
        message += (
            f" They are not too small for the format: `{large.name}`'s reference gradient, scaled by "
            f"{comparison.scale:g} as the step scaled it, reaches {reach:.3g}, far above "
            f"fp16's smallest normal value ({FP16_TINY:.2g}). The forward made the values they come from 0 (an "
            "overflow that rsqrt or a division turned into 0, an activation saturated), and the backward carries "
            "those zeros."
        )
        fix = (
            "Run `fpdoctor trace` on the script: it follows the forward op by op, names the op whose overflow or "
            "saturation makes these gradients 0, and checks its fix (raising the loss scale does not help)"
        )
        trial = Trial.untried(
            "the reference step shows which gradients are 0, not which op of the forward made them so; "
            "`fpdoctor trace` runs the ops and checks the fix there"
        )
    elif stage == "backward" and flushed and comparison.scale < 1 and "GradScaler" in recipe:
        # a GradScaler already scales the loss: its own skips pushed the scale below 1, so a scale is no fix
        fix = (
            f"The GradScaler's scale has sunk to {comparison.scale:g}: the overflows it skipped pushed it below "
            "where the gradients fit in the recipe's format. Fix what overflows (the run's non-finite steps; "
            "`fpdoctor trace` on the script names the op and checks its fix), and the scale recovers"
        )
        trial = Trial.untried(
            "the fix is the overflow's, which the non-finite steps' findings name; the reference step shows the "
            "gradients the sunk scale flushes"
        )
    elif stage == "backward" and flushed:
        fix = (
            "The gradients flush to zero in the recipe's format: scale the loss (torch.amp.GradScaler) or raise "
            "the scale you use, or compute in bf16, whose range is fp32's"
        )
        trial = Trial.untried(
            "the fix changes how the step scales the loss; the reference step shows the gradients it would keep"
        )
    else:
        names = ", ".join(f"`{d.name}`" for d in departed[:3])
        fix = (
            f"Find where the recipe's precision changes these gradients: `fpdoctor trace` on this step, or keep "
            f"the modules that own {names} in fp32 and compare again"
        )
        trial = Trial.untried(
            "no single change is named yet; the reference step itself is the experiment that found the departure"
        )
    return catalog.make(
        "gradients-depart-from-reference",
        title=title,
        message=message,
        fix=fix,
        # every gradient zeroed or shrunk STALLED-fold: the weights barely move, a run to stop, not one to watch
        severity=Severity.ERROR if stage == "optimizer" and (comparison.zeroed_between or stalled) else None,
        where={"module": None, "op": None, "phase": stage, "step": comparison.step, **here},
        evidence={
            "stage": stage,
            "step": comparison.step,
            "loss_scale": comparison.scale,
            "departed": [  # the worst SHOWN; the count beside them
                {"parameter": d.name, "norm_ratio": d.ratio, "cosine": d.cosine, "zeros": d.zeros}
                for d in departed[:SHOWN]
            ],
            "departed_count": len(departed),
            "compared": compared,
        },
        trial=trial,
    )


def summary(
    compared: list[Comparison], *, every: int, off: str | None, pace: tuple[int, float, float] | None = None
) -> tuple[tuple[str, str], dict[str, Any]]:
    """What the report says of the reference step whether or not it found anything: the steps it
    judged, against what, by which measure and within which bounds, or why it did not run; so that
    an OK reads "checked and fine", not "not looked at". `pace`: the period now, the last reference
    step's cost and a step's time (seconds), where both were measured."""
    judged = [c for c in compared if c.not_compared is None]
    skipped = [c for c in compared if c.not_compared is not None]
    data: dict[str, Any] = {
        "every": every,
        "recipe": "fp32 parameters and math, no autocast, no loss scaling; the same weights, batch and RNG",
        "bounds": {"norm_ratio": [1.0 / RATIO, RATIO], "cosine_min": COSINE},
        "compared_steps": [c.step for c in judged],
        "not_compared": {str(c.step): c.not_compared for c in skipped},
    }
    if off is not None and not compared:
        data["off"] = off
        return ("reference step", f"not run: {off}"), data
    if not judged:
        why = skipped[0].not_compared if skipped else "no step was due"
        return ("reference step", f"not compared: {why}"), data
    rows = [d for c in judged for stage in STAGES for d in c.rows.get(stage, [])]
    departed = [c for c in judged if c.first_stage() is not None]
    steps = ", ".join(str(c.step) for c in judged[:5]) + (", ..." if len(judged) > 5 else "")
    where = f"step{'s' if len(judged) > 1 else ''} {steps}"
    updates = [c for c in judged if c.rows.get("kept") or c.rows.get("intended")]
    data["update_steps"] = [c.step for c in updates]
    data["update_not_compared"] = {str(c.step): c.update_not_compared for c in judged if c.update_not_compared}
    if departed:
        what = "updates" if departed[0].first_stage() in ("intended", "kept") else "gradients"
        text = (
            f"{where} against an fp32 step: the {what} departed at step {departed[0].step}, at the "
            f"{departed[0].first_stage()} stage (the finding says where)"
        )
    elif rows:
        worst_ratio = max((d.ratio for d in rows), key=lambda r: max(r, 1.0 / r) if r > 0 else math.inf)
        worst_cosine = min(d.cosine for d in rows)
        grads = sum(1 for d in rows if d.stage in ("backward", "optimizer"))
        # a replay from the gradients at the model's outputs (watch, the callbacks) compares what the backward
        # left: the script's code between the backward and the step (an unscale_, a clip) is judged apart
        left = " as the backward left them" if all(c.backward_only for c in judged) else ""
        counted = f"{grads} gradient(s){left}" + (f" and {len(rows) - grads} update(s)" if len(rows) > grads else "")
        text = (
            f"{where} against an fp32 step (no autocast, no loss scaling): {counted} within "
            f"{RATIO:g}x of its norms and cosine >= {COSINE:g} (worst {worst_ratio:.3g}x, cosine {worst_cosine:.4f})"
        )
        data["worst"] = {"norm_ratio": worst_ratio, "cosine": worst_cosine}
    else:
        text = f"{where} against an fp32 step: no gradient large enough to compare"
    held = {n: places for c in judged for n, places in c.constrained.items()}
    if held:
        data["constrained"] = held
        first = next(iter(held.values()))[0]
        text += (
            f"; {len(held)} parameter(s) held within bounds by your code between the steps ({first}): the "
            "reference's weights held by the same bounds"
        )
    if pace is not None and pace[0] > every:
        gap, cost, step_time = pace
        data["paced"] = {"every": gap, "cost_s": cost, "step_s": step_time, "share": SHARE}
        text += (
            f"; paced to one every {gap} steps (it cost {cost / step_time:.3g} steps' time: kept under {SHARE:.1%} "
            f"of the steps between; never more often than every {every})"
        )
    elif every > 0:
        text += f"; again every {every} steps"
    return ("reference step", text), data
