"""Where a tensor came from, kept beside the tensor instead of on it.

Both `trace` (which op produced a value) and `audit` (where an operand's dtype entered) need a
map from a tensor to what they learned about it. An attribute on the tensor would be the cheapest
map, but it changes the user's objects: it travels into `torch.save` output and, loaded in
another process, a stale tag is taken for a fresh one. This side table is keyed weakly by the
tensor object (`WeakIdKeyDictionary`, as torch's own fake-tensor converter does): an entry dies
with its tensor, and a reused `id()` never inherits a dead tensor's entry.

Each table is private to one trace or audit session, so nested or concurrent sessions never read
each other's entries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary


class Provenance:
    """tensor -> whatever the owner records about it; views fall back to their base."""

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def set(self, t: torch.Tensor, value: Any) -> None:
        self._table[t] = value

    def get(self, t: torch.Tensor, *, through_views: bool = True) -> Any:
        """The entry of `t`, or of the tensor it is a view of when it has none of its own."""
        value = self._table.get(t)
        if value is None and through_views and t._base is not None:
            value = self._table.get(t._base)
        return value

    def __contains__(self, t: torch.Tensor) -> bool:
        return t in self._table

    def __len__(self) -> int:
        return len(self._table)
