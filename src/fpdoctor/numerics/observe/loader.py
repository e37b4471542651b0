"""Which dataset rows the batch a step computes on holds: so that a NaN found in rows 3 and 7 of a
batch is also "dataset items 1043 and 2077", the items a user can open and look at.

A DataLoader iterator asks its sampler for index lists ahead of time (its workers prefetch), in the
order it hands the batches out (`in_order`, the default), so the index lists wait in a queue per
iterator and each batch handed out takes the oldest. Nothing is set on the iterators or the loader:
the queues are held here, by weak reference to the iterator. Per thread, the last batch handed out
is the one a plain loop's step computes on (`trace`, `watch`).

A framework's loop is not plain: Lightning fetches the next batch before the step where the loader
has no length, and accelerate's loader (the Hugging Face Trainer's) always does, so the last batch
handed out is the next step's. The framework callbacks keep a short trace of what was handed out
(`LoaderBatches(recent=N)`: each batch's shapes and a few of its values, with its indices) and find
the step's own batch in it by its values (`rows_of`), when a bad step is run again; where it is not
there (a batch changed after the loader, in a transfer hook or on the device) or it is ambiguous,
the rows' report says that their dataset items are not known, and why (`set_step_rows`), instead of
naming another batch's. A trace finds the step's batch the same way, by what the step's ops and
modules were seen to read (numerics/trace/step_batch.py): it hands `rows_from` a resolver that
`bad_rows` asks, with the tensors the op that made the bad rows read (`reading`).
"""

from __future__ import annotations

import contextlib
import math
import threading
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy
import torch

from fpdoctor.pytrees import tensors_in
from fpdoctor.torchprivate import dataloader_batches

# per thread, .rows: (the dataset indices of the batch the step computes on, or None; why they are
# not known, where that is worth saying, or None)
_last = threading.local()
_NOTHING: tuple[list[int] | None, str | None] = (None, None)


def last_batch() -> list[torch.Tensor] | None:
    """The tensors of the batch a DataLoader last handed out in this thread, while they live (None where
    no DataLoader built one under a LoaderBatches): its rows along dim 0 are its items."""
    refs = getattr(_last, "batch", None)
    if refs is None:
        return None
    return [t for t in (r() for r in refs) if t is not None]


def last_indices() -> list[int] | None:
    """The dataset indices of the batch a DataLoader last handed out in this thread (or the batch
    `set_step_rows` says a step computes on), in batch order; None when no DataLoader built one under a
    LoaderBatches, or when they are unknown (an IterableDataset, an out-of-order loader)."""
    return _rows()[0]


def _rows() -> tuple[list[int] | None, str | None]:
    return getattr(_last, "rows", _NOTHING)


# what a step's rows are asked of, given the tensors the op that made them read: (indices, why not),
# or None to leave it to the thread's last batch
Resolver = Callable[[tuple[Any, ...]], "tuple[list[int] | None, str | None] | None"]


def _step_rows() -> tuple[list[int] | None, str | None]:
    resolver = getattr(_last, "resolver", None)
    if resolver is not None:
        try:
            found = resolver(getattr(_last, "reading", ()))
        except Exception as exc:  # ours: the rows are still named by their place, the check that asked goes on
            return None, f"which batch the step read could not be told ({type(exc).__name__}: {exc})"
        if found is not None:
            return found
    return _rows()


@contextlib.contextmanager
def rows_from(resolver: Resolver) -> Iterator[None]:
    """Inside, in this thread, `bad_rows` asks `resolver` which batch the step computes on (a
    trace: the batch its ops were seen to read) before the last batch handed out."""
    saved = getattr(_last, "resolver", None)
    _last.resolver = resolver
    try:
        yield
    finally:
        _last.resolver = saved


@contextlib.contextmanager
def reading(values: tuple[Any, ...]) -> Iterator[None]:
    """Inside, in this thread, `values` are what the op whose bad rows are named read (its
    arguments, or the bad input itself): the first place the resolver looks for a batch's tensors."""
    saved = getattr(_last, "reading", ())
    _last.reading = values
    try:
        yield
    finally:
        _last.reading = saved


@contextlib.contextmanager
def rows_kept() -> Iterator[None]:
    """What the thread says of its batch comes back on exit, whatever `set_step_rows` set inside
    without a block of its own (a replay's micro-batches, one after another)."""
    saved = _rows()
    try:
        yield
    finally:
        _last.rows = saved


def set_step_rows(rows: tuple[list[int] | None, str | None]) -> None:
    """The batch the step about to run computes on holds `rows`, until the next batch is handed
    out or an enclosing `rows_kept` ends: for a replay, whose tracer reads the rows as late as its
    own end."""
    _last.rows = rows


# -- one patch of the DataLoader for every open LoaderBatches, in any order of closing -------------
_lock = threading.Lock()
_open: list[LoaderBatches] = []
_patch: list[contextlib.ExitStack] = []  # the one patch, while any is open


def _on_indices(iterator: Any, indices: Any) -> None:
    for watcher in list(_open):
        watcher._on_indices(iterator, indices)


def _on_batch(iterator: Any, in_order: bool, batch: Any) -> None:
    with contextlib.suppress(TypeError):  # a tensor subclass without weak references: not kept
        _last.batch = [weakref.ref(t) for t in tensors_in(batch)]
    watchers = list(_open)
    for watcher in watchers:
        watcher._on_batch(iterator, in_order, batch)
    for watcher in watchers:  # after all have recorded it: a listener may read what they say
        watcher._tell(batch)


class LoaderBatches(contextlib.AbstractContextManager["LoaderBatches"]):
    """While open, every DataLoader batch handed out records its dataset indices (`last_indices`);
    with `recent`, the last `recent` batches handed out are kept as (shapes and a few values,
    indices), for `rows_of` to find a step's batch among them. `on_batch(batch, indices)` hears of
    each batch handed out in the thread that opened it, once recorded."""

    def __init__(self, recent: int = 0, on_batch: Callable[[Any, list[int] | None], None] | None = None) -> None:
        self._queues: weakref.WeakKeyDictionary[Any, deque[Any]] = weakref.WeakKeyDictionary()
        self._saved: tuple[list[int] | None, str | None] = _NOTHING
        self._recent: deque[tuple[list[_Leaf], list[int] | None]] | None = deque(maxlen=recent) if recent else None
        # the shapes of the recent batches' tensors: a tensor of another shape is none of them (not read)
        self.shapes: Counter[tuple[int, ...]] = Counter()
        self._mine: int | None = None  # the thread that opened it: a batch handed out elsewhere is not its step's
        self._listener = on_batch
        self._told: tuple[Any, list[int] | None] | None = None  # the batch handed out, until `_tell`

    def __enter__(self) -> LoaderBatches:
        # not cleared: a replay traced inside a watched step reads the batch the step was given
        self._saved = _rows()
        self._mine = threading.get_ident()
        with _lock:
            if not _open:
                stack = contextlib.ExitStack()
                stack.enter_context(dataloader_batches(_on_indices, _on_batch))
                _patch.append(stack)
            _open.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Closed (once; again is nothing): the DataLoader is put back as it was once the last open
        one closes, whichever closes first (a callback's, ended at exit, may outlive `watch`'s)."""
        with _lock:
            if self not in _open:
                return
            _open.remove(self)
            stacks = [] if _open else [_patch.pop() for _ in list(_patch)]
        for stack in stacks:
            stack.close()
        if threading.get_ident() == self._mine:
            _last.rows = self._saved  # what the enclosing one (or nothing) last saw

    def _on_indices(self, iterator: Any, indices: Any) -> None:
        try:
            if indices is None:  # a reset: what was prefetched for the last epoch is dropped
                self._queues.pop(iterator, None)
            else:
                self._queues.setdefault(iterator, deque()).append(indices)
        except TypeError:  # an iterator that cannot be weakly referenced: rows go unnamed
            pass

    def _on_batch(self, iterator: Any, in_order: bool, batch: Any) -> None:
        queue = self._queues.get(iterator)
        indices = queue.popleft() if queue else None
        flat = _flat(indices) if in_order else None
        _last.rows = (flat, None)
        if threading.get_ident() != self._mine:
            return
        if self._listener is not None:
            self._told = (batch, flat)
        if self._recent is not None:
            # a few values of a batch on the host: microseconds, no device read; a batch we cannot
            # read is not matched, and the loader goes on
            with contextlib.suppress(Exception):
                leaves = _leaves(batch, read=lambda t: t.device.type == "cpu")
                recent = self._recent
                if len(recent) == recent.maxlen:
                    self.shapes.subtract(leaf.shape for leaf in recent[0][0])
                recent.append((leaves, flat))
                self.shapes.update(leaf.shape for leaf in leaves)
                self.shapes += Counter()  # the shapes no kept batch has any more go

    def _tell(self, batch: Any) -> None:
        told, self._told = self._told, None
        if told is not None and told[0] is batch and self._listener is not None:
            with contextlib.suppress(Exception):  # the listener's failure is not the loader's
                self._listener(*told)

    @property
    def handed_out(self) -> int:
        """How many of the recent batches are kept (0: none was handed out while open)."""
        return len(self._recent) if self._recent is not None else 0

    def rows_of(self, inputs: Any, *, whole: bool = True) -> tuple[list[int] | None, str | None]:
        """Which of the recent batches handed out the step's `inputs` are (the arguments the
        framework hands the step or the model: the batch, moved to the device or not): its dataset
        indices, or (None, why they are not known). A few values are read from the inputs shaped
        like a batch's tensor: a host read on a device, once per call (bad steps and their checks
        only). `whole=False`: the inputs hold some of a batch's tensors (a model handed the
        features, not the labels), see `holding`."""
        if self._recent is None:
            return None, "the DataLoader's batches were not followed"
        if not self._recent:
            return None, "no DataLoader batch was handed out while the callback watched"
        return self.said(self.holding(inputs, whole=whole))

    def holding(self, inputs: Any, *, whole: bool = True) -> list[list[int] | None]:
        """The dataset indices (None: not said) of each recent batch that `inputs` hold: every tensor
        of the batch among them (`whole`), or else the batches that share the most tensors with
        them (one at least). Empty when none does."""
        recent = self._recent or ()
        shapes = self.shapes
        given = _leaves(inputs, read=lambda t: tuple(t.shape) in shapes)
        if whole:
            return [indices for leaves, indices in recent if _within(leaves, given)]
        shared = [(_shared(leaves, given), indices) for leaves, indices in recent]
        most = max((n for n, _ in shared), default=0)
        return [indices for n, indices in shared if n == most] if most else []

    def said(self, found: list[list[int] | None]) -> tuple[list[int] | None, str | None]:
        """What `holding`'s answer says of the step's rows: the dataset indices of the one batch
        found, or (None, why they are not known)."""
        if not found:
            return None, (
                f"the step's batch is none of the last {self.handed_out} the DataLoader handed out "
                "(changed after the loader: in a transfer hook, on the device, or built by hand)"
            )
        if any(indices != found[0] for indices in found[1:]):
            return None, "several batches the DataLoader handed out hold the step's values"
        if found[0] is None:
            return None, "the DataLoader does not say which items it drew (an IterableDataset, or out of order)"
        return found[0], None


_SAMPLE = 16  # values read from each tensor of a batch, spread over it


class _Leaf:
    """One tensor of a batch: its shape and a few of its values (None where not read)."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: tuple[int, ...], values: list[float] | None) -> None:
        self.shape, self.values = shape, values


def _leaves(value: Any, *, read: Any) -> list[_Leaf]:
    """The tensors of a batch (dicts and Mappings such as a tokenizer's BatchEncoding opened), each
    with `_SAMPLE` of its values where `read(t)` (the same places in any tensor of that shape)."""
    out: list[_Leaf] = []
    for t in _tensors(value):
        n = t.numel()
        values = None
        if n and read(t):
            values = _sample(t.detach(), n)
        out.append(_Leaf(tuple(t.shape), values))
    return out


def _sample(t: torch.Tensor, n: int) -> list[float]:
    """`_SAMPLE` values of `t` spread over it, as indices per dim: a gather, never a copy of a strided
    batch. A host tensor numpy can view is read through numpy (12 us a tensor, where the same few
    torch ops cost 0.4 ms on a loaded machine); others (a device, bf16) through torch."""
    k = min(_SAMPLE, n)
    places = [i * (n - 1) // (k - 1) for i in range(k)] if k > 1 else [0]
    if not t.dim():
        return [float(t.item())]
    if t.device.type == "cpu" and t.dtype in _NUMPY:
        array = t.numpy()
        return [float(v) for v in array[numpy.unravel_index(places, array.shape)].tolist()]
    at = torch.tensor(places, device=t.device)
    return [float(v) for v in t[torch.unravel_index(at, t.shape)].double().tolist()]


_NUMPY = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
          torch.bool}  # fmt: skip


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, Mapping) and not isinstance(value, dict):
        value = dict(value)
    return tensors_in(value)


def _within(handed: list[_Leaf], given: list[_Leaf]) -> bool:
    """Every tensor of a batch handed out (each read) is among the step's: the same shape and
    values (to bf16's precision: a transfer may change the dtype). The step may hold more (a
    framework's own arguments: a batch index)."""
    if not handed or any(leaf.values is None for leaf in handed):
        return False
    return all(any(g.shape == h.shape and _same(g.values, h.values) for g in given) for h in handed)


def _shared(handed: list[_Leaf], given: list[_Leaf]) -> int:
    """How many tensors of a batch handed out (each read) are among `given`."""
    return sum(
        1
        for h in handed
        if h.values is not None and any(g.shape == h.shape and _same(g.values, h.values) for g in given)
    )


def _same(a: list[float] | None, b: list[float] | None) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    pairs = zip(a, b, strict=True)
    return all(x == y or (math.isnan(x) and math.isnan(y)) or abs(x - y) <= 2**-7 * abs(y) for x, y in pairs)


def _flat(indices: Any) -> list[int] | None:
    """A batch sampler's list of ints, or a single int (batch_size=None); None for anything else
    (an IterableDataset's sampler yields None)."""
    if isinstance(indices, int):
        return [indices]
    if isinstance(indices, (list, tuple)) and indices and all(isinstance(i, int) for i in indices):
        return list(indices)
    return None


# A few rows of a batch whose values stand out from every other row's by this factor are the data's
# doing, not the precision's: the rows of one recipe's activations differ by far less (a few times in a
# healthy batch). A corrupt reading, a unit error or an item left unnormalised does this.
OUTLIER = 1e3
OUTLIER_SHARE = 0.25  # at most this share of the rows: where most stand out, the others do


def standing_out(t: torch.Tensor) -> tuple[list[int], float, float] | None:
    """The rows along dim 0 of `t` (finite, at least 4 rows) whose largest |x| is OUTLIER times every
    other row's, at most OUTLIER_SHARE of them: (their places, the largest |x| among them, the largest
    among the others); None where no row does."""
    if t.dim() < 1 or t.shape[0] < 4 or not t.is_floating_point() or not bool(torch.isfinite(t).all()):
        return None
    flat = t.detach().reshape(t.shape[0], -1)  # each row's largest |x| without an |x| of the whole tensor
    size = torch.maximum(flat.amax(1).double().abs(), flat.amin(1).double().abs())
    order = torch.argsort(size, descending=True)
    ranked = size[order].tolist()
    k = next((i + 1 for i in range(int(len(ranked) * OUTLIER_SHARE)) if ranked[i] > OUTLIER * ranked[i + 1] > 0), None)
    return None if k is None else (sorted(order[:k].tolist()), ranked[0], ranked[k])


def bad_rows(t: torch.Tensor, *, batch: bool = False) -> dict[str, Any] | None:
    """The rows along dim 0 of `t` that hold NaN/Inf, where only some do: their places and, where
    dim 0 is as long as the step's batch, the dataset items they are (the batch a trace saw the step
    read, `rows_from`, else the DataLoader's last batch, or `set_step_rows`'s). Dim 0 is said to be
    the batch where the items matched it or the caller knows (`batch`: an activation of the forward);
    a weight's rows, an optimizer state's, are rows of their own."""
    if t.dim() < 2 or t.shape[0] < 2:
        return None
    bad = (~torch.isfinite(t.detach())).reshape(t.shape[0], -1).any(1)
    count = int(bad.sum())
    if count in (0, t.shape[0]):
        return None
    return rows_found(bad.nonzero().flatten().tolist(), t.shape[0], batch=batch)


def rows_found(indices: list[int], of: int, *, batch: bool) -> dict[str, Any]:
    """Rows `indices` of `of` along dim 0, and where `of` is the step's batch, the dataset items
    they are (`bad_rows`'s form: what `rows_text` says)."""
    found: dict[str, Any] = {"indices": indices, "of": of, "batch": batch}
    items, unknown = _step_rows()
    if items is not None and len(items) == of:
        found["dataset_indices"] = [items[i] for i in indices]
        found["batch"] = True
    elif items is not None:  # the step's batch is known, and dim 0 is not it (a bmm's batch x heads)
        found["batch"] = False
    elif unknown is not None:
        found["dataset_indices_unknown"] = unknown
    return found


def rows_text(rows: dict[str, Any] | None, *, stand_out: bool = False) -> str:
    """' It is in rows 3, 7 of the 16 along dim 0 (the batch) (dataset items 1043, 2077 ...)'; with
    `stand_out`, ' Rows 3, 7 of the 16 along dim 0 (the batch) stand out (dataset items ...)'."""
    if rows is None:
        return ""
    one = len(rows["indices"]) == 1
    listed = ", ".join(str(i) for i in rows["indices"][:8]) + (" ..." if len(rows["indices"]) > 8 else "")
    batch = " (the batch)" if rows.get("batch", True) else ""
    if stand_out:
        text = (
            f" {'Row' if one else 'Rows'} {listed} of the {rows['of']} along dim 0{batch} stand{'s' if one else ''} out"
        )
    else:
        text = (
            f" It is in {'row' if one else 'rows'} {listed} of the {rows['of']} along dim 0{batch}, not in the others"
        )
    if rows.get("dataset_indices"):
        items = rows["dataset_indices"]
        named = ", ".join(str(i) for i in items[:8]) + (" ..." if len(items) > 8 else "")
        text += (
            f" (dataset item {named}, drawn by the DataLoader's sampler: dataset[{named}] reads it)"
            if one
            else f" (dataset items {named}, drawn by the DataLoader's sampler: dataset[i] reads each)"
        )
    elif rows.get("dataset_indices_unknown"):
        text += f" (which dataset items they are is not known: {rows['dataset_indices_unknown']})"
    if rows.get("differs"):
        text += f": {rows['differs']}" if stand_out else f": in those rows {rows['differs']}"
    return text + "."
