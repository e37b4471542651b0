"""Which DataLoader batch a traced step computes on: the one its ops and modules were seen to read,
so that bad rows are named as that batch's dataset items.

The last batch handed out is the step's in a plain loop only. Lightning fetches the next batch
before the step where the DataLoader has no length, accelerate's loader (the Hugging Face Trainer's)
always does, and a gradient-accumulation window fetches its micro-batches first: the last batch
handed out is then another step's. So the trace follows the batches handed out (observe/loader.py,
`LoaderBatches(recent=...)`: each one's shapes, a few values, its indices) and, after each, keeps
what the step was seen to read, in order:

- a batch whose floating-point tensors a traced op read (the tracer's provenance: the tensor, a view
  of it, or a value-preserving copy such as a move to the device), noticed at the next module call;
- the tensors a module was handed that are shaped like a batch's (token ids handed to an
  embedding, where the model was called with keyword arguments that no global hook sees), by
  reference: their values are read only when rows are named.

A model called at the top again before the next batch is handed out (the next micro-batch of an
accumulation window) starts over: what was seen from its previous call on was the previous one's.
When an op makes NaN/Inf in some rows, the tensors that op read come first, then what was seen,
newest first; the first that is one batch's (`LoaderBatches.holding`, by values, as the framework
callbacks find a replayed step's batch) names the rows. Where none is, the rows say their dataset
items are not known and why, never the last batch handed out. A trace that saw no batch handed out
(a replay inside `watch`) leaves the rows to what the enclosing watcher says.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from typing import Any

import torch

from fpdoctor.numerics.observe.loader import LoaderBatches, rows_from
from fpdoctor.pytrees import tensors_in
from fpdoctor.torchprivate import DisableTorchDispatch

RECENT = 64  # batches kept: a framework fetches one or two ahead, an accumulation window its micro-batches
_SEEN = 64  # what the step was seen to read since the last batch handed out, newest kept
# batches handed out and not yet read whose reads are looked for at each module call: a few lookups each
_UNREAD = 16


class StepBatch(contextlib.AbstractContextManager["StepBatch"]):
    """While open, bad rows made in this thread are named by the batch the step was seen to read.
    `tracer` answers `has_read(t)` and `flush()` (the Tracer); `on_call` is the module tracker's
    hook at each module call."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        self._thread = threading.get_ident()
        self._loader = LoaderBatches(recent=RECENT, on_batch=self._handed)
        # batches handed out whose float tensors no traced op has read yet: (tensors, indices)
        self._unread: deque[tuple[list[weakref.ref[torch.Tensor]], list[int] | None]] = deque(maxlen=_UNREAD)
        # (number, "read", [indices of each batch read]) or (number, "values", [tensors a module was
        # handed]), oldest first, numbered from the last batch handed out
        self._seen: deque[tuple[int, str, list[Any]]] = deque(maxlen=_SEEN)
        self._count = 0
        # a model called at the top again since the last batch handed out starts another micro-batch:
        # what was seen from its last call on is that one's (module id -> the number seen then)
        self._tops: dict[int, int] = {}
        # what was seen, judged: (self._count then, `_from_seen`'s answer)
        self._answer: tuple[int, tuple[list[list[int] | None] | None, bool]] | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> StepBatch:
        try:
            self._stack.enter_context(self._loader)
            self._stack.enter_context(rows_from(self._resolve))
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        # a deferred trace's last results read while what the steps read is known (the tracer's
        # `finish` would read them after)
        try:
            with DisableTorchDispatch():
                self._tracer.flush()
        except Exception as error:  # the observer's own failure: said in the report, never raised
            self._tracer.errors.append(f"reading the last results: {type(error).__name__}: {error}")
        finally:
            self._stack.close()

    # -- what the step was seen to read ----------------------------------------------------------
    def _handed(self, batch: Any, indices: list[int] | None) -> None:
        """A batch handed out: what was seen before it was another step's. A deferred trace reads
        its pending results now, so that an op of the step before is judged with that step's reads."""
        with DisableTorchDispatch():  # our reads are not the user's ops
            self._tracer.flush()
        self._seen.clear()
        self._tops.clear()
        self._count += 1
        floats = [weakref.ref(t) for t in tensors_in(batch) if t.is_floating_point()]
        if floats:
            self._unread.append((floats, indices))

    def on_call(self, module: Any, args: Any) -> None:
        """A module is called (forward pre-hook): the batches read since the last call, and the
        tensors it was handed that are shaped like a batch's."""
        if not self._loader.handed_out or threading.get_ident() != self._thread:
            return
        stack = self._tracer.tracker.stack
        if len(stack) == 1 and not stack[0][2]:  # a call at the top, not an activation checkpoint's recompute
            last = self._tops.get(id(module))
            if last is not None:  # the model again (the next micro-batch): its last call's reads are not this one's
                self._seen = deque((e for e in self._seen if e[0] < last), maxlen=_SEEN)
            self._count += 1
            self._tops[id(module)] = self._count
        self._note_reads()
        shapes = self._loader.shapes
        handed = [weakref.ref(t) for t in _top_tensors(args) if tuple(t.shape) in shapes]
        if handed:
            self._see("values", handed)

    def _see(self, kind: str, what: list[Any]) -> None:
        self._count += 1
        self._seen.append((self._count, kind, what))

    def _note_reads(self) -> None:
        """The batches handed out that traced ops have read since this was last asked."""
        if not self._unread:
            return
        read, unread = [], []
        for entry in self._unread:
            alive = [t for t in (ref() for ref in entry[0]) if t is not None]
            if alive and any(self._tracer.has_read(t) for t in alive):
                read.append(entry[1])
            elif alive:  # one let go unread was never this step's
                unread.append(entry)
        if len(unread) != len(self._unread):
            # kept anew rather than removed: deque.remove compares the weak references, and so the tensors
            self._unread = deque(unread, maxlen=_UNREAD)
        if read:
            self._see("read", read)

    # -- which batch the bad rows are in -----------------------------------------------------------
    def _resolve(self, reading: tuple[Any, ...]) -> tuple[list[int] | None, str | None] | None:
        """The dataset indices of the step's batch, or (None, why not); None where no batch was
        handed out while the trace ran."""
        loader = self._loader
        if not loader.handed_out:
            return None
        several = False
        if reading:  # the op's own arguments first
            found = loader.holding(reading, whole=False)
            if _one(found):
                return loader.said(found)
            several = bool(found)
        self._note_reads()  # an op before any module call (a transform in the step) may have read it
        answer = self._answer
        if answer is None or answer[0] != self._count:  # values read once per state of what was seen
            answer = self._answer = (self._count, self._from_seen())
        named, several_seen = answer[1]
        if named is not None:
            return loader.said(named)
        if several or several_seen:
            return None, "several batches the DataLoader handed out hold what the step read"
        return None, (
            f"no tensor the step's ops or modules read is one of the last {loader.handed_out} batches "
            "the DataLoader handed out (changed after the loader: on the device, in another thread, or built by hand)"
        )

    def _from_seen(self) -> tuple[list[list[int] | None] | None, bool]:
        """`holding`'s answer where it names one batch, for the newest of what was seen that does
        (None where none does), and whether any held several."""
        loader = self._loader
        several = False
        for _, kind, what in reversed(self._seen):
            if kind == "read":
                found = what
            else:
                alive = [t for t in (ref() for ref in what) if t is not None]
                found = loader.holding(alive, whole=False) if alive else []
            if _one(found):
                return found, several
            several = several or bool(found)
        return None, several


def _one(found: list[list[int] | None]) -> bool:
    """`holding`'s answer names one batch (several that hold the same indices are one)."""
    return bool(found) and all(indices == found[0] for indices in found[1:])


def _top_tensors(args: Any) -> list[torch.Tensor]:
    """The tensors among a module's positional arguments and the lists or tuples in them: a
    batch's tensors come so (a full pytree walk at every module call would cost more)."""
    found = []
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(t for t in a if isinstance(t, torch.Tensor))
    return found
