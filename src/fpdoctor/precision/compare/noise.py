"""Random numbers a forward draws itself (noise injection, a VAE's posterior sample), recorded once
and replayed in every run of a comparison.

Restoring the RNG state is not enough: on CPU, float32 and float64 normals come from different
algorithms, so an fp16 copy and the fp64 referee would see different noise and every module after
the draw would look divergent. The draws are recorded in fp64 and each run gets them cast to its
own dtype, in the order it makes them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fpdoctor.torchprivate import TorchDispatchMode


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _uniform_high(func: Any, args: Any, kwargs: dict[str, Any]) -> float | None:
    """The open upper end of a uniform draw (rand: 1; uniform_(from, to): to); None for other draws."""
    name = func._schema.name.removeprefix("aten::")
    if name in ("rand", "rand_like"):
        return 1.0
    if name == "uniform_":
        high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
        return float(high)
    return None


class RecordNoise(TorchDispatchMode):
    """Keeps a float64 copy of every tensor a random op (randn, rand, normal_, bernoulli, ...) makes."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if _random(func) and isinstance(out, torch.Tensor):
            self.draws.append(out.detach().to(torch.float64 if out.is_floating_point() else out.dtype, copy=True))
        return out


class ReplayNoise(TorchDispatchMode):
    """Replaces the output of the k-th random op with the k-th recorded draw, in this run's dtype.

    `position` is the next draw; a re-run of one module sets it to where that module started. A
    draw whose shape does not match (the run took another path) is left as drawn and `misaligned`
    says so."""

    def __init__(self, draws: list[torch.Tensor]) -> None:
        super().__init__()
        self.draws, self.position, self.misaligned = draws, 0, False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not _random(func) or not isinstance(out, torch.Tensor):
            return out
        k, self.position = self.position, self.position + 1
        if k >= len(self.draws) or self.draws[k].shape != out.shape:
            self.misaligned = True
            return out
        value = self.draws[k].to(dtype=out.dtype, device=out.device)
        high = _uniform_high(func, args, kwargs or {})
        if high is not None and value.is_floating_point():
            # a uniform draw is in [low, high): an fp64 value just below `high` rounds up to it in a narrow
            # dtype, which the run's own draw never gives (-log(u) of 1 - u = 0 would be Inf): the largest
            # value of the dtype below `high` instead
            below = torch.nextafter(torch.tensor(high, dtype=value.dtype), torch.tensor(-math.inf, dtype=value.dtype))
            value = torch.where(value >= high, below.to(value.device), value)
        # into the op's own output, in place or not: what a mode beneath marked on it (compare's raised
        # lines mark what they computed in fp32, to be cast back where the rest reads it) stays with it
        return out.copy_(value)
