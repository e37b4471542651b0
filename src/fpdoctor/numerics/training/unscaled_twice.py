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

import dataclasses
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
    """What the reference step measured of a step that unscaled before its last backward: the gradients
    the optimizer took, and the step's own backward unscaled once (what the fix hands the optimizer),
    each against the fp32 reference step's."""

    taken: float  # the worst cosine of a parameter's gradient the optimizer took
    fixed: float  # of the backward's unscaled once
    taken_norm: float  # the total norm of what the optimizer took over the reference's
    fixed_norm: float  # of the backward's unscaled once over the reference's

    @property
    def by_direction(self) -> bool:
        """The direction departs (the norm may be a clip's): judged by the cosine, else by the norm."""
        return self.taken < reference.COSINE


def measure(comparison: reference.Comparison, taken: dict[str, torch.Tensor]) -> Measured | None:
    """None where the reference step has nothing to compare."""
    back, ref = comparison.backward_grads, comparison.reference_grads
    if not back or not ref:
        return None
    names = [n for n in taken if n in back and n in ref]
    before = reference.worst_cosine({n: taken[n] for n in names}, ref)
    after = reference.worst_cosine({n: back[n] for n in names}, ref)
    if before is None or after is None:
        return None

    def norm(grads: dict[str, torch.Tensor]) -> float:
        return math.sqrt(sum(float(grads[n].double().square().sum()) for n in names))

    total = norm(ref)
    if total <= 0:
        return None
    return Measured(before, after, norm(taken) / total, norm(back) / total)


def finding(mixed: Mixed, step: int, *, measured: Measured | None, why_not: str, here: dict[str, Any]) -> Finding:
    """`unscaled-then-accumulated`: checked where the reference step measured it, else why not."""
    scale = mixed.scale
    where = mixed.unscale_at
    at = f" (line {where[1]} of {os.path.basename(where[0])})" if where is not None else ""
    message = (
        f"At step {step}, a backward added gradients still multiplied by the loss scale ({scale:g}) to gradients "
        f"that scaler.unscale_ had already divided by it: unscale_{at} ran {mixed.unscales} time(s) for this one "
        f"optimizer step, with {mixed.backwards_after} backward(s) after it."
    )
    if mixed.scaled_left:
        message += (
            f" The gradients of the {mixed.scaled_left} backward(s) after the last unscale_ reach the optimizer still "
            f"multiplied by the scale, beside gradients divided by it: the step is {scale:g}x too large for them."
        )
    else:
        message += (
            " Each unscale_ divides what is already there once more, so the gradients of every micro-batch but the "
            f"last reach the optimizer divided by the scale again ({1 / scale:.2g} of their weight, or less): the "
            "optimizer steps on the last micro-batch alone."
        )
    if mixed.updates:
        up = mixed.update_at
        at_update = f" (line {up[1]})" if up is not None else ""
        message += (
            f" scaler.update(){at_update} ran {mixed.updates} time(s) before the step: GradScaler refuses a second "
            "unscale_ in one step unless update() runs between, and each such update() also counts toward the "
            "scale's growth."
        )
        if mixed.reset and not mixed.scaled_left:
            message += " The last one came after the last unscale_, so scaler.step() unscaled everything once more."
    message += " Nothing is NaN or skipped."
    fix, seen = _fix(mixed)
    if measured is not None:
        said = "cosine {:.3f}" if measured.by_direction else "{:.3g}x its norm"
        before, after = (
            (measured.taken, measured.fixed) if measured.by_direction else (measured.taken_norm, measured.fixed_norm)
        )
        message += (
            f" At step {step} the gradients the optimizer took have {said.format(before)} of the fp32 reference "
            f"step's (every micro-batch); the step's micro-batches summed and unscaled once, "
            f"{said.format(after)}."
        )
        metric = (
            "worst cosine of a parameter's gradient with the fp32 reference step's"
            if measured.by_direction
            else "the norm of the gradients the optimizer takes over the fp32 reference step's"
        )
        trial = Trial.checked(
            "the step's micro-batches' gradients summed and unscaled once, as the fix hands them to the optimizer "
            "(a clip of their norm keeps their direction): computed from the step's replayed backward, not run",
            metric=metric, before=round(before, 4), after=round(after, 4), on=f"step {step}",
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
            "backwards_after_last_unscale": mixed.scaled_left,
            "update_calls_before_step": mixed.updates,
            "unscale_line": list(where[:2]) if where is not None else None,
            "step_line": list(mixed.step_at[:2]) if mixed.step_at is not None else None,
            "lines_read": seen,
            **(dataclasses.asdict(measured) if measured is not None else {}),
        },
        trial=trial,
    )


def _fix(mixed: Mixed) -> tuple[str, bool]:
    """The fix, in the script's own names and lines where its source can be read (and whether it was)."""
    where, step_at = mixed.unscale_at, mixed.step_at
    scaler, optimizer = between.unscale_names(where[0], where[1]) if where is not None else (None, None)
    scaler, optimizer = scaler or "scaler", optimizer or "optimizer"
    fix = (
        f"Unscale once per optimizer step, after its last backward: call {scaler}.unscale_({optimizer}) and any "
        f"clip just before {scaler}.step({optimizer}), and {scaler}.update() once, just after it"
    )
    found = (
        between.accumulation(where[0], where[1], step_at[1])
        if where is not None and step_at is not None and where[0] == step_at[0]
        else None
    )
    if found is None or not found.moved:
        return fix, False
    line, text = found.step
    fix += f": in {os.path.basename(found.path)} move {found.listed(found.moved)} to just before line {line} (`{text}`)"
    if found.after:
        fix += f", and {found.listed(found.after)} to just after it"
    fix += ", in that order"
    if found.removed:
        fix += f"; delete {found.listed(found.removed)}"
    return fix, True
