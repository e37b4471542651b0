"""Running a user's model without changing it: what a forward can change besides its output.

A forward draws from the RNG (dropout) and may update buffers (BatchNorm's running statistics in
training mode, a module's own counters or caches). When fpdoctor runs the user's own model - a
replay, an audit - those changes must not reach the user's run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class RngState:
    cpu: torch.Tensor
    cuda: list[torch.Tensor] | None = None

    @classmethod
    def capture(cls) -> RngState:
        # never initialise CUDA just to save a state nobody has drawn from
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return cls(torch.get_rng_state(), cuda)

    def same(self, other: RngState) -> bool:
        cuda_same = (self.cuda is None) == (other.cuda is None) and all(
            torch.equal(a, b) for a, b in zip(self.cuda or [], other.cuda or [], strict=True)
        )
        return torch.equal(self.cpu, other.cpu) and cuda_same

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def preserved(model: nn.Module) -> Iterator[None]:
    """On exit, put back the RNG states and every buffer of `model`: its values, and the tensor
    each module holds (a forward may rebind a buffer rather than update it in place)."""
    rng = RngState.capture()
    saved = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                buffer.copy_(value)
                module._buffers[name] = buffer
        rng.restore()
