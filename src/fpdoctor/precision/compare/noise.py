"""Random numbers a forward draws itself (noise injection, a VAE's posterior sample), recorded once
and replayed in every run of a comparison.

Restoring the RNG state is not enough: on CPU, float32 and float64 normals come from different
algorithms, so an fp16 copy and the fp64 referee would see different noise and every module after
the draw would look divergent. The draws are recorded in fp64 and each run gets them cast to its
own dtype, in the order it makes them.
"""

from __future__ import annotations

from typing import Any

import torch

from fpdoctor.torchprivate import TorchDispatchMode


def _random(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _uniform_bounds(func: Any, args: Any, kwargs: dict[str, Any]) -> tuple[float, float] | None:
    """(from, to) of a uniform draw (rand: 0, 1; uniform_(from, to)); None for other draws."""
    name = func._schema.name.removeprefix("aten::")
    if name in ("rand", "rand_like"):
        return 0.0, 1.0
    if name == "uniform_":
        low = args[1] if len(args) > 1 else kwargs.get("from", 0.0)
        high = args[2] if len(args) > 2 else kwargs.get("to", 1.0)
        return float(low), float(high)
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
        bounds = _uniform_bounds(func, args, kwargs or {})
        if bounds is not None and value.is_floating_point():
            # a uniform draw is in [from, to): torch's own generator, where a value rounds up to `to` in the
            # dtype (in bf16, every draw above 1 - 2^-9: one in 512), gives `from` instead, on the CPU and
            # on CUDA alike; so does the replay, and the narrow run sees the zeros its own draws hold
            low, high = bounds
            value = torch.where(value >= high, torch.full_like(value, low), value)
        # into the op's own output, in place or not: what a mode beneath marked on it (compare's raised
        # lines mark what they computed in fp32, to be cast back where the rest reads it) stays with it
        return out.copy_(value)
