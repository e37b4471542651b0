"""Gradients cleared between the backward and the optimizer's step: `zero_grad()` in the wrong place.

`loss.backward(); optimizer.zero_grad(); optimizer.step()` steps on no gradient: every `.grad` is
None (or zero) when the optimizer runs, so the weights never move (AdamW's decoupled weight decay
still shrinks them). Nothing is NaN, the loss is flat, and a judge of values sees a healthy run.

Watched: `Optimizer.zero_grad` and `Module.zero_grad` (wrapped at class level while the watch runs)
note their caller's line when a backward ran since the last optimizer step, and only then; at the
step, such a call that cleared this optimizer's parameters (its own zero_grad, or a module's that
holds one of them) is confirmed by the gradients themselves: all None, or all zero (one host read,
on that step only). A step whose calls come in the usual order (zero_grad before the forward, or
after the step) pays one flag test per call.

The same call between two backward passes of one step, made at the same statement (a micro-batch
loop with `zero_grad()` inside it), leaves the step the last micro-batch's gradients: each earlier
backward's were cleared before any step read them. Told apart from a backward run for another
purpose (an input's gradient for an adversarial example, cleared before the real loss's backward)
by its call site: the frames that called the backward (code and line, a few deep), the same for
the cleared and the kept pass, and from a step the script skipped (its gradients cleared by the
next iteration's zero_grad) by happening on STREAK steps in a row. Each backward pays for reading
those few frames.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

# (file, line, function) of the user's call, as userframes.user_location gives it
Where = tuple[str, int, str]
STREAK = 2  # steps in a row whose earlier micro-batches' gradients were cleared before it is said
HELD = 64  # such clears held at most until a step reads them
SITE_DEPTH = 6  # frames read for a backward's call site: through a framework's backward(loss) to the user's line


@dataclass(frozen=True)
class Cleared:
    """One optimizer step taken on gradients cleared after the step's backward."""

    where: Where | None  # the line that cleared them: the zero_grad() call, or the statement read from the source
    owner: str  # "optimizer" or "module" (whose zero_grad it was), or "code" (a statement: `p.grad = None`)
    set_to_none: bool  # the gradients were None (else zeros)
    params: int  # the optimizer's parameters that require a gradient
    step_at: Where | None = None  # the line that stepped the optimizer
    via: Where | None = None  # where the clear is inside a helper: the line in the step's function that called it
    text: str | None = None  # the clearing statement's source, where read from it
    # backward passes of this step, at the statement the kept one ran at, whose gradients the call cleared
    # before the step (a zero_grad() inside the micro-batch loop); 0 where the step got no gradient at all
    discarded: int = 0


class GradClears:
    """Records zero_grad() calls made after a backward and before the next optimizer step."""

    def __init__(self) -> None:
        self._backward = False  # a backward ran since the last optimizer step
        # (the optimizer or module, its callers' lines in the user's code innermost first, the call site of
        # the backward whose gradients it cleared)
        self._calls: list[tuple[Any, list[Where], tuple[Any, ...]]] = []
        self._site: tuple[Any, ...] = ()  # the last backward's call site (call_site)
        # clears between two backward passes at one call site: (owner, frames, site), one per pass, at most
        # HELD (a step taken with a closure, Lightning's, never reaches `stepped`)
        self._between: list[tuple[Any, list[Where], tuple[Any, ...]]] = []
        # each cleared owner's gradients as the last backward after such a clear left them, by parameter: a
        # step that reads others (combined by the script: PCGrad, per-sample clipping) took no micro-batch alone
        self._left: dict[int, dict[int, weakref.ref[torch.Tensor]]] = {}
        # per optimizer: its steps in a row that took such passes' last alone, or -1 once one step did not (a
        # micro-batch loop's clear does it at every step from the first; a spike guard's skip, after clean steps)
        self._streak: dict[int, int] = {}

    @property
    def after_backward(self) -> bool:
        """A backward ran since the last optimizer step: a zero_grad() now is noted."""
        return self._backward

    @property
    def noted(self) -> bool:
        """A zero_grad() was called after a backward and before this step."""
        return bool(self._calls or self._between)

    def passed(self, optimizer: Any = None) -> None:
        """An optimizer step with nothing noted."""
        self._backward = False
        if optimizer is not None:
            self._streak[id(optimizer)] = -1

    def backward(self, site: tuple[Any, ...] = ()) -> None:
        """After a backward called from `site`: the clears before it were the usual ones, unless they
        cleared the gradients of a backward at the same site (a micro-batch loop's)."""
        self._backward = True
        if self._calls:
            again = [(o, frames, site) for o, frames, cleared in self._calls if site and cleared == site]
            self._between += again[: max(0, HELD - len(self._between))]
            for owner, _, _ in again:  # the gradients this backward left, read at the step
                self._left[id(owner)] = {id(p): weakref.ref(p.grad) for p in _params(owner) if p.grad is not None}
            self._calls.clear()
        self._site = site

    def zero_grad(self, owner: Any, frames: list[Where]) -> None:
        self._calls.append((owner, frames, self._site))

    def stepped(self, optimizer: Any, step_at: Where | None) -> Cleared | None:
        """At `optimizer`'s step: the clear that left it no gradient, confirmed by its gradients, or the
        clears that left it the last micro-batch's; None on the usual step (no call noted: nothing read)."""
        calls, self._calls, self._backward = self._calls, [], False
        if not calls and not self._between:
            self._streak[id(optimizer)] = -1
            return None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
        mine = {id(p) for p in params}

        def clears_mine(o: Any) -> bool:
            return o is optimizer or (isinstance(o, nn.Module) and _holds(o, mine))

        between = [e for e in self._between if clears_mine(e[0])]
        self._between = [e for e in self._between if not clears_mine(e[0])]  # another optimizer's, for its step
        # passes of the statement whose backward the step takes (per-sample gradients cleared in a loop of
        # their own, before another backward that the step takes, are no micro-batches of it), whose gradients
        # the step reads as that backward left them
        discarded = [(o, f) for o, f, site in between if site == self._site and self._as_left(o, params)]
        streak = self._streak.get(id(optimizer), 0)
        streak = -1 if streak < 0 or not discarded else streak + 1  # -1: it took a whole step's once
        self._streak[id(optimizer)] = streak
        if streak < STREAK:
            discarded = []
        owner, frames = next(((o, f) for o, f, _ in calls if clears_mine(o)), (None, []))
        grads = [p.grad for p in params if p.grad is not None]
        if owner is not None and params and grads and any(bool(g.detach().ne(0).any()) for g in grads):
            owner = None  # a backward after it, or a clear of parameters the step does not take
        if owner is None and discarded and grads:
            owner, frames = discarded[0]  # the step got the last micro-batch's gradients alone
        elif owner is None or not params:
            return None
        else:
            discarded = []
        kind = "optimizer" if owner is optimizer else "module"
        where = frames[0] if frames else None
        # a zero_grad() inside a helper: the helper's call in the function that steps is the line to move
        via = next((f for f in frames[1:] if step_at is not None and f[0] == step_at[0] and f[2] == step_at[2]), None)
        return Cleared(where, kind, not grads, len(params), step_at, via, discarded=len(discarded))

    def _as_left(self, owner: Any, params: list[torch.Tensor]) -> bool:
        """The step's gradients are those the last backward left after `owner`'s clear (the same tensors,
        written in place at most: a clip), not others the script put there."""
        left = self._left.get(id(owner))
        if not left:
            return False
        return all(p.grad is None or ((ref := left.get(id(p))) is not None and ref() is p.grad) for p in params)


def _params(owner: Any) -> list[torch.Tensor]:
    if isinstance(owner, nn.Module):
        return list(owner.parameters())
    return [p for group in getattr(owner, "param_groups", ()) for p in group["params"]]


def call_site(frame: FrameType | None) -> tuple[Any, ...]:
    """A backward's call site: (code, line) of the frames that called it, SITE_DEPTH deep. Equal for two
    passes of one statement in a loop, whoever's code (a framework's backward(loss)) runs in between."""
    site: list[tuple[Any, int]] = []
    while frame is not None and len(site) < SITE_DEPTH:
        site.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(site)


def _holds(module: nn.Module, ids: set[int]) -> bool:
    return any(id(p) in ids for p in module.parameters())


def zero_grad_owners() -> tuple[type, ...]:
    """The classes whose zero_grad() the watch wraps."""
    return (torch.optim.Optimizer, nn.Module)
