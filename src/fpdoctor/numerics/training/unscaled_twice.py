"""A step whose gradients were unscaled before its last backward (observe/scaler_order.py): what it
cost, measured on the reference step, and where the calls go, read from the script.

The reference step's replay of the step's backward sums every micro-batch's gradients and divides
the loss scale out once: exactly what the optimizer receives once unscale_ runs after the last
backward. Against the fp32 reference, the gradients the optimizer took and that sum are each
compared by their direction (the worst parameter's cosine); their norms are not, since the
script's clip sets them on purpose. Before -> after is the fix's effect on the gradients the
optimizer steps on, computed from the replay, not run.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.observe.scaler_order import Mixed
from fpdoctor.numerics.training import between, reference
from fpdoctor.report.model import Finding, Severity, Trial


@dataclass(frozen=True)
class Measured:
    """What the reference step measured of a step that unscaled before its last backward."""

    taken: float  # the worst cosine with the reference of a gradient the optimizer took
    fixed: float  # of the step's own backward unscaled once (what the fix hands the optimizer)
    norm: float  # the total norm of what the optimizer took over that of the backward unscaled once


def measure(comparison: reference.Comparison, taken: dict[str, torch.Tensor]) -> Measured | None:
    """None where the reference step has nothing to compare."""
    back, ref = comparison.backward_grads, comparison.reference_grads
    if not back or not ref:
        return None
    names = [n for n in taken if n in back]
    before = reference.worst_cosine({n: taken[n] for n in names}, ref)
    after = reference.worst_cosine(back, ref)
    if before is None or after is None:
        return None
    total = math.sqrt(sum(float(back[n].double().square().sum()) for n in names))
    got = math.sqrt(sum(float(taken[n].double().square().sum()) for n in names))
    return Measured(before, after, got / total if total > 0 else math.nan)


def finding(mixed: Mixed, step: int, *, measured: Measured | None, why_not: str, here: dict[str, Any]) -> Finding:
    """`unscaled-then-accumulated`: checked where the reference step measured it, else why not."""
    scale = mixed.scale
    where = mixed.unscale_at
    at = f" (line {where[1]} of {os.path.basename(where[0])})" if where is not None else ""
    message = (
        f"At step {step}, a backward added gradients still multiplied by the loss scale ({scale:g}) to gradients "
        f"that scaler.unscale_ had already divided by it: unscale_{at} ran {mixed.unscales} time(s) for this one "
        f"optimizer step, with {mixed.backwards_after} backward(s) after it. Each unscale_ divides what is already "
        f"there once more, so the gradients of every micro-batch but the last reach the optimizer divided by the "
        f"scale again ({1 / scale:.2g} of their weight, or less): the optimizer steps on the last micro-batch "
        "alone, and nothing is NaN or skipped."
    )
    if mixed.updates:
        up = mixed.update_at
        at_update = f" (line {up[1]})" if up is not None else ""
        message += (
            f" scaler.update(){at_update} ran {mixed.updates} time(s) before the step: GradScaler refuses a second "
            "unscale_ in one step unless update() runs between, and each such update() also counts toward the "
            "scale's growth."
        )
    found = between.accumulation(where[0], where[1]) if where is not None else None
    scaler, optimizer = (found.scaler, found.optimizer) if found is not None else (None, None)
    scaler, optimizer = scaler or "scaler", optimizer or "optimizer"
    fix = (
        f"Unscale once per optimizer step: after the last micro-batch's backward, call {scaler}.unscale_({optimizer}), "
        f"then any clip, {scaler}.step({optimizer}) and {scaler}.update(), once each"
    )
    if found is not None and found.moved:
        line, text = found.loop
        fix += (
            f": in {os.path.basename(found.path)} move {found.listed(found.moved)} out of the loop at line {line} "
            f"(`{text}`) to after it, in that order"
        )
        if found.removed:
            fix += f", and delete {found.listed(found.removed)} (the update() after the step stays)"
    if measured is not None:
        before, after = measured.taken, measured.fixed
        message += (
            f" At step {step} the gradients the optimizer took have cosine {before:.3f} with the fp32 reference "
            f"step's (every micro-batch, worst parameter), and {measured.norm:.3g}x the norm of the micro-batches' "
            f"gradients summed and unscaled once; those have cosine {after:.3f}."
        )
        trial = Trial.checked(
            "the step's micro-batches' gradients summed and unscaled once, as the fix hands them to your clip (a "
            "clip of their norm keeps their direction): computed from the step's replayed backward, not run",
            metric="worst cosine of a parameter's gradient with the fp32 reference step's",
            before=round(before, 4), after=round(after, 4), on=f"step {step}",
        )  # fmt: skip
    else:
        trial = Trial.untried(f"the reference step did not measure it: {why_not}")
    return catalog.make(
        "unscaled-then-accumulated",
        message=message,
        fix=fix,
        severity=Severity.ERROR,
        where={"module": None, "op": None, "phase": "optimizer", "step": step, **here},
        evidence={
            "step": step,
            "loss_scale": scale,
            "unscale_calls": mixed.unscales,
            "backwards_after_unscale": mixed.backwards_after,
            "update_calls_before_step": mixed.updates,
            "unscale_line": list(where[:2]) if where is not None else None,
            "cosine_taken": measured.taken if measured is not None else None,
            "cosine_fixed": measured.fixed if measured is not None else None,
            "norm_taken_over_fixed": measured.norm if measured is not None else None,
        },
        trial=trial,
    )
