"""The learning-rate advice of a stalled run, tried: a few steps with the rate lowered, on stand-ins.

When a run stops progressing after its loss climbed, the evidence points at the learning rate.
Before "lower it" is printed, it is lowered. The steps that were skipped cannot show it: their
forward was already non-finite at the weights they started from, whatever the rate. So when a
climb starts, the state its first step started from is kept (`Snapshot`: the weights and the
optimizer's state, before that step's update, with the step's window), and when the run then
stalls, `LR_STEPS` optimizer steps on that step's batch are run from it, on copies: at the run's
learning rate, then at the rate divided by `FACTOR`, by `FACTOR` again, ... (`LADDER` rates at
most) until the steps stay finite and the loss does not climb. The finding says what each rate
gave and the rate that settled, or why it could not be tried.

The user's model runs with stand-in tensors (`torch.nn.utils.stateless`, as the fp32 control
replay does): its parameters, their gradients, its buffers, its optimizer and the RNG are as they
were afterwards. Cost: the snapshot (one copy of the trainable weights and of the optimizer state,
on their device, up to `SNAPSHOT_BYTES`; none above it) once per climb, and (LR_STEPS + 1)
forward+backward passes per rate, once per stalled episode (LONGER times as many where the run's
own rate settles in LR_STEPS: a climb driven by momentum takes more steps to show).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe import lr_schedule
from fpdoctor.numerics.observe.lr_schedule import Schedule
from fpdoctor.numerics.updates.measure import no_global_optimizer_hooks
from fpdoctor.numerics.updates.whatif import copy_optimizer
from fpdoctor.preserve import preserved
from fpdoctor.torchprivate import named_parameters, reparametrized

LR_STEPS = 4
LONGER = 4  # where the run's own rate settles over LR_STEPS steps, every arm runs LONGER times as many
FACTOR = 10.0
LADDER = 3  # lower rates tried at most: lr / 10, / 100, / 1000
SNAPSHOT_BYTES = 1 << 30  # a larger model is not copied: the finding says so


@dataclass(frozen=True)
class Snapshot:
    """The state a step started from, before its update, and how to run that step again."""

    step: int
    weights: dict[str, torch.Tensor]  # detached copies of the trainable parameters, by name
    state: dict[str, Any]  # the optimizer's state_dict, copied
    run_step: Callable[[], Any]  # forward and backward of the step's window; its loss or None
    scale: float | None  # the GradScaler scale its gradients carry
    # the state after the step's update: a GradScaler's step (or an optimizer that skips on the
    # device) updates the weights before the step is judged, so the state before it is gone
    after_update: bool = False
    first: bool = True  # the climb's first step (False: a later step of it, the first kept no state)


def snapshot(
    model: nn.Module,
    optimizer: Any,
    step: int,
    run_step: Callable[[], Any],
    scale: float | None,
    *,
    after_update: bool = False,
    first: bool = True,
) -> Snapshot | str:
    """The state `step` starts from, or why it is not kept (too large, no optimizer)."""
    if optimizer is None:
        return "no optimizer was given to step"
    named = [(n, p) for n, p in named_parameters(model) if p.requires_grad]
    size = sum(p.numel() * p.element_size() for _, p in named)
    state_size = sum(
        t.numel() * t.element_size()
        for per_param in optimizer.state.values()
        for t in per_param.values()
        if isinstance(t, torch.Tensor)
    )
    if size + state_size > SNAPSHOT_BYTES:
        return (
            f"a copy of the weights and optimizer state ({(size + state_size) / 2**20:.0f} MiB) is more than the "
            f"{SNAPSHOT_BYTES / 2**20:.0f} MiB this check may hold"
        )
    weights = {n: p.detach().clone() for n, p in named}
    return Snapshot(step, weights, copy.deepcopy(optimizer.state_dict()), run_step, scale, after_update, first)


@dataclass(frozen=True)
class Arm:
    lr: float
    losses: list[float] = field(default_factory=list)  # each forward's loss (nan: unseen)
    bad_at: int | None = None  # the forward (from 1) whose loss or gradients were non-finite

    @property
    def finite(self) -> bool:
        return self.bad_at is None

    @property
    def settles(self) -> bool:
        """Finite, and the loss did not climb over the steps (where a loss is seen)."""
        seen = [v for v in self.losses if math.isfinite(v)]
        return self.finite and (len(seen) < 2 or seen[-1] <= seen[0])

    @property
    def loss_seen(self) -> bool:
        """A loss was seen on the steps (`fpdoctor watch` replays the model alone: only its gradients)."""
        return any(math.isfinite(v) for v in self.losses)

    def said(self) -> str:
        seen = [v for v in self.losses if math.isfinite(v)]
        trend = f" (loss {_num(seen[0])} -> {_num(seen[-1])})" if len(seen) >= 2 else ""
        if not self.finite:
            return f"went non-finite after {(self.bad_at or 1) - 1} of them{trend}"
        if not seen:
            return "kept their gradients finite"
        return ("stayed finite" if self.settles or len(seen) < 2 else "stayed finite but the loss climbed") + trend


@dataclass(frozen=True)
class LrTrial:
    """What LR_STEPS steps from the snapshot gave at the run's learning rate and at lower ones."""

    from_step: int | None
    steps: int = LR_STEPS
    as_is: Arm | None = None
    lowered: list[Arm] = field(default_factory=list)  # lr / FACTOR, / FACTOR**2, ... up to the first that settles
    seconds: float = 0.0
    why_not: str | None = None  # why it was not tried, or what failed
    after_update: bool = False  # from the state after the step's update (Snapshot.after_update)
    first: bool = True  # from the climb's first step (Snapshot.first)
    schedule: Schedule | None = None  # the scheduler that raised the rate to the run's (lr_schedule.py)

    @property
    def start(self) -> str:
        """Where the trial's steps started from, in words."""
        if self.after_update:
            return (
                f"the weights and optimizer state after step {self.from_step}'s update (in the climb; a GradScaler's "
                "step updates the weights before the step is judged)"
            )
        first = "the first of the climb" if self.first else "in the climb; its first step kept no state"
        return f"the weights and optimizer state step {self.from_step} started from ({first})"

    @property
    def origin(self) -> str:
        """`start`, short."""
        if self.after_update:
            return f"the state after step {self.from_step}'s update (in the climb)"
        return "the climb's first step" if self.first else f"step {self.from_step}'s state (in the climb)"

    @property
    def separates(self) -> bool:
        """The trial tells the rates apart: at the run's rate the steps went non-finite or the loss
        climbed, at a lower one they did not (the evidence that the rate is the cause)."""
        return self.as_is is not None and not self.as_is.settles and self.best is not None

    @property
    def best(self) -> Arm | None:
        """The highest lowered rate whose steps stayed finite with a loss that did not climb."""
        return next((arm for arm in self.lowered if arm.settles), None)

    def evidence(self) -> dict[str, Any]:
        if self.why_not is not None or self.as_is is None:
            return {"not_tried": self.why_not}
        return {
            "from_step": self.from_step,
            **({"after_update": True} if self.after_update else {}),
            "steps": self.steps,
            "lr": self.as_is.lr,
            "as_is": {"finite": self.as_is.finite, "losses": self.as_is.losses},
            "lowered": [
                {"lr": a.lr, "finite": a.finite, "settles": a.settles, "losses": a.losses} for a in self.lowered
            ],
            "fix_lr": self.best.lr if self.best is not None else None,
            "seconds": round(self.seconds, 3),
        }

    def text(self) -> str:
        """What was tried and what it gave, for the finding's message."""
        if self.why_not is not None or self.as_is is None:
            return f" Lowering the learning rate was not tried: {self.why_not}."
        arms = "; ".join(f"at lr {_num(a.lr)} they {a.said()}" for a in self.lowered)
        head = (
            f" Tried from {self.start}, {self.steps} steps on its batch: at the run's lr {_num(self.as_is.lr)} "
            f"they {self.as_is.said()}; {arms}"
        )
        best = self.best
        if best is not None and not self.as_is.settles and not best.loss_seen:
            said = head + f": lr {_num(best.lr)} keeps their gradients finite (checked; the loss is not seen here)."
        elif best is not None and not self.as_is.settles:
            said = head + f": lr {_num(best.lr)} keeps them finite and the loss from climbing (checked)."
        elif best is not None:
            said = head + ": on this batch the run's rate settles too, so the trial does not separate them."
        else:
            said = head + ": no lower learning rate tried kept them finite with a loss that did not climb."
        return said + (self.schedule.text() if self.schedule is not None else "")


def _num(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.4g}"


def try_lower_lr(model: nn.Module, optimizer: Any, snap: Snapshot, *, steps: int = LR_STEPS) -> LrTrial:
    """The run's rate, then lr / FACTOR, / FACTOR**2, ... (LADDER rates) until one settles, each from
    `snap` on stand-ins; never raises (a failure is in `why_not`)."""
    start = time.perf_counter()
    named = [(n, p) for n, p in named_parameters(model) if p.requires_grad and n in snap.weights]
    saved_grads = [(p, p.grad) for _, p in named]
    arms: list[Arm] = []
    try:
        lr = _lr(snap.state, optimizer)
        if lr is None:
            return LrTrial(snap.step, why_not="the optimizer has no learning rate to lower")
        with preserved(model):
            as_is = _arm(model, optimizer, snap, named, factor=1.0, steps=steps)
            if as_is.settles:  # a divergence with momentum takes more steps to show: LONGER times as many
                steps *= LONGER
                as_is = _arm(model, optimizer, snap, named, factor=1.0, steps=steps)
            arms.append(as_is)
            for rung in range(1, LADDER + 1):
                arms.append(_arm(model, optimizer, snap, named, factor=FACTOR**rung, steps=steps))
                if arms[-1].settles:
                    break
    except Exception as exc:
        return LrTrial(snap.step, why_not=f"it failed ({type(exc).__name__}: {exc})")
    finally:
        for p, g in saved_grads:
            p.grad = g
    schedule = lr_schedule.find(optimizer, arms[0].lr)  # the scheduler that raised the rate, where one did
    return LrTrial(
        snap.step,
        steps,
        arms[0],
        arms[1:],
        time.perf_counter() - start,
        after_update=snap.after_update,
        first=snap.first,
        schedule=schedule,
    )


def _lr(state: dict[str, Any], optimizer: Any) -> float | None:
    groups = state.get("param_groups") or getattr(optimizer, "param_groups", None) or []
    if not groups or "lr" not in groups[0]:
        return None
    value = groups[0]["lr"]
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def _arm(
    model: nn.Module,
    optimizer: Any,
    snap: Snapshot,
    named: list[tuple[str, nn.Parameter]],
    *,
    factor: float,
    steps: int,
) -> Arm:
    """`steps` steps at the snapshot's learning rate / `factor`, from the snapshot, on stand-ins."""
    weights = {n: snap.weights[n].clone().requires_grad_(True) for n, _ in named}
    opt = copy_optimizer(optimizer, {id(p): weights[n] for n, p in named})
    opt.load_state_dict(copy.deepcopy(snap.state))  # the state of the snapshot, not of now
    for group in opt.param_groups:
        group["lr"] = group["lr"] / factor
    lr = _lr({}, opt) or math.nan
    losses: list[float] = []
    with reparametrized(model, weights, tie_weights=True):
        for index in range(steps + 1):  # steps updates, each judged by the forward after it
            for w in weights.values():
                w.grad = None
            loss = snap.run_step()
            value = float(loss) if loss is not None else math.nan
            losses.append(value)
            grads = [w.grad for w in weights.values() if w.grad is not None]
            if snap.scale is not None:
                for g in grads:
                    g.div_(snap.scale)  # the scaler's scale out, as its unscale_ would
            if (loss is not None and not math.isfinite(value)) or not all(bool(torch.isfinite(g).all()) for g in grads):
                return Arm(lr, losses, index + 1)
            if index < steps:
                with no_global_optimizer_hooks():  # a stand-in step is not one of the user's steps
                    opt.step()
    return Arm(lr, losses)


def window_runner(
    window: list[Any], step_fn: Callable[..., Any], contexts: Callable[[], list[Any]]
) -> Callable[[], float | None]:
    """Forward and backward of a step's window (its micro-batches, their RNG states, what the step
    ran under), as the replay runs it; the mean loss, or None where a step_fn returns none."""
    import contextlib

    def run() -> float | None:
        losses = []
        for micro in window:
            micro.rng.restore()
            with contextlib.ExitStack() as stack:
                for context in contexts():
                    stack.enter_context(context)
                loss = step_fn(*micro.args, **micro.kwargs)
            if not isinstance(loss, torch.Tensor | float | int):
                return None  # an outputs-only step (`fpdoctor watch`): judged by its gradients
            losses.append(float(torch.as_tensor(loss).detach().float().mean()))
        return sum(losses) / len(losses) if losses else None

    return run
