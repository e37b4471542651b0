"""Running the user's own model in eval mode and giving every module its own flag back.

`model.eval()` then `model.train(was_training)` is not a restore: `train()` recurses, so every
submodule comes back with the root's flag - a BatchNorm the user froze in eval inside a training
model would train again, and its running statistics would drift from then on. The flags are
saved module by module and written back the same way (the attribute itself, so a `train()`
override that does more than set flags is not called a second time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


def training_flags(model: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every module of `model` (shared ones once) with its own `training` flag."""
    return [(module, module.training) for module in model.modules()]


def restore_flags(saved: list[tuple[nn.Module, bool]]) -> None:
    for module, flag in saved:
        module.training = flag


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """`model` in eval mode for the block; afterwards each module has the flag it had before."""
    saved = training_flags(model)
    try:
        model.eval()
        yield model
    finally:
        restore_flags(saved)
