"""The control experiment for a bad step: the same replay again, at a higher precision.

A step that is non-finite again at its own precision is a numerical fact, but not yet a cause:
fp16 can overflow where fp32 cannot. So the replay runs once more with every fp16/bf16
parameter, buffer and input in fp32 and autocast switched off (the incident's own method:
change one thing, rerun). Non-finite in both: the data or the model's math at the named op.
Finite in fp32 only: the precision is the cause - compare/plan, or bf16 where range is short.
What the step casts itself (`x.half()` in a forward) stays as written; the verdict says so.

The user's parameters are never touched: fp32 copies stand in for them on the module for the
replay only (`torch.nn.utils.stateless`, as `torch.func.functional_call` does), so their dtype,
their autograd accumulators and every hook on them (DDP's, an optimizer run in backward) stay
as they are.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.training.replay import replay
from fpdoctor.torchprivate import named_parameters, pytree, reparametrized

LOW_PRECISION = (torch.float16, torch.bfloat16)
_LOW_NAMES = {"float16", "bfloat16", "half"}
_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class ControlResult:
    outcome: str  # "finite" (only the low precision fails), "nonfinite" (fails in fp32 too) or "failed"
    precision: str = "float32"
    loss: float = float("nan")
    error: str | None = None


def wants_control(dtype: str | None, model: nn.Module) -> bool:
    """Worth running when the bad op computed in fp16/bf16, or the model holds such parameters."""
    if dtype is not None:
        return dtype.removeprefix("torch.") in _LOW_NAMES
    return any(p.dtype in LOW_PRECISION for p in model.parameters())


class _AutocastOff:
    """While a control runs on a thread, every autocast region that thread enters runs disabled.

    torch.autocast's __enter__ is wrapped once for the process (reference-counted, under a
    lock); the wrapper acts only on threads that are running a control, so other threads'
    autocast is untouched. The user's autocast objects are not changed: their own __enter__
    runs, the region's flag is switched off, and their __exit__ restores what was before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[int, int] = {}
        self._enter: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        from torch.amp import autocast_mode

        me = threading.get_ident()
        with self._lock:
            if not self._threads:
                cls = autocast_mode.autocast
                self._enter = enter = cls.__enter__
                threads = self._threads

                def entered_off(region: Any) -> Any:
                    result = enter(region)
                    if threading.get_ident() in threads:
                        torch.set_autocast_enabled(region.device, False)
                    return result

                cls.__enter__ = entered_off  # type: ignore[method-assign]
            self._threads[me] = self._threads.get(me, 0) + 1
        # an autocast region already open around the step (the user's, a framework's) is off too
        was = {device: torch.is_autocast_enabled(device) for device in _AUTOCAST_DEVICES}
        for device in _AUTOCAST_DEVICES:
            torch.set_autocast_enabled(device, False)
        try:
            yield
        finally:
            for device, enabled in was.items():
                torch.set_autocast_enabled(device, enabled)
            with self._lock:
                self._threads[me] -= 1
                if not self._threads[me]:
                    del self._threads[me]
                if not self._threads:
                    autocast_mode.autocast.__enter__ = self._enter  # type: ignore[method-assign]


_autocast_off = _AutocastOff()


def _fp32_stand_ins(model: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the model's fp16/bf16 parameters and buffers, by name (fresh leaves that
    want gradients where the originals do). A tied tensor is named once: reparametrizing with
    tie_weights gives its other names the same copy."""
    stand_ins: dict[str, torch.Tensor] = {}
    for name, p in named_parameters(model):
        if p.dtype in LOW_PRECISION:
            stand_ins[name] = p.detach().float().requires_grad_(p.requires_grad)
    for name, b in model.named_buffers():
        if b.dtype in LOW_PRECISION:
            stand_ins[name] = b.detach().float()
    return stand_ins


def _inputs_in_fp32(window: list[MicroBatch]) -> list[MicroBatch]:
    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
            # a new leaf: a gradient the step takes with respect to its input lands here
            return value.detach().float().requires_grad_(value.requires_grad)
        return value

    return [MicroBatch(m.rng, pytree.tree_map(up, m.args), pytree.tree_map(up, m.kwargs)) for m in window]


def run_control(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
) -> ControlResult:
    """Replay `window` in fp32 with autocast off; never raises (a step that cannot run in fp32,
    e.g. one that mixes dtypes by hand, is `failed` with the reason)."""
    try:
        stand_ins = _fp32_stand_ins(model)
        by_id = {id(p): name for name, p in named_parameters(model)}
        # the gradients the replay judges are the stand-ins' where there is one
        judged = [stand_ins.get(by_id.get(id(p), ""), p) for p in params]
        with reparametrized(model, stand_ins, tie_weights=True), _autocast_off():
            result = replay(model, judged, step_fn, _inputs_in_fp32(window), contexts)
    except Exception as exc:
        return ControlResult("failed", error=f"{type(exc).__name__}: {exc}")
    if result.verdict == "replay-failed":
        return ControlResult("failed", error=result.error)
    if result.verdict == "deterministic-nonfinite":
        return ControlResult("nonfinite", loss=result.loss)
    return ControlResult("finite", loss=result.loss)
