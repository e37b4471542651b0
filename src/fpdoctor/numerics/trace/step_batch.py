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


class StepBatch(contextlib.AbstractContextManager["StepBatch"]):
    """While open, bad rows made in this thread are named by the batch the step was seen to read.
    `tracer` answers `has_read(t)` and `flush()` (the Tracer); `on_call` is the module tracker's
    hook at each module call."""

    def __init__(self, tracer: Any) -> None:
        self._tracer = tracer
        self._thread = threading.get_ident()
        self._loader = LoaderBatches(recent=RECENT, on_batch=self._handed)
        # batches handed out whose float tensors no traced op has read yet: (tensors, indices)
        self._unread: deque[tuple[list[weakref.ref[torch.Tensor]], list[int] | None]] = deque(maxlen=RECENT)
        # ("read", [indices of each batch read]) or ("values", [tensors a module was handed]), oldest first
        self._seen: deque[tuple[str, list[Any]]] = deque(maxlen=_SEEN)
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
        floats = [weakref.ref(t) for t in tensors_in(batch) if t.is_floating_point()]
        if floats:
            self._unread.append((floats, indices))

    def on_call(self, module: Any, args: Any) -> None:
        """A module is called (forward pre-hook): the batches read since the last call, and the
        tensors it was handed that are shaped like a batch's."""
        if threading.get_ident() != self._thread or not self._loader.handed_out:
            return
        self._note_reads()
        shapes = self._loader.shapes
        handed = [weakref.ref(t) for t in _top_tensors(args) if tuple(t.shape) in shapes]
        if handed:
            self._seen.append(("values", handed))

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
            self._unread = deque(unread, maxlen=RECENT)
        if read:
            self._seen.append(("read", read))

    # -- which batch the bad rows are in -----------------------------------------------------------
    def _resolve(self, reading: tuple[Any, ...]) -> tuple[list[int] | None, str | None] | None:
        """The dataset indices of the step's batch, or (None, why not); None where no batch was
        handed out while the trace ran."""
        loader = self._loader
        if not loader.handed_out:
            return None
        self._note_reads()  # an op before any module call (a transform in the step) may have read it
        several = False
        places: list[tuple[str, list[Any]]] = [("values", [reading])] if reading else []
        for kind, what in [*places, *reversed(self._seen)]:
            if kind == "read":
                found = what
            else:
                alive = [t for t in (v() if isinstance(v, weakref.ref) else v for v in what) if t is not None]
                found = loader.holding(alive, whole=False) if alive else []
            if found and all(indices == found[0] for indices in found[1:]):
                return loader.said(found)
            several = several or bool(found)
        if several:
            return None, "several batches the DataLoader handed out hold what the step read"
        return None, (
            f"no tensor the step's ops or modules read is one of the last {loader.handed_out} batches "
            "the DataLoader handed out (changed after the loader: on the device, in another thread, or built by hand)"
        )


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
