"""The GradScaler's calls in the order a step makes them: a backward after `scaler.unscale_(optimizer)`.

`scaler.unscale_(opt)` divides the optimizer's gradients by the loss scale, in place. A backward
after it and before the optimizer's step adds gradients still multiplied by the scale to them, and
an unscale_ after that divides the sum once more: what was unscaled first is divided by the scale
twice (by 65536 again: 1.5e-5 of its weight). A gradient-accumulation loop that unscales (and
clips) on every micro-batch does exactly that: GradScaler raises at the second unscale_ of a step,
and a `scaler.update()` after each micro-batch silences it. The optimizer then steps on the last
micro-batch alone, with no NaN and nothing skipped.

Watched: each unscale_ the script calls (not the one scaler.step() makes for itself) opens a record
for its optimizer until that optimizer steps; a backward while one is open compares the optimizer's
gradients before and after it (each one's identity and version counter, and whether any held a
non-zero value). Nothing is read on a step whose calls come in the right order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.torchprivate import scaler_scale

# (file, line, function) of the user's call, as userframes.user_location gives it
Where = tuple[str, int, str]


@dataclass
class Mixed:
    """One optimizer step whose gradients mix unscaled and scaled ones."""

    unscales: int  # the script's unscale_ calls for this step
    backwards_after: int  # backwards that added to gradients already unscaled
    updates: int  # scaler.update() calls between the first unscale_ and the step
    unscale_at: Where | None  # the first unscale_'s line in the script
    update_at: Where | None  # the first of those update() calls
    scale_now: torch.Tensor | None  # the loss scale at the first unscale_ (a copy on its device: no host read)
    # backwards after the last unscale_: their gradients reach the optimizer still multiplied by the scale
    scaled_left: int = 0
    step_at: Where | None = None  # the line that stepped the optimizer
    # an update() after the last unscale_: the scaler forgot it, and scaler.step() unscales everything again
    reset: bool = False

    @property
    def scale(self) -> float:
        """Read on the host once the finding is made, never on a step."""
        return float(self.scale_now) if self.scale_now is not None else 1.0


@dataclass
class _Open:
    optimizer: Any
    record: Mixed


class ScalerOrder:
    """Records, per optimizer, what happened between the script's unscale_ and the optimizer's step."""

    def __init__(self) -> None:
        self._open: dict[int, _Open] = {}

    def unscaled(self, scaler: Any, optimizer: Any, where: Where | None) -> None:
        """After the script's `scaler.unscale_(optimizer)` (an enabled scaler's)."""
        found = self._open.get(id(optimizer))
        if found is not None:
            found.record.unscales += 1
            found.record.scaled_left, found.record.reset = 0, False
            return
        scale = scaler_scale(scaler)
        kept = scale.detach().clone() if isinstance(scale, torch.Tensor) else None
        self._open[id(optimizer)] = _Open(optimizer, Mixed(1, 0, 0, where, None, kept))

    def updated(self, where: Where | None) -> None:
        """After `scaler.update()`: counted for each step still open."""
        for found in self._open.values():
            found.record.updates += 1
            found.record.reset = True
            if found.record.update_at is None:
                found.record.update_at = where

    def around_backward(self) -> Callable[[], None] | None:
        """Before a backward: what to call after it (None when no unscale_ is waiting for its step). A
        backward into gradients cleared since the unscale_ (zero_grad, a step skipped by the script)
        starts a new step: what was unscaled is gone, and its record with it."""
        if not self._open:
            return None
        before = {}
        for key, found in list(self._open.items()):
            marks, live = _grads_now(found.optimizer)
            if live:
                before[key] = marks
            else:
                del self._open[key]

        def after() -> None:
            for key, found in self._open.items():
                marks = before.get(key)
                if marks is not None and _added_to(found.optimizer, marks):
                    found.record.backwards_after += 1
                    found.record.scaled_left += 1

        return after

    def stepped(self, optimizer: Any, where: Where | None) -> Mixed | None:
        """At the optimizer's step (`where`: its line): the record it closes, where a backward mixed
        its gradients."""
        found = self._open.pop(id(optimizer), None)
        if found is None or not found.record.backwards_after:
            return None
        found.record.step_at = where
        return found.record


def _grads(optimizer: Any) -> list[torch.Tensor | None]:
    return [p.grad for group in optimizer.param_groups for p in group["params"]]


def _grads_now(optimizer: Any) -> tuple[list[tuple[int, int] | None], bool]:
    """Each gradient's (identity, version) or None, and whether any holds a value other than 0 (a
    zero_grad(set_to_none=False) since the unscale_ leaves nothing to mix with): one read."""
    grads = _grads(optimizer)
    present = [g.detach() for g in grads if g is not None and g.numel()]
    with torch.no_grad():
        live = bool(torch.stack([(g != 0).any() for g in present]).any()) if present else False
    return [None if g is None else (id(g), g._version) for g in grads], live


def _added_to(optimizer: Any, marks: list[tuple[int, int] | None]) -> bool:
    """A gradient that held values and was written by the backward in place (accumulated into)."""
    grads = _grads(optimizer)
    if len(grads) != len(marks):
        return False
    return any(
        g is not None and m is not None and m[0] == id(g) and g._version != m[1]
        for g, m in zip(grads, marks, strict=True)
    )
