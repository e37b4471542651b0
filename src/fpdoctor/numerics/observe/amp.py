"""The sentinel under `torch.amp.GradScaler`: overflow is the scaler's business, collapse is ours.

With fp16 loss scaling an Inf gradient is expected now and then: the scaler finds it, skips the
step and halves its scale. That step is counted as an AMP skip, not reported as a NaN and not
replayed. What is a finding is a scale that keeps falling: below `MIN_SCALE` (torch's own
GradScaler documentation: a scale under 1 means something is wrong), or `MAX_CONSECUTIVE_SKIPS`
skipped steps in a row (from the default 2**16, 16 halvings take it to 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fpdoctor.torchprivate import scaler_scale, scaler_states

MIN_SCALE = 1.0
MAX_CONSECUTIVE_SKIPS = 24


def enabled(scaler: Any) -> bool:
    return scaler is not None and bool(scaler.is_enabled())


def grad_scaler_class() -> Any:
    """torch.amp.GradScaler (torch >= 2.3); before it, torch.cuda.amp.GradScaler."""
    try:
        from torch.amp import GradScaler
    except ImportError:
        from torch.cuda.amp import GradScaler  # type: ignore[assignment]
    return GradScaler


def _opt_state() -> Any:
    try:
        from torch.amp.grad_scaler import OptState
    except ImportError:
        from torch.cuda.amp.grad_scaler import OptState
    return OptState


@contextlib.contextmanager
def spy(found: list[Any]) -> Iterator[None]:
    """Note every enabled GradScaler whose `scale()` is called inside the block.

    For a step_fn that calls `scaler.scale(loss).backward()` without the scaler being passed to
    the sentinel: the first step runs inside this block, so the scaler that step_fn really uses
    is found (not merely one that exists). Only the class attribute is swapped, for that one
    call, and put back; the user's scaler object is never touched."""
    GradScaler = grad_scaler_class()
    original = GradScaler.scale

    def scale(self: Any, outputs: Any) -> Any:
        if self.is_enabled() and not any(s is self for s in found):
            found.append(self)
        return original(self, outputs)

    own = "scale" in vars(GradScaler)  # torch.cuda.amp's subclass inherits it: nothing to leave behind
    GradScaler.scale = scale
    try:
        yield
    finally:
        if own:
            GradScaler.scale = original
        else:
            del GradScaler.scale


def stepped(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """True when `scaler.step(optimizer)` already ran since the scaler's last update()."""
    OptState = _opt_state()
    states = scaler_states(scaler)
    state = states.get(id(optimizer)) if isinstance(states, dict) else None
    return state is not None and state.get("stage") is OptState.STEPPED


def scale_version(scaler: Any) -> tuple[Any, int]:
    """The scaler's scale tensor and its version counter (no device read), before step_fn runs."""
    scale = scaler_scale(scaler) if scaler is not None else None
    return scale, scale._version if isinstance(scale, torch.Tensor) else 0


def updated_since(scaler: Any, before: tuple[Any, int]) -> bool:
    """True when `scaler.update()` ran since `before` (it writes the scale in place, which bumps
    its version; a scale created since then - the first scale() - starts at version 0)."""
    scale = scaler_scale(scaler) if scaler is not None else None
    if not isinstance(scale, torch.Tensor):
        return False
    tensor, version = before
    return scale._version != version if scale is tensor else scale._version > 0


def found_inf(scaler: Any, optimizer: torch.optim.Optimizer, device: torch.device) -> torch.Tensor | None:
    """The scaler's own found_inf for `optimizer` after its step() (before update() clears it)."""
    state = (scaler_states(scaler) or {}).get(id(optimizer))
    if not state or not state["found_inf_per_device"]:
        return None
    flags = [f.to(device, non_blocking=True).float() for f in state["found_inf_per_device"].values()]
    return torch.stack(flags).amax()


def scale_tensor(scaler: Any, device: torch.device) -> torch.Tensor:
    scale = scaler_scale(scaler)  # a disabled scaler never makes one
    if scale is None:
        return torch.full((), float("nan"), device=device)
    return scale.detach().reshape(()).to(device, dtype=torch.float32, non_blocking=True).clone()


class ScaleWatch:
    """Counts AMP skips and decides when the scale has collapsed (once per collapse)."""

    def __init__(self) -> None:
        self.skipped = 0
        self.consecutive = 0
        self.scale: float | None = None
        self.min_scale: float | None = None
        self._reported = False

    @property
    def collapsed(self) -> bool:
        """The scale has collapsed (below MIN_SCALE, or MAX_CONSECUTIVE_SKIPS skips in a row) and not recovered."""
        return self._reported

    def note(self, scale: float) -> None:
        """The scale now, on a step that is not the scaler's overflow (the lowest one kept too)."""
        self.scale = scale
        self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)

    def observe(self, skipped: bool, scale: float) -> bool:
        """Record one optimizer step; True when the scale has just collapsed."""
        self.scale = scale
        self.min_scale = scale if self.min_scale is None else min(self.min_scale, scale)
        if skipped:
            self.skipped += 1
            self.consecutive += 1
        else:
            self.consecutive = 0
        collapsed = scale < MIN_SCALE or self.consecutive >= MAX_CONSECUTIVE_SKIPS
        if not collapsed:
            self._reported = False  # a later collapse is a new episode
        elif not self._reported:
            self._reported = True
            return True
        return False


@contextlib.contextmanager
def scale_as(scaler: Any, scale: torch.Tensor | None) -> Iterator[None]:
    """The scaler's scale as it was for the step being replayed, and its per-optimizer state
    (a replayed `scaler.unscale_(opt)` marks the optimizer unscaled), put back afterwards."""
    current = scaler_scale(scaler)
    if scale is None or current is None:
        yield
        return
    saved = current.detach().clone()
    states = scaler_states(scaler)
    saved_states = None if states is None else {k: dict(v) for k, v in states.items()}
    current.copy_(scale)
    try:
        yield
    finally:
        current.copy_(saved)
        if states is not None and saved_states is not None:
            states.clear()  # the same defaultdict object: the scaler keeps its factory
            states.update(saved_states)
