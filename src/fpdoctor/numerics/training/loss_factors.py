"""Constant factors on the loss a backward starts from, read from its root, that the gradients the
optimizer takes should not carry.

- A loss scale written by hand and never divided out: `(loss * 1024).backward()` with no GradScaler,
  then `optimizer.step()` on gradients still 1024 times too large (TRN036). A constant multiplier that
  is a power of two of at least LEAST is a loss scale (powers of two scale fp16 values exactly, which
  is why hand-written scales are one; a loss weight of 10 or 0.5 is not taken for one). The reference
  step divides it out of both runs, as it divides a GradScaler's: the backward stage then agrees, and
  the gradients the optimizer took are compared with the backward's. A parameter whose gradient is the
  scale times the backward's was never divided; it is a finding where the updates as taken are a
  blow-up in the making (BLOWN), not where the learning rate was picked for the constant.
- A loss divided by the step's micro-batch count twice: every backward of a step of k micro-batches
  ran on the loss divided by k twice, two divisions in its chain (`compute_loss` returns `loss /
  accum`, and the loop divides it again), so the gradients are k times smaller than the mean over the
  micro-batches (TRN037). A division by k alone is the mean, a division of a sum of k losses by k is
  their mean too, and none is the sum (a learning rate picked for it): none of them is taken.

What each costs is measured on copies (reference_update.step_on_copies): the optimizer's step on the
gradients as taken and as the fix makes them (and, for the scale, on the reference's), from the same
weights and state. An optimizer that follows the gradients' size (SGD) steps the factor too far or too
short; one that divides by their running size (Adam) steps as meant but for its eps, and its updates
agree: no finding there.
"""

from __future__ import annotations

import linecache
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.observe.grad_clears import Where
from fpdoctor.numerics.training.between import Between
from fpdoctor.numerics.training.reference import RATIO, TINY, Comparison, gradient_rows
from fpdoctor.numerics.training.reference_update import step_on_copies
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import constant_operand, named_parameters

LEAST = 128.0  # 2**7: the smallest constant multiplier taken for a loss scale
CHAIN = 4  # constant multiplications and divisions read down from the root: `loss * 1024 / accum`
TERMS = 16  # the terms of a sum read below a division (a mean of that many losses is no accumulation's)
SAME = 0.05  # a gradient within 5% of the scale times the backward's still carries the scale
# an update of a weight past this share of its norm in one step, as taken: the scale left in the
# gradients is what the run shows, not a constant the learning rate was picked for (a summed loss
# `loss * batch_size`, a learning rate divided by the scale: updates of 0.5-3.5% there)
BLOWN = 0.3
SET = 1e-6  # a weight's norm below this is one initialised at 0: no update is judged against it
SHOWN = 4  # parameters named in the message
FOLLOWS = 0.1  # an update within 10% of 1/k of the mean's follows the gradients' size (SGD): k times too small


@dataclass(frozen=True)
class Factors:
    """The constant factors in the chain of multiplications and divisions that ends at a backward's root."""

    scale: float | None  # the product of the powers of two of at least LEAST it was multiplied by
    # each constant it was divided by, one per node (a product with c < 1 divides by 1/c), but a division of
    # a sum by its number of terms, which is a mean: `(loss_a + loss_b) / 2`
    divisors: tuple[float, ...] = ()


def of_root(root: torch.Tensor) -> Factors | None:
    """The factors a backward's root carries (`loss * 1024 / accum`: scale 1024, divisors (accum,)); None
    where there are none. A few attribute reads per backward, none of a device's memory."""
    node: Any = root.grad_fn
    scale = 1.0
    divisors: list[float] = []
    for _ in range(CHAIN):
        kind = type(node).__name__
        if kind not in ("MulBackward0", "DivBackward0"):
            break
        constant = constant_operand(node)
        if constant is None or not math.isfinite(constant) or constant <= 0:
            break
        operands = [n for n, _ in node.next_functions if n is not None]
        below = operands[0] if len(operands) == 1 else None
        divided = constant if kind == "DivBackward0" else 1.0 / constant if constant < 1.0 else None
        if divided is not None and divided > 1.0 and _terms(below) != divided:
            divisors.append(divided)
        elif kind == "MulBackward0" and constant >= LEAST and math.log2(constant).is_integer():
            scale *= constant
        if below is None:
            break
        node = below
    if scale == 1.0 and not divisors:
        return None
    return Factors(scale if scale > 1.0 else None, tuple(divisors))


def _terms(node: Any) -> int:
    """The terms a sum of losses adds (`a + b + c`: 3), read down its AddBackward0 nodes; 1 for any
    other node."""
    if type(node).__name__ != "AddBackward0":
        return 1
    count, todo = 0, [node]
    while todo and count <= TERMS:
        n = todo.pop()
        if type(n).__name__ == "AddBackward0":
            todo.extend(m for m, _ in n.next_functions if m is not None)
        else:
            count += 1
    return count


@dataclass(frozen=True)
class StepFactors:
    """What the backwards of one optimizer step say together."""

    scale: float | None  # every backward's hand-written loss scale, the same, where no GradScaler ran
    twice: int | None  # the micro-batch count k, where every backward's loss was divided by k twice (k >= 2)
    at: Where | None  # the last backward's line


def of_step(seen: list[tuple[Factors | None, Where | None]], *, scaler: bool) -> StepFactors | None:
    """The step's factors from each backward's (`seen`, with their lines); `scaler`: a GradScaler stepped
    (its scale is the multiplier then). None where the step has none to judge. Divided twice: two
    divisions by the micro-batch count k in each backward's chain, not one by k * k nor a product that
    happens to equal it (`sum / 16` with 4 micro-batches is a loss summed and normalised by hand)."""
    if not seen or any(f is None for f, _ in seen):
        return None
    factors = [f for f, _ in seen if f is not None]
    scale = factors[0].scale if not scaler and all(f.scale and f.scale == factors[0].scale for f in factors) else None
    k = len(factors)
    twice = k if k >= 2 and all(sum(abs(d - k) <= 1e-9 * k for d in f.divisors) >= 2 for f in factors) else None
    if scale is None and twice is None:
        return None
    return StepFactors(scale, twice, seen[-1][1])


@dataclass(frozen=True)
class Measured:
    """What the reference step measured of a step whose gradients kept a hand-written loss scale."""

    scale: float
    still: list[str]  # parameters whose gradients the optimizer took still multiplied by the scale
    compared: int
    departed: int  # parameters whose update on the gradients as taken departs from the reference's
    departed_undone: int  # with the scale divided out of `still`
    worst: str  # the parameter whose update is largest against its weight, as taken
    to_weight: float  # its update's norm over its weight's, as taken
    to_weight_undone: float  # with the scale divided out
    to_weight_reference: float  # on the reference's gradients
    low_precision: bool  # some weights are fp16/bf16 themselves (GradScaler's unscale_ refuses fp16 gradients)


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def _weight_norms(params: dict[str, torch.Tensor], names: Any) -> dict[str, float]:
    """Each named weight's norm, TINY at least: what an update is read against."""
    return {n: max(_norm(params[n].detach()), TINY) for n in names}


def measure(
    comparison: Comparison, optimizer: torch.optim.Optimizer, model: nn.Module, taken: dict[str, torch.Tensor],
    scale: float,
) -> Measured | None:  # fmt: skip
    """The gradients the optimizer took (`taken`, as the step left them) against the backward's, the
    scale divided out (`comparison`'s); where some still carry the scale, the optimizer's step on copies
    as taken, undone and on the reference's gradients. None where none carries it, or where the update
    agrees with the reference's all the same (an adaptive optimizer)."""
    back, ref = comparison.backward_grads or {}, comparison.reference_grads or {}
    names = [n for n in taken if n in back and n in ref and _norm(back[n]) > TINY]
    still = [n for n in names if abs(_norm(taken[n]) / _norm(back[n]) - scale) <= SAME * scale]
    if not still:
        return None
    undone = {n: taken[n] / scale if n in still else taken[n] for n in names}
    as_taken = step_on_copies(optimizer, model, {n: taken[n] for n in names}, fp32=False)
    fixed = step_on_copies(optimizer, model, undone, fp32=False)
    meant = step_on_copies(optimizer, model, {n: ref[n] for n in names}, fp32=False)
    params = dict(named_parameters(model))
    weights = _weight_norms(params, as_taken)

    if not all(math.isfinite(_norm(u)) for u in meant.values()):
        return None  # the optimizer's own step fails on the reference's gradients (fp16 Adam's eps): not the scale

    def departed(updates: dict[str, torch.Tensor]) -> int:
        out = 0
        for n, u in updates.items():
            reference = _norm(meant[n])
            ratio = _norm(u) / reference if reference > TINY else (math.inf if _norm(u) > TINY else 1.0)
            out += not 1.0 / RATIO <= ratio <= RATIO  # a NaN ratio (an Inf update) departs too
        return out

    before, after = departed(as_taken), departed(fixed)
    if after >= before:
        return None  # the updates agree (Adam divides the factor out), or dividing does not bring them back
    # the weights that still carry it, but one initialised at 0 (a bias), whose first update is all of it
    judged = [n for n in still if weights[n] > SET]
    if not any(_norm(as_taken[n]) / weights[n] >= BLOWN for n in judged):
        return None  # the updates the run takes are of a size a learning rate is picked for: a constant of the recipe
    comparison.rows["optimizer"] = gradient_rows("optimizer", {n: taken[n] for n in names}, ref, 1.0)
    worst = max(judged, key=lambda n: _norm(as_taken[n]) / weights[n])
    low = any(p.dtype in (torch.float16, torch.bfloat16) for p in params.values())
    return Measured(
        scale, still, len(names), before, after, worst, _norm(as_taken[worst]) / weights[worst],
        _norm(fixed[worst]) / weights[worst], _norm(meant[worst]) / weights[worst], low,
    )  # fmt: skip


def finding(
    measured: Measured, step: int, at: Where | None, optimizer: str, *, seen: Between | None, here: dict[str, Any]
) -> Finding:
    """TRN036: the gradients the optimizer took still carry the loss scale the script multiplied the loss by.
    `seen`: the script's lines between its last backward and its optimizer's step (between.py), where the
    division goes (after every micro-batch's backward) and the optimizer as the script names it."""
    m = measured
    line = f"line {at[1]} of {os.path.basename(at[0])}" if at else "its backward"
    every = len(m.still) == m.compared
    names = ", ".join(f"`{n}`" for n in m.still[:SHOWN]) + (", ..." if len(m.still) > SHOWN else "")
    which = (
        f"nothing divided the gradients by it: {optimizer} took every gradient"
        if every
        else f"the gradients of {len(m.still)} of {m.compared} parameters ({names}) were not divided by it: "
        f"{optimizer} took them"
    )
    message = (
        f"Step {step}: the backward at {line} ran on the loss multiplied by {m.scale:g} (a loss scale written by "
        f"hand; no GradScaler ran), and {which} {m.scale:g}x the reference step's (the same step from the same "
        "weights and batch in fp32, no loss scaling), while the "
        f"backward's, the scale divided out, agree with it. The update of `{m.worst}` is {m.to_weight:.3g} of its "
        f"weight's norm in one step (on the reference's gradients, {m.to_weight_reference:.3g}); {m.departed} of "
        f"{m.compared} updates depart from the reference's by more than {RATIO:g}x."
    )
    # just before the step: after every micro-batch's backward (a division after each one divides the first again)
    where = "just before the optimizer's step, after the last backward"
    if seen is not None:
        text = linecache.getline(seen.path, seen.step).strip()
        where = f"just before the optimizer's step (line {seen.step} of {os.path.basename(seen.path)}: `{text}`)"
    opt = (seen.optimizer if seen is not None else None) or "optimizer"
    divide = (
        f'`for p in [p for g in {opt}.param_groups for p in g["params"] if p.grad is not None]: '
        f"p.grad.div_({m.scale:g})`"
    )
    # GradScaler's unscale_ refuses fp16 gradients: offered for fp32 weights (the forward under autocast) alone
    scaler = (
        ""
        if m.low_precision
        else " (or use torch.amp.GradScaler, which divides the scale out and skips the steps that overflow: "
        f"`scaler.scale(loss).backward(); scaler.step({opt}); scaler.update()`)"
    )
    if every:
        fix = f"Divide every gradient by {m.scale:g} {where}: {divide}{scaler}"
    else:
        fix = (
            f"Divide every gradient by {m.scale:g} once, {where}: your code divides {m.compared - len(m.still)} of "
            f"them and misses {names}; put {divide} in place of its division{scaler}"
        )
    return catalog.make(
        "loss-scale-not-undone",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "optimizer", "step": step, **here},
        evidence={
            "step": step,
            "scale": m.scale,
            "location": f"{at[0]}:{at[1]}" if at else None,
            "still_scaled": m.still[:8],
            "still_scaled_count": len(m.still),
            "compared": m.compared,
            "update_to_weight": {
                "parameter": m.worst,
                "as_taken": m.to_weight,
                "divided": m.to_weight_undone,
                "reference": m.to_weight_reference,
            },
        },
        trial=Trial.checked(
            f"the optimizer's step on copies of the weights and its state, the gradients divided by {m.scale:g}",
            metric=f"updates that depart from the reference step's by more than {RATIO:g}x (of {m.compared})",
            before=m.departed,
            after=m.departed_undone,
            on=f"step {step}",
        ),
    )


@dataclass(frozen=True)
class Twice:
    """What the reference step measured of a step whose loss was divided by its micro-batch count twice."""

    k: int
    compared: int
    departed: int  # updates on the gradients as taken outside RATIO of those on k times them
    worst: str  # the parameter whose update, made on k times the gradients, is largest against its weight
    to_weight: float  # its update's norm over its weight's, as taken
    to_weight_fixed: float  # on k times the gradients


def measure_twice(
    comparison: Comparison, optimizer: torch.optim.Optimizer, model: nn.Module, taken: dict[str, torch.Tensor], k: int
) -> Twice | None:
    """The optimizer's step on copies on the gradients as taken (`taken`, unscaled) and on k times them.
    None where the code between the backward and the step changed their size (a clip that binds sets it
    whatever the loss's factor), or where the updates agree (an adaptive optimizer)."""
    back = comparison.backward_grads or {}
    names = [n for n in taken if n in back and _norm(back[n]) > TINY]
    if not names or any(abs(_norm(taken[n]) / _norm(back[n]) - 1.0) > 1e-3 for n in names):
        return None
    as_taken = step_on_copies(optimizer, model, {n: taken[n] for n in names}, fp32=False)
    fixed = step_on_copies(optimizer, model, {n: taken[n] * k for n in names}, fp32=False)
    if not all(math.isfinite(_norm(u)) for u in (*as_taken.values(), *fixed.values())):
        return None
    departed = 0
    for n, u in as_taken.items():  # an update that follows the gradients' size (SGD) is 1/k of the mean's
        meant = _norm(fixed[n])
        departed += meant > TINY and abs(_norm(u) / meant * k - 1.0) <= FOLLOWS
    if not departed:
        return None
    comparison.rows["optimizer"] = gradient_rows("optimizer", {n: taken[n] for n in names},
                                                 {n: taken[n] * k for n in names}, 1.0)  # fmt: skip
    weights = _weight_norms(dict(named_parameters(model)), fixed)
    worst = max(fixed, key=lambda n: _norm(fixed[n]) / weights[n])
    return Twice(k, len(names), departed, worst, _norm(as_taken[worst]) / weights[worst],
                 _norm(fixed[worst]) / weights[worst])  # fmt: skip


def twice_finding(measured: Twice, step: int, at: Where | None, optimizer: str, *, here: dict[str, Any]) -> Finding:
    """TRN037: every backward of the step ran on the loss divided by its micro-batch count twice."""
    m = measured
    line = f"line {at[1]} of {os.path.basename(at[0])}" if at else "its backward"
    message = (
        f"Step {step}: each of the step's {m.k} backwards (the last at {line}) ran on the loss divided by "
        f"{m.k * m.k}, {m.k} x {m.k}: the loss was divided by the number of micro-batches twice, and the gradients "
        f"{optimizer} took are 1/{m.k} of their mean over the step's micro-batches. The update of `{m.worst}` is "
        f"{m.to_weight:.3g} of its weight's norm where the mean's would be {m.to_weight_fixed:.3g}; {m.departed} of "
        f"{m.compared} updates are {m.k}x smaller than the mean's."
    )
    fix = (
        f"Divide the loss by {m.k} once: it reaches the backward at {line} divided by {m.k * m.k}. Drop one of the two "
        f"divisions (a loss function that already returns `loss / {m.k}`, and the loop's own `/ {m.k}` before the "
        "backward)"
    )
    return catalog.make(
        "loss-divided-twice",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": "backward", "step": step, **here},
        evidence={
            "step": step,
            "micro_batches": m.k,
            "divisor": m.k * m.k,
            "location": f"{at[0]}:{at[1]}" if at else None,
            "compared": m.compared,
            "departed": m.departed,
            "update_to_weight": {"parameter": m.worst, "as_taken": m.to_weight, "divided_once": m.to_weight_fixed},
        },
        trial=Trial.checked(
            f"the optimizer's step on copies of the weights and its state, the gradients {m.k} times larger (the "
            f"loss divided by {m.k} once; the code between the backward and the step left them as they were)",
            metric=f"the update of `{m.worst}` over its weight's norm",
            before=m.to_weight,
            after=m.to_weight_fixed,
            on=f"step {step}",
        ),
    )
