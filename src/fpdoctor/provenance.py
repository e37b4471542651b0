"""Where a tensor came from, kept beside the tensor instead of on it.

Both `trace` (which op produced a value) and `audit` (where an operand's dtype entered) need a
map from a tensor to what they learned about it. An attribute on the tensor would be the cheapest
map, but it changes the user's objects: it travels into `torch.save` output and, loaded in
another process, a stale tag is taken for a fresh one.

The trace looks a tensor up for every input of every op, so the table is a plain dict keyed by
`id()` holding a weak reference beside the value: about 130 ns a lookup against 1.7 us for
torch's `WeakIdKeyDictionary` (measured on CPU, 1000 tensors). An entry whose tensor died is
never returned: its reference no longer points at the tensor asked about, even when a new tensor
got the same `id()`. Dead entries are swept when the table has doubled since the last sweep.

Each table is private to one trace or audit session, so nested or concurrent sessions never read
each other's entries.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

_MIN_SWEEP = 1024


class Provenance:
    """tensor -> whatever the owner records about it; views fall back to their base."""

    __slots__ = ("_table", "sweep_at")

    def __init__(self) -> None:
        self._table: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}
        self.sweep_at = _MIN_SWEEP  # the table's size at which dead entries are swept next

    @property
    def table(self) -> dict[int, tuple[weakref.ref[torch.Tensor], Any]]:
        """The dict itself: id(tensor) -> (weak reference, value). The trace looks up and sets
        entries for every input and output of every op, where `own` and `set` would cost a call
        each. An entry counts only while its reference points at the tensor asked about; whoever
        adds entries calls `sweep` once the table reaches `sweep_at`."""
        return self._table

    def set(self, t: torch.Tensor, value: Any) -> None:
        # weakref.ref without a callback is shared by every caller: no new object per set.
        self._table[id(t)] = (weakref.ref(t), value)
        if len(self._table) >= self.sweep_at:
            self.sweep()

    def own(self, t: torch.Tensor) -> Any:
        """The entry of `t` itself (the hot path: no view fallback, no keyword)."""
        entry = self._table.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        return None

    def get(self, t: torch.Tensor, *, through_views: bool = True) -> Any:
        """The entry of `t`, or of the tensor it is a view of when it has none of its own."""
        entry = self._table.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if through_views:
            base = t._base
            if base is not None:
                entry = self._table.get(id(base))
                if entry is not None and entry[0]() is base:
                    return entry[1]
        return None

    def discard(self, t: torch.Tensor) -> None:
        entry = self._table.get(id(t))
        if entry is not None and entry[0]() is t:
            del self._table[id(t)]

    def sweep(self) -> None:
        """Forget the entries of tensors that died (in place: the trace holds the dict)."""
        table = self._table
        for key in [key for key, entry in table.items() if entry[0]() is None]:
            del table[key]
        self.sweep_at = max(_MIN_SWEEP, 2 * len(table))

    def items(self) -> Iterator[tuple[torch.Tensor, Any]]:
        """(tensor, value) for every tensor still alive."""
        for ref, value in list(self._table.values()):
            t = ref()
            if t is not None:
                yield t, value

    def keys(self) -> Iterator[torch.Tensor]:
        """Every tensor still alive that has an entry."""
        for t, _ in self.items():
            yield t

    def values(self) -> Iterator[Any]:
        for _, value in self.items():
            yield value

    def __contains__(self, t: torch.Tensor) -> bool:
        entry = self._table.get(id(t))
        return entry is not None and entry[0]() is t

    def __len__(self) -> int:
        return sum(1 for _ in self.items())
