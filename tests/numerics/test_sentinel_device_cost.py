"""What the sentinel launches on a steady-state step, counted on the CPU so that a cost that only a GPU
would show (a kernel per parameter, a copy of the weights, a host read) cannot come back unseen; and
the order of the device-skipping path: a step's verdict is read once the next step_fn has been launched,
where waiting for it before would empty a GPU's queue every step."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fpdoctor
from fpdoctor.numerics.training import reference
from fpdoctor.numerics.training.sentinel import GRAD_NORM_EVERY

# the reference steps (1, then the early ones, reference.EARLY; what the weights kept of the last one is
# read at the step after it) and the buffers' learning happen here
WARM_UP = max(reference.EARLY) + 1
STEPS = 20  # steps 102-121: the steady state, two gradient-norm steps among them


class _Launched(TorchDispatchMode):
    """Every aten op run outside the user's step_fn and optimizer.step, and the bytes of the tensors
    it reads and writes (an in-place op's tensors counted once: a pass over all the gradients is one
    times their size)."""

    def __init__(self) -> None:
        super().__init__()
        self.user = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.user:
            self.ops[str(func.overloadpacket.__name__)] += 1
            leaves = tree_leaves((args, kwargs, out))
            seen: set[int] = set()
            for t in leaves:
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    self.bytes += t.numel() * t.element_size()
        return out

    def users(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def inside(*args: Any, **kwargs: Any) -> Any:
            self.user += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.user -= 1

        return inside


def _per_step(tensors: int, kind: str) -> tuple[list[tuple[int, int]], collections.Counter[str], int]:
    """(ops, bytes) the sentinel launched on each steady-state step of an MLP of `tensors` parameter
    tensors, all its ops by name, and the bytes of the gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(tensors // 2)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{kind: True})
    x = torch.randn(8, 32)
    launched = _Launched()

    def step_fn() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        return loss

    user_step = launched.users(step_fn)
    opt.step = launched.users(opt.step)  # type: ignore[method-assign]  # the test's own optimizer
    # fused: the GPU's path (the optimizer skips a bad step on the device, the flag read later)
    guard = fpdoctor.Sentinel(model, opt, gpu_health=False, device_skip=kind == "fused")
    for _ in range(WARM_UP):
        guard.step(user_step)
    per_step = []
    with launched:
        for _ in range(STEPS):
            ops, moved = sum(launched.ops.values()), launched.bytes
            guard.step(user_step)
            per_step.append((sum(launched.ops.values()) - ops, launched.bytes - moved))
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return per_step, launched.ops, grad_bytes


@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_the_ops_a_step_launches_do_not_grow_with_the_parameter_tensors(kind):
    # 16 and 256 parameter tensors: the same ops every step (a handful of 0-d ops, one fused pass
    # over the gradients), 16 times the tensors moving only the bytes of that pass
    small, small_ops, small_grads = _per_step(16, kind)
    large, large_ops, large_grads = _per_step(256, kind)
    assert [ops for ops, _ in small] == [ops for ops, _ in large]
    assert small_ops == large_ops
    counts = sorted({ops for ops, _ in large})
    # no sampled work in the steady state but the gradient norm, every GRAD_NORM_EVERY-th step: one
    # foreach norm, their stack and its norm (the reference step comes again after 500 steps, the
    # progress experiment after a flat window of 200, and fp32 weights have no update checks)
    assert len(counts) == 2 and counts[1] - counts[0] == 3, counts
    assert sum(ops == counts[1] for ops, _ in large) == STEPS // GRAD_NORM_EVERY
    assert counts[0] <= 20  # each op is at least one kernel launch, a few microseconds of host time on a GPU
    assert large_ops["_amp_foreach_non_finite_check_and_unscale_"] == STEPS  # one pass a step, not one per tensor
    assert large_ops["_foreach_norm"] == STEPS // GRAD_NORM_EVERY
    # host reads: none on the fused path (the flag comes back by a non-blocking copy)
    if kind == "fused":
        assert large_ops["_local_scalar_dense"] == 0
    # bytes: the check's pass over the gradients, and the norm's on its steps (with its one float per
    # tensor); no copy of the weights or of their optimizer state
    for size, steps, grads in ((16, small, small_grads), (256, large, large_grads)):
        for ops, moved in steps:
            passes = 2 if ops == counts[1] else 1
            assert moved <= passes * grads + 8 * size + 4096, (size, ops, moved, grads)


def _skip_step(model: nn.Module, opt: torch.optim.Optimizer, log: dict[int, int | None], guard: list[Any]):
    def step(x: torch.Tensor, y: torch.Tensor, poison: bool) -> torch.Tensor:
        if guard:  # the last step decided when each step's own step_fn ran (not a replay's or reference's)
            log.setdefault(guard[0]._judge.steps, guard[0]._judge.decided)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if poison:  # sqrt's infinite slope at 0, times 0: a NaN gradient on the last bias, a finite loss
            loss = loss + torch.sqrt(model[2].bias.abs() * 0.0).sum()
        loss.backward()
        return loss

    return step
