"""Optimizer steps as a training log counts them, so a finding can say "at optimizer step 2".

A module's call count includes evaluation forwards, every micro-batch and every repeated call;
the user's log counts optimizer steps. `StepCounter` marks, in the tracer's record numbering,
where each step ended: `optimizer.step()`, or `GradScaler.step()` (which counts a step it skips
for an Inf gradient, as the training loop does). Several optimizers stepped in one iteration (a
GAN's discriminator and generator) make one step, which ends with the last of them: a step
begins when an optimizer steps again that already stepped in the current one, or when one first
steps after PHASE steps another made alone (a student trained after its teacher). It also notes
where top-level forwards switch between training and evaluation (grad mode off, or the module in
`eval()`), so a value made in an evaluation forward is said to follow a step, not to be one.
For an enabled GradScaler it keeps, per step, the scale the step ran with and whether the scaler
skipped it (its own found-inf flags, copied when its step returns and read once, after the block:
no host sync per step). A disabled scaler steps like the optimizer it wraps.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fpdoctor.numerics.observe.amp import grad_scaler_class
from fpdoctor.numerics.observe.dynamo import compiling
from fpdoctor.torchprivate import DisableTorchDispatch, scaler_scale, scaler_states

PHASE = 16  # steps one optimizer made alone, in a row, after which a new optimizer starts a step of its own


class StepCounter:
    """Context manager over a traced block; `position()` is the index the next record will get."""

    def __init__(self, position: Callable[[], int]) -> None:
        self._position = position
        self._ends: list[int] = []  # _ends[k]: the first record after optimizer step k + 1
        self._modes: list[tuple[int, bool]] = []  # (first record, evaluating) at each switch
        self._stepped: list[weakref.ref[Any]] = []  # the optimizers stepped in the step under way
        self._known: list[weakref.ref[Any]] = []  # every optimizer that stepped in the block
        self._alone = 0  # the steps before the one under way that one optimizer made alone, in a row
        self._last_end = 0  # the first record after the latest optimizer step
        self._thread = threading.get_ident()
        self._depth = 0
        self._in_scaler = 0
        self._handles: list[Any] = []
        self._scaler_step: Any = None
        self._scaled: list[tuple[int, Any, Any]] = []  # (step, found-inf flags, scale) per scaler step

    @property
    def ends(self) -> list[int]:
        """Where each step ended, the one under way included once an optimizer stepped in it."""
        return [*self._ends, self._last_end] if self._stepped else list(self._ends)

    @property
    def steps(self) -> int:
        return len(self._ends) + (1 if self._stepped else 0)

    def __enter__(self) -> StepCounter:
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        self._thread = threading.get_ident()
        self._handles = [
            optimizer_mod.register_optimizer_step_post_hook(self._optimizer_stepped),
            module_mod.register_module_forward_pre_hook(self._forward_pre),
            module_mod.register_module_forward_hook(self._forward_post, always_call=True),
        ]
        # GradScaler has no hooks: its class attribute is swapped for the block and put back, the
        # user's scaler object is never touched
        scaler = grad_scaler_class()
        self._scaler_step = vars(scaler).get("step")
        if self._scaler_step is not None:
            original = self._scaler_step

            def step(scaler_self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                self._in_scaler += 1
                try:
                    result = original(scaler_self, optimizer, *args, **kwargs)
                finally:
                    self._in_scaler -= 1
                self._ended(optimizer)
                self._scaler_stepped(scaler_self, optimizer)
                return result

            scaler.step = step
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._scaler_step is not None:
            grad_scaler_class().step = self._scaler_step
            self._scaler_step = None

    def _ended(self, optimizer: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        try:
            new = not any(ref() is optimizer for ref in self._known)
            if new:
                self._known.append(weakref.ref(optimizer))
            # stepped again: a new step began; so does an optimizer never seen before after a phase of
            # steps that one optimizer made alone (a student trained after its teacher), unlike a GAN's
            # second optimizer, which joins the first's step (after a WGAN's 5 critic steps too)
            if any(ref() is optimizer for ref in self._stepped) or (new and self._stepped and self._alone >= PHASE):
                self._ends.append(self._last_end)
                self._alone = self._alone + 1 if len(self._stepped) == 1 else 0
                self._stepped = []
            self._stepped.append(weakref.ref(optimizer))
            self._last_end = self._position()
        except Exception:  # the observer never raises into the user's step
            pass

    def _scaler_stepped(self, scaler: Any, optimizer: Any) -> None:
        """Copies of the scaler's found-inf flags for `optimizer` and of its scale (update() writes
        the scale in place and may add into a flag), made on the device, outside the trace."""
        if threading.get_ident() != self._thread:
            return
        try:
            if not scaler.is_enabled():
                return
            state = (scaler_states(scaler) or {}).get(id(optimizer)) or {}
            flags = list(state.get("found_inf_per_device", {}).values())
            scale = scaler_scale(scaler)
            with torch.no_grad(), DisableTorchDispatch():
                found = (
                    torch.stack([f.reshape(()).float().to(flags[0].device) for f in flags]).amax() if flags else None
                )
                kept = scale.detach().reshape(-1)[0].clone() if isinstance(scale, torch.Tensor) else None
            self._scaled.append((self.steps, found, kept))
        except Exception:  # the observer never raises into the user's step
            pass

    def scaler_steps(self) -> list[tuple[int, bool, float]]:
        """(optimizer step, skipped by the scaler, the scale it ran with) per step an enabled
        GradScaler stepped, in order; several optimizers in one step: skipped when any was."""
        merged: dict[int, tuple[bool, float]] = {}
        for step, found, scale in self._scaled:
            skipped = found is not None and float(found) > 0
            value = float(scale) if scale is not None else float("nan")
            if step in merged:
                skipped = skipped or merged[step][0]
            merged[step] = (skipped, value)
        return [(step, skipped, value) for step, (skipped, value) in merged.items()]

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._in_scaler:  # GradScaler.step counts its own, stepped or skipped
            self._ended(optimizer)

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        # while Dynamo traces a compiled model the hook is inlined as nothing (no graph break of ours)
        if compiling() or threading.get_ident() != self._thread:
            return
        self._depth += 1
        if self._depth == 1:
            evaluating = not torch.is_grad_enabled() or not module.training
            if (self._modes[-1][1] if self._modes else False) != evaluating:
                self._modes.append((self._position(), evaluating))

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not compiling() and threading.get_ident() == self._thread:
            self._depth = max(0, self._depth - 1)

    def step_of(self, index: int, phase: str) -> tuple[int, bool] | None:
        """(step, evaluating) of record `index`: the step it belongs to, counted from 1, or for an
        evaluation forward the steps done before it (0: before the first). None without steps."""
        ends = self.ends
        if not ends:
            return None
        done = bisect.bisect_right(ends, index)
        if phase == "forward":
            at = bisect.bisect_right(self._modes, (index, True)) - 1
            if at >= 0 and self._modes[at][1]:
                return done, True
        return done + 1, False
