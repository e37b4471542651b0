"""The learning-rate scheduler behind an optimizer's rate: where a climb's rate came from.

The rate at which a run diverges is often not the one its optimizer was built with: a warm-up with
no cap (`lr * step / warmup`), a cyclic or restarted schedule with the wrong period. "Lower the
learning rate" then reads as "lower the lr you passed", which is already low. Every torch scheduler
records the rate the optimizer was built with (`initial_lr` in each group); the scheduler itself is
found among the objects that refer to the optimizer (asked only when a finding is made), and a
LambdaLR's or MultiplicativeLR's function is named by its source line.
"""

from __future__ import annotations

import gc
import linecache
from dataclasses import dataclass
from typing import Any

RAISED = 1.5  # a rate this many times the one the optimizer was built with was raised by its schedule


@dataclass(frozen=True)
class Schedule:
    """The scheduler that set an optimizer's rate, and by how much it raised it."""

    kind: str  # its class: "LambdaLR"
    initial: float  # the rate the optimizer was built with (initial_lr)
    now: float  # the rate at the step in question
    where: tuple[str, int, str] | None  # (file, line, source) of a LambdaLR/MultiplicativeLR function

    @property
    def factor(self) -> float:
        return self.now / self.initial

    def text(self) -> str:
        """What the schedule did, for a finding's message."""
        at = f" (its function at line {self.where[1]}: `{self.where[2]}`)" if self.where is not None else ""
        return (
            f" The rate {self.now:.4g} is not the lr={self.initial:.4g} the optimizer was built with: its "
            f"{self.kind}{at} raised it {self.factor:.3g}x."
        )

    def fix(self, lr: float, why: str = "") -> str:
        """How to hold the schedule's rate at or below `lr` (`why`: that bound's reason, in brackets)."""
        cap = lr / self.initial
        if self.kind in ("LambdaLR", "MultiplicativeLR"):
            line = f" at line {self.where[1]}" if self.where is not None else ""
            return (
                f"Cap the {self.kind}'s factor{line} at {cap:.3g} (min({cap:.3g}, ...) around what its function "
                f"returns), so that the rate stays at or below {lr:.4g}{why}: it reached {self.now:.4g}, "
                f"{self.factor:.3g}x the lr={self.initial:.4g} the optimizer was built with"
            )
        return (
            f"Set the {self.kind} so that the rate stays at or below {lr:.4g}{why} ({cap:.3g}x the "
            f"lr={self.initial:.4g} the optimizer was built with): it reached {self.now:.4g}"
        )


def find(optimizer: Any, now: float | None) -> Schedule | None:
    """The scheduler driving `optimizer` where one that can raise the rate raised it to `now` (RAISED
    times or more the rate the optimizer was built with); None where none did. Never raises: it is
    asked while a finding is made."""
    try:
        return _find(optimizer, now)
    except Exception:
        return None


def _find(optimizer: Any, now: float | None) -> Schedule | None:
    if optimizer is None or now is None:
        return None
    groups = getattr(optimizer, "param_groups", None) or []
    initial = [float(g["initial_lr"]) for g in groups if isinstance(g.get("initial_lr"), (int, float))]
    if not initial or max(initial) <= 0 or now < RAISED * max(initial):
        return None
    found = [o for o in _schedulers(optimizer) if _can_raise(o)]
    if not found:
        return None
    # a function of the user's first (a LambdaLR in a SequentialLR or a ChainedScheduler with others)
    scheduler = next((o for o in found if getattr(o, "lr_lambdas", None)), found[0])
    return Schedule(type(scheduler).__name__, max(initial), now, _function_line(scheduler, 0))


def zeroing(optimizer: Any, group: int) -> Schedule | None:
    """The scheduler whose factor holds param group `group` at lr 0 though it was built with a rate
    (a LambdaLR's function for that group returning 0: `(step + 1) // 1000`); None where there is none
    or the group's rate was built 0. Never raises."""
    try:
        built = optimizer.param_groups[group].get("initial_lr")
        if not isinstance(built, (int, float)) or built <= 0:
            return None
        found = _schedulers(optimizer)
        scheduler = next((o for o in found if getattr(o, "lr_lambdas", None)), found[0] if found else None)
        if scheduler is None:
            return None
        return Schedule(type(scheduler).__name__, float(built), 0.0, _function_line(scheduler, group))
    except Exception:
        return None


# a scheduler stepped this many times per optimizer step, within OUTRUN_SLACK of a whole number, was
# stepped once per micro-batch; judged only from OUTRUN_MIN optimizer steps on
OUTRUN_MIN = 10
OUTRUN_SLACK = 0.15
OUTRUN_GRID = 20_000  # a LambdaLR's function is read at most this many times
# the schedule's own length, where it declares one: one of these attributes
_LENGTH = ("total_steps", "T_max", "total_iters")


@dataclass(frozen=True)
class Outrun:
    """A scheduler stepped once per micro-batch whose schedule was sized in optimizer steps: it ran
    out after a fraction of the run."""

    kind: str  # its class
    stepped: int  # its steps (last_epoch)
    steps: int  # the optimizer's steps
    per_step: int  # its steps per optimizer step
    end: int  # the scheduler step where the schedule ends: its declared length, or where its factor settles
    declared: bool  # `end` is the schedule's declared length (else read from a LambdaLR's function)
    lr_now: float  # the group 0 rate at the last step
    where: tuple[str, int, str] | None  # a LambdaLR's function line

    @property
    def ended_at(self) -> int:
        """The optimizer step at which the schedule ended."""
        return -(-self.end // self.per_step)


def outrun(optimizer: Any, schedulers: list[Any], steps: int, forwards: int) -> Outrun | None:
    """Of `schedulers` (those driving `optimizer`), the one stepped a whole number (2 or more) of times per
    optimizer step, as many as the script's training forwards per step (`forwards`, 0: not known), whose
    schedule is sized like the run in optimizer steps (it ends at half the run's optimizer steps or later)
    and so ran out in the first half of it. None otherwise; never raises."""
    try:
        return _outrun(optimizer, schedulers, steps, forwards)
    except Exception:
        return None


def _outrun(optimizer: Any, schedulers: list[Any], steps: int, forwards: int) -> Outrun | None:
    if steps < OUTRUN_MIN:
        return None
    for scheduler in schedulers:
        stepped = int(getattr(scheduler, "last_epoch", 0))
        ratio = stepped / steps
        k = round(ratio)
        if k < 2 or abs(ratio - k) > OUTRUN_SLACK:
            continue
        if forwards and abs(forwards / steps - k) > OUTRUN_SLACK * k:
            continue  # not once per micro-batch
        length = next((int(v) for a in _LENGTH if isinstance(v := getattr(scheduler, a, None), (int, float))), None)
        functions = getattr(scheduler, "lr_lambdas", None) or []
        if length is None and type(scheduler).__name__ == "LambdaLR" and functions:
            length = _settles(functions[0], stepped)
        # sized like the run in optimizer steps, run out in its first half, and a decay: a warm-up that ends early
        # (or one sized in micro-batches) leaves the rate at its peak
        if length is None or not steps / 2 <= length <= stepped / 2 or not _decays(scheduler, length):
            continue
        now = float(optimizer.param_groups[0]["lr"])
        return Outrun(
            type(scheduler).__name__, stepped, steps, k, length, not functions, now, _function_line(scheduler, 0)
        )
    return None


def _decays(scheduler: Any, end: int) -> bool:
    """Whether the schedule ends lower than it starts (a decay, not a warm-up)."""
    kind = type(scheduler).__name__
    if kind == "LinearLR":
        return float(scheduler.end_factor) < float(scheduler.start_factor)
    if kind == "ConstantLR":  # a factor held for total_iters, then 1: it rises
        return False
    functions = getattr(scheduler, "lr_lambdas", None) or []
    if kind == "LambdaLR" and functions:
        return float(functions[0](end)) < float(functions[0](0))
    return True  # CosineAnnealingLR, PolynomialLR: decays


def _settles(f: Any, stepped: int) -> int | None:
    """The first scheduler step from which `f` stays at its value at `stepped` (read on a grid of at most
    OUTRUN_GRID points); None where it is still moving there."""
    stride = max(1, stepped // OUTRUN_GRID)
    last = float(f(stepped))
    if float(f(max(0, stepped - stride))) != last:
        return None
    s = stepped
    while s - stride >= 0 and float(f(s - stride)) == last:
        s -= stride
    return s


def schedulers(optimizer: Any) -> list[Any]:
    """The LR schedulers that drive `optimizer`, or none; never raises. Looked for (one scan of the
    objects the collector tracks, tens of ms) only where one has set `initial_lr` in its groups, as every
    torch scheduler does."""
    try:
        if not any("initial_lr" in g for g in optimizer.param_groups):
            return []
        return _schedulers(optimizer)
    except Exception:
        return []


def _schedulers(optimizer: Any) -> list[Any]:
    """The LR schedulers that drive `optimizer` (looked for among what refers to it: asked for a finding only)."""
    from torch.optim.lr_scheduler import LRScheduler

    referrers = gc.get_referrers(optimizer)
    # an object's attributes may be a dict that refers to the optimizer: its owner is one step further
    owners = [o for d in referrers if isinstance(d, dict) for o in gc.get_referrers(d)]
    return [
        o for o in [*referrers, *owners] if isinstance(o, LRScheduler) and getattr(o, "optimizer", None) is optimizer
    ]


def _function_line(scheduler: Any, group: int) -> tuple[str, int, str] | None:
    """(file, line, source) of a LambdaLR's or MultiplicativeLR's function for param group `group`."""
    functions = getattr(scheduler, "lr_lambdas", None) or []
    code = getattr(functions[min(group, len(functions) - 1)], "__code__", None) if functions else None
    if code is None:
        return None
    source = linecache.getline(code.co_filename, code.co_firstlineno).strip()
    return (code.co_filename, code.co_firstlineno, source) if source else None


# schedulers that only ever lower the rate from the one the optimizer was built with (a factor <= 1)
_LOWERING = ("StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "PolynomialLR", "ConstantLR",
             "CosineAnnealingWarmRestarts", "ReduceLROnPlateau", "SequentialLR", "ChainedScheduler")  # fmt: skip


def _can_raise(scheduler: Any) -> bool:
    """Whether the scheduler can set a rate above the one the optimizer was built with: a function of the
    user's can; a decay can only where its factor is above 1; a container is judged by what it holds."""
    kind = type(scheduler).__name__
    if kind in ("StepLR", "MultiStepLR", "ExponentialLR"):
        return float(getattr(scheduler, "gamma", 1.0)) > 1.0
    if kind == "LinearLR":
        return max(float(scheduler.start_factor), float(scheduler.end_factor)) > 1.0
    return kind not in _LOWERING
