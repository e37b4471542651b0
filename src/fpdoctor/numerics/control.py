"""The control experiment for a bad step: the same replay again, at a higher precision.

A step that is non-finite again at its own precision is a numerical fact, but not yet a cause:
fp16 can overflow where fp32 cannot. So the replay runs once more with every fp16/bf16
parameter, buffer and input in fp32 and autocast switched off (the incident's own method:
change one thing, rerun). Non-finite in both: the data or the model's math at the named op.
Finite in fp32 only: the precision is the cause - compare/plan, or bf16 where range is short.
What the step casts itself (`x.half()` in a forward) stays as written; the verdict says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from fpdoctor.numerics.replay import MicroBatch, replay

LOW_PRECISION = (torch.float16, torch.bfloat16)
_LOW_NAMES = {"float16", "bfloat16", "half"}


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


@contextlib.contextmanager
def _autocast_off() -> Iterator[None]:
    """Every autocast region entered inside runs with autocast disabled. The user's autocast
    objects are not touched: their own __enter__ runs, then the enabled flag is switched off
    for the region, and their __exit__ restores what was there before."""
    from torch.amp import autocast_mode

    cls = autocast_mode.autocast
    enter = cls.__enter__

    def entered_off(self: Any) -> Any:
        result = enter(self)
        torch.set_autocast_enabled(self.device, False)
        return result

    cls.__enter__ = entered_off  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.__enter__ = enter  # type: ignore[method-assign]


@contextlib.contextmanager
def _in_fp32(model: nn.Module, params: list[torch.Tensor]) -> Iterator[None]:
    """Low-precision parameters and buffers hold fp32 copies for the block; the original tensors
    (their storage never written) are put back after, with no gradient left behind."""
    seen: set[int] = set()
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    for t in [*params, *model.parameters(), *model.buffers()]:
        if id(t) in seen or t.dtype not in LOW_PRECISION:
            continue
        seen.add(id(t))
        swapped.append((t, t.data))
        t.data = t.data.float()
    try:
        yield
    finally:
        for t, data in reversed(swapped):
            t.grad = None
            t.data = data


def _inputs_in_fp32(window: list[MicroBatch]) -> list[MicroBatch]:
    def up(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype in LOW_PRECISION:
            return value.detach().float()
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
        with _in_fp32(model, params):
            result = replay(model, params, step_fn, _inputs_in_fp32(window), [*contexts, _autocast_off()])
    except Exception as exc:
        return ControlResult("failed", error=f"{type(exc).__name__}: {exc}")
    if result.verdict == "replay-failed":
        return ControlResult("failed", error=result.error)
    if result.verdict == "deterministic-nonfinite":
        return ControlResult("nonfinite", loss=result.loss)
    return ControlResult("finite", loss=result.loss)
