"""The tensors inside a nested value: args, kwargs, module outputs, optimizer state.

`torch.utils._pytree` knows tuples, lists, dicts, namedtuples and what libraries register
(transformers registers its `ModelOutput`s). A dataclass nobody registered is a leaf to it, so
its fields are opened here: a model returning `Out(logits, aux)` still shows both tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fpdoctor.torchprivate import pytree


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in `value`, depth first, in pytree order."""
    found: list[torch.Tensor] = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found.extend(tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
    return found
