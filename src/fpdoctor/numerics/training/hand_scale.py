"""A loss scale written by hand and never divided out: `(loss * 1024).backward()` with no GradScaler,
then `optimizer.step()` on gradients still 1024 times too large.

The scale is read from the backward's root: a chain of multiplications and divisions by constants
ends at it (`loss * 1024 / accum`), and a constant multiplier that is a power of two of at least
LEAST is a loss scale (powers of two scale fp16 values exactly, which is why hand-written scales are
one; a loss weight of 10 or 0.5 is not taken for one). The reference step divides it out of both
runs, as it divides a GradScaler's: the backward stage then agrees, and the gradients the optimizer
took are compared with the backward's here. A parameter whose gradient is the scale times the
backward's was never divided.

What it costs is measured on copies (reference_update.step_on_copies): the optimizer's step on the
gradients as taken, on the same gradients with the scale divided out, and on the reference's, each
from the same weights and state. An optimizer that follows the gradients' size (SGD) steps the
scale times too far; one that divides by their running size (Adam) steps as meant but for its eps,
and its update agrees with the reference's: no finding there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.observe.grad_clears import Where
from fpdoctor.numerics.training.reference import RATIO, TINY, Comparison, gradient_rows
from fpdoctor.numerics.training.reference_update import step_on_copies
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import constant_operand, named_parameters

LEAST = 128.0  # 2**7: the smallest constant multiplier taken for a loss scale
CHAIN = 4  # constant multiplications and divisions read down from the root: `loss * 1024 / accum`
SAME = 0.05  # a gradient within 5% of the scale times the backward's still carries the scale
SHOWN = 4  # parameters named in the message


def of_root(root: torch.Tensor) -> float | None:
    """The loss scale a backward's root carries: the product of the powers of two of at least LEAST it
    was multiplied by, in the chain of constant multiplications and divisions that ends at it; None where
    there is none. A few attribute reads per backward."""
    node: Any = root.grad_fn
    scale = 1.0
    for _ in range(CHAIN):
        kind = type(node).__name__
        if kind not in ("MulBackward0", "DivBackward0"):
            break
        constant = constant_operand(node)
        if constant is None:
            break
        if kind == "MulBackward0" and constant >= LEAST and math.log2(constant).is_integer():
            scale *= constant
        operands = [n for n, _ in node.next_functions if n is not None]
        if len(operands) != 1:
            break
        node = operands[0]
    return scale if scale > 1.0 else None


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


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


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
    weights = {n: max(_norm(p.detach()), TINY) for n, p in named_parameters(model) if n in as_taken}

    if not all(math.isfinite(_norm(u)) for u in meant.values()):
        return None  # the optimizer's own step fails on the reference's gradients (fp16 Adam's eps): not the scale

    def departed(updates: dict[str, torch.Tensor]) -> int:
        out = 0
        for n, u in updates.items():
            reference = _norm(meant[n])
            ratio = _norm(u) / reference if reference > TINY else (math.inf if _norm(u) > TINY else 1.0)
            out += not 1.0 / RATIO <= ratio <= RATIO  # a NaN ratio (an Inf update) departs too
        return out

    before = departed(as_taken)
    if departed(fixed) >= before:
        return None  # the updates agree (Adam divides the factor out), or dividing does not bring them back
    comparison.rows["optimizer"] = gradient_rows("optimizer", {n: taken[n] for n in names}, ref, 1.0)
    worst = max(as_taken, key=lambda n: _norm(as_taken[n]) / weights[n])
    return Measured(
        scale, still, len(names), before, departed(fixed), worst, _norm(as_taken[worst]) / weights[worst],
        _norm(fixed[worst]) / weights[worst], _norm(meant[worst]) / weights[worst],
    )  # fmt: skip


def finding(measured: Measured, step: int, at: Where | None, optimizer: str, *, here: dict[str, Any]) -> Finding:
    """TRN036: the gradients the optimizer took still carry the loss scale the script multiplied the loss by."""
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
    where = f"after the backward at {line} and before the optimizer's step" if at else "before the optimizer's step"
    divide = f"`for p in model.parameters(): p.grad.div_({m.scale:g})`"
    scaler = (
        "torch.amp.GradScaler, which divides the scale out and skips the steps that overflow: "
        "`scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()`"
    )
    if every:
        fix = f"Divide every gradient by {m.scale:g} {where}: {divide} (or use {scaler})"
    else:
        fix = (
            f"Divide every gradient by {m.scale:g} once, {where}: your code divides {m.compared - len(m.still)} of "
            f"them and misses {names}; put {divide} in place of its division (or use {scaler})"
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
