"""Which dataset rows the batch a DataLoader last handed out holds: so that a NaN found in rows 3
and 7 of a batch is also "dataset items 1043 and 2077", the items a user can open and look at.

A DataLoader iterator asks its sampler for index lists ahead of time (its workers prefetch), in the
order it hands the batches out (`in_order`, the default), so the index lists wait in a queue per
iterator and each batch handed out takes the oldest. Nothing is set on the iterators or the loader:
the queues are held here, by weak reference to the iterator. Per thread, the last batch handed out
is the one the step in that thread is computing on.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from typing import Any

import torch

from fpdoctor.torchprivate import dataloader_batches

_last = threading.local()  # .indices: the dataset indices of this thread's last batch, or None


def last_indices() -> list[int] | None:
    """The dataset indices of the batch a DataLoader last handed out in this thread, in batch
    order; None when no DataLoader built one under a LoaderBatches, or when they are unknown (an
    IterableDataset, an out-of-order loader)."""
    return getattr(_last, "indices", None)


class LoaderBatches(contextlib.AbstractContextManager["LoaderBatches"]):
    """While open, every DataLoader batch handed out records its dataset indices (`last_indices`)."""

    def __init__(self) -> None:
        self._queues: weakref.WeakKeyDictionary[Any, deque[Any]] = weakref.WeakKeyDictionary()
        self._stack = contextlib.ExitStack()
        self._saved: list[int] | None = None

    def __enter__(self) -> LoaderBatches:
        # one open inside another (a trace inside a watched script) wraps the methods again: each
        # keeps its own queues and both record the same indices
        self._stack.enter_context(dataloader_batches(self._on_indices, self._on_batch))
        # not cleared: a replay traced inside a watched step reads the batch the step was given
        self._saved = last_indices()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        _last.indices = self._saved  # what the enclosing one (or nothing) last saw

    def _on_indices(self, iterator: Any, indices: Any) -> None:
        try:
            if indices is None:  # a reset: what was prefetched for the last epoch is dropped
                self._queues.pop(iterator, None)
            else:
                self._queues.setdefault(iterator, deque()).append(indices)
        except TypeError:  # an iterator that cannot be weakly referenced: rows go unnamed
            pass

    def _on_batch(self, iterator: Any, in_order: bool) -> None:
        queue = self._queues.get(iterator)
        indices = queue.popleft() if queue else None
        _last.indices = _flat(indices) if in_order else None


def _flat(indices: Any) -> list[int] | None:
    """A batch sampler's list of ints, or a single int (batch_size=None); None for anything else
    (an IterableDataset's sampler yields None)."""
    if isinstance(indices, int):
        return [indices]
    if isinstance(indices, (list, tuple)) and indices and all(isinstance(i, int) for i in indices):
        return list(indices)
    return None


def bad_rows(t: torch.Tensor) -> dict[str, Any] | None:
    """The rows along dim 0 of `t` that hold NaN/Inf, where only some do: their places in the batch
    and, where dim 0 is as long as the DataLoader's last batch, the dataset items they are."""
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    bad = (~torch.isfinite(t.detach())).reshape(t.shape[0], -1).any(1)
    count = int(bad.sum())
    if count in (0, t.shape[0]):
        return None
    found: dict[str, Any] = {"indices": bad.nonzero().flatten().tolist(), "of": t.shape[0]}
    items = last_indices()
    if items is not None and len(items) == t.shape[0]:
        found["dataset_indices"] = [items[i] for i in found["indices"]]
    return found


def rows_text(rows: dict[str, Any] | None) -> str:
    """' It is in rows 3, 7 of the 16 along dim 0 (the batch) (dataset items 1043, 2077 ...)'."""
    if rows is None:
        return ""
    one = len(rows["indices"]) == 1
    listed = ", ".join(str(i) for i in rows["indices"][:8]) + (" ..." if len(rows["indices"]) > 8 else "")
    text = f" It is in {'row' if one else 'rows'} {listed} of the {rows['of']} along dim 0 (the batch)"
    text += ", not in the others"
    if rows.get("dataset_indices"):
        items = rows["dataset_indices"]
        named = ", ".join(str(i) for i in items[:8]) + (" ..." if len(items) > 8 else "")
        text += (
            f" (dataset item {named}, drawn by the DataLoader's sampler: dataset[{named}] reads it)"
            if one
            else f" (dataset items {named}, drawn by the DataLoader's sampler: dataset[i] reads each)"
        )
    if rows.get("differs"):
        text += f": in those rows {rows['differs']}"
    return text + "."
