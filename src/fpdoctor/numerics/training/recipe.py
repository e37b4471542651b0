"""What an optimizer's recipe does to its updates, read from the optimizer at its steps: the
hyperparameters and wiring that shrink a run silently (nothing NaN, the loss falls slowly or not at
all), where a reference step with the same optimizer agrees.

One implementation for every front end that judges steps (`watch` on a script, the Lightning and Hugging
Face callbacks): the judge holds one `RecipeChecks` per optimizer, fed at each step, said at the report.
- TRN023 lr-zero-group: a param group at lr 0 from the first step while another is not; or every
  group's rate at 0 for the last part of the run (a schedule sized in epochs stepped per step).
- TRN024 weight-decay-too-strong: a decoupled decay that takes a large share of the weights a step.
- TRN026 scheduler-per-micro-batch: a scheduler stepped once per micro-batch, its schedule run out.
- TRN027 optimizer-eps-too-large: an adaptive optimizer's eps far above its gradients' size.
- TRN028 parameters-without-gradient: held parameters that require gradients and get none.

A step costs a look at each param group's lr (a few floats); parameters are looked at on the sampled
steps only (`ungraded.SAMPLED`), the schedulers once (`lr_schedule.OUTRUN_MIN`), the state at the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe import adaptive_eps, lr_schedule, ungraded, unheld
from fpdoctor.numerics.training.findings import (
    decay_finding,
    frozen_group_finding,
    large_eps_finding,
    outrun_finding,
    ungraded_finding,
    zero_tail_finding,
)
from fpdoctor.report.model import Finding
from fpdoctor.torchprivate import named_parameters
from fpdoctor.userframes import user_frames

# a decoupled weight decay that alone takes this share of the weights a step at the group's highest lr (1000x
# a usual lr 1e-3 x weight_decay 0.1: a half-life of 7 steps), or this large whatever the lr (it holds AdamW's
# weights near 1 / weight_decay)
DECAY_PER_STEP = 0.1
DECAY_LARGE = 10.0
# every group's rate at 0 for this share of the run's steps and at least ZERO_TAIL_MIN of them
ZERO_TAIL = 0.25
ZERO_TAIL_MIN = 20


def _rate(optimizer: Any, group: int) -> bool:
    """Whether param group `group` has a learning rate above 0 now."""
    groups = optimizer.param_groups
    lr = groups[group].get("lr") if group < len(groups) else None
    return isinstance(lr, (int, float)) and lr > 0


def _zero_lr_groups(optimizer: Any) -> list[int]:
    """The param groups whose lr is 0 while another group's is not (a warmup from 0 sets them all), and
    that hold a parameter requiring a gradient (a group frozen on purpose holds none)."""
    groups = optimizer.param_groups
    if not any(_rate(optimizer, k) for k in range(len(groups))):
        return []
    return [
        k for k, group in enumerate(groups)
        if group.get("lr") == 0 and any(p.requires_grad for p in group["params"])
    ]  # fmt: skip


def _decay_groups(optimizer: Any, seen: dict[int, tuple[float, float]] | None = None) -> dict[int, tuple[float, float]]:
    """Per param group whose weight decay is applied apart from the gradient (AdamW, SGD, a
    decoupled_weight_decay flag) and is 1 or more: (its highest lr so far, weight_decay). Read at the
    first step and then on every step for those groups only (a warmup's peak lr comes later)."""
    decoupled = isinstance(optimizer, (torch.optim.AdamW, torch.optim.SGD))
    found = dict(seen or {})
    for k, group in enumerate(optimizer.param_groups):
        if seen is not None and k not in seen:
            continue
        lr, wd = group.get("lr"), group.get("weight_decay")
        if not isinstance(lr, (int, float)) or not isinstance(wd, (int, float)):
            continue
        if (decoupled or group.get("decoupled_weight_decay")) and wd >= 1:
            found[k] = (max(float(lr), found.get(k, (0.0, 0.0))[0]), float(wd))
    return found


@dataclass
class RecipeChecks:
    """One optimizer's recipe, read at its steps (`step`) and said at the report (`findings`)."""

    optimizer: Any
    zero_lr: list[int] = field(default_factory=list)  # groups at lr 0 at the first step while another was not
    decay: dict[int, tuple[float, float]] = field(default_factory=dict)  # group -> (highest lr, weight_decay)
    schedulers: list[Any] = field(default_factory=list)  # its LR schedulers, found at its OUTRUN_MIN-th step
    no_grads: ungraded.Ungraded = field(default_factory=ungraded.Ungraded)
    zero_since: int | None = None  # the step from which every group's rate has been 0
    had_rate: bool = False  # a group had a rate above 0 at some step

    def step(self, done: int, params: list[torch.Tensor], model: nn.Module, frame: FrameType | None) -> None:
        """The optimizer's step `done + 1` is about to be taken (`done` taken before it); `params` its
        trainable parameters, `frame` where the user's code called it. Never raises (the caller guards)."""
        optimizer = self.optimizer
        if done == 0:  # a group left at lr 0, or pinned by its decay: said at the report
            self.zero_lr, self.decay = _zero_lr_groups(optimizer), _decay_groups(optimizer)
        else:
            if self.zero_lr:  # a group at lr 0 at the first step: one that rises later (a per-group warmup) trains
                self.zero_lr = [k for k in self.zero_lr if not _rate(optimizer, k)]
            if self.decay:  # the decay at the group's highest lr (a warmup's peak)
                self.decay = _decay_groups(optimizer, self.decay)
        for group in optimizer.param_groups:  # every step: a float per group, no generator
            lr = group.get("lr")
            if isinstance(lr, (int, float)) and lr > 0:
                self.had_rate, self.zero_since = True, None
                break
        else:
            if self.zero_since is None:
                self.zero_since = done + 1
        if done == lr_schedule.OUTRUN_MIN:  # held for the report, which may come after the script's namespace
            # (and a scheduler only it held) is gone
            self.schedulers = lr_schedule.schedulers(optimizer)
        if done in ungraded.SAMPLED:  # three looks per parameter in a run: which have no gradient
            self.no_grads.sample(params)
            if not self.no_grads.files and frame is not None:
                self.no_grads.files = [path for path, _, _ in user_frames(frame)]
                self.no_grads.model = unheld.name_in(frame, model) or self.no_grads.model

    def findings(self, steps: int, micro_batches: int, model: nn.Module, here: dict[str, Any]) -> list[Finding]:
        """What the recipe did to the run's `steps` updates (`micro_batches`: its training forwards)."""
        if steps < 2:
            return []
        return [
            *self._without_gradient(model, here),
            *self._frozen_by_lr(steps, model, here),
            *self._zero_tail(steps, here),
            *self._pinned_by_decay(here),
            *self._outrun(steps, micro_batches, here),
            *self._large_eps(here),
        ]

    def _without_gradient(self, model: nn.Module, here: dict[str, Any]) -> list[Finding]:
        """TRN028 for the modules whose held parameters had no gradient at every sampled step."""
        seen = self.no_grads
        if seen.samples < len(ungraded.SAMPLED) or not seen.none:
            return []
        found = ungraded.modules(model, seen.none)
        if not found:
            return []
        line = ungraded.stopping_line(found[0][0], [*seen.files, *ungraded.model_files(model)])
        if line is None:  # no line stops them: an output the loss does not read (a pooler), not a bug
            return []
        return [ungraded_finding(found, ungraded.SAMPLED, line, seen.model, here=here)]

    def _frozen_by_lr(self, steps: int, model: nn.Module, here: dict[str, Any]) -> list[Finding]:
        """TRN023 for each group at lr 0 still: its parameters got gradients and never moved."""
        optimizer = self.optimizer
        still = [k for k in _zero_lr_groups(optimizer) if k in self.zero_lr] if self.zero_lr else []
        if not still:
            return []
        names = {id(p): n for n, p in named_parameters(model)}
        groups = [
            (k, [names.get(id(p), "?") for p in optimizer.param_groups[k]["params"] if p.requires_grad]) for k in still
        ]
        schedules = {k: found for k in still if (found := lr_schedule.zeroing(optimizer, k)) is not None}
        return [frozen_group_finding(groups, steps, schedules, here=here)]

    def _zero_tail(self, steps: int, here: dict[str, Any]) -> list[Finding]:
        """TRN023 where every group's rate reached 0 and stayed there for the last part of the run."""
        since = self.zero_since
        if since is None or not self.had_rate or self.zero_lr:
            return []
        tail = steps - since + 1
        if tail < max(ZERO_TAIL_MIN, ZERO_TAIL * steps):
            return []
        kind = type(self.schedulers[0]).__name__ if self.schedulers else None
        return [zero_tail_finding(since, steps, kind, type(self.optimizer).__name__, here=here)]

    def _pinned_by_decay(self, here: dict[str, Any]) -> list[Finding]:
        """TRN024 for the groups whose decay at their highest lr takes DECAY_PER_STEP of the weights a step,
        or whose weight_decay is DECAY_LARGE or more."""
        groups = [
            (k, lr, wd)
            for k, (lr, wd) in self.decay.items()
            if lr * wd >= DECAY_PER_STEP or (wd >= DECAY_LARGE and lr > 0)
        ]
        if not groups:
            return []
        count = sum(1 for k, _, _ in groups for p in self.optimizer.param_groups[k]["params"] if p.requires_grad)
        return [decay_finding(groups, count, type(self.optimizer).__name__, here=here)]

    def _outrun(self, steps: int, micro_batches: int, here: dict[str, Any]) -> list[Finding]:
        """TRN026 where the scheduler was stepped once per micro-batch and its schedule ran out."""
        found = lr_schedule.outrun(self.optimizer, self.schedulers, steps, micro_batches)
        return [outrun_finding(found, here=here)] if found is not None else []

    def _large_eps(self, here: dict[str, Any]) -> list[Finding]:
        """TRN027 where the adaptive optimizer's eps is far above its gradients' size."""
        found = adaptive_eps.read(self.optimizer)
        return [large_eps_finding(found, here=here)] if found is not None else []
