"""What the trace keeps per op and per leaf, and the store that bounds how many it keeps.

A training script traced for thousands of steps makes a record per op per step. Blame only ever
reads records that are, or can still become, part of a non-finite story: non-finite ones and
what they consumed, and finite ones whose output tensors are still alive (a later op may read
them). `Store` keeps those and forgets the rest; a forgotten index reads as a finite placeholder,
so code that looks one up by index never fails.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar


def kind_of(lo: float, hi: float) -> str | None:
    """Non-finite kind from (min, max): aminmax propagates NaN, and infinities are extremes."""
    if math.isnan(lo) or math.isnan(hi):
        return "nan"
    if hi == math.inf:
        return "+inf"
    if lo == -math.inf:
        return "-inf"
    return None


@dataclass(slots=True)
class Output:
    shape: tuple[int, ...]
    dtype: str
    pending: Any = None  # the reduction's 0-dim results, not read yet (deferred mode)
    lo: float | None = None  # exact min and max, when known
    hi: float | None = None
    kind: str | None = None
    counts: dict[str, int] | None = None  # nan / inf counts, taken while the tensor was alive
    derived: bool = False  # not reduced: a value-preserving op of finite inputs, or uninitialised memory
    param: str | None = None  # the parameter or buffer this output was written into, in place

    @property
    def absmax(self) -> float | None:
        return None if self.lo is None or self.hi is None else max(abs(self.lo), abs(self.hi))


@dataclass(slots=True)
class Leaf:
    """A tensor the trace did not see being produced: a parameter, buffer, input or constant."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    lo: float | None = None
    hi: float | None = None
    kind: str | None = None
    counts: dict[str, int] | None = None
    first_use: int | None = None  # the record that first consumed it
    pending: Any = None  # the reduction's 0-dim results, not read yet (deferred mode)
    origin: str | None = None  # "collective": received from other ranks; else parameter/input by name
    rows: dict[str, Any] | None = None  # a non-finite one's bad rows along dim 0 (observe/loader.bad_rows)


@dataclass(slots=True)
class Record:
    index: int
    op: str
    phase: str
    module: str | None
    call: int | None  # which call of the module, or of this op at this line outside modules
    recompute: bool
    node: str | None  # the autograd node running, in backward
    forward_op: str | None  # in backward: the forward op whose backward this is
    location: tuple[str, int, str] | None
    inputs: list[tuple[str, int]]  # ("op", record index) or ("leaf", leaf index)
    outputs: list[Output] = field(default_factory=list)
    input_stats: list[dict[str, Any] | None] | None = None  # taken while the inputs were alive (non-finite records)
    consumed: bool = False
    mutates: str | None = None  # the (first) parameter an in-place op wrote
    bound: float | None = None  # the largest |output| arithmetic allows from its finite inputs (bounds.py)
    item: int | None = None  # made in a Dataset's __getitem__ (non-finite records): the index it read

    @property
    def kind(self) -> str | None:
        outputs = self.outputs
        if len(outputs) == 1:  # most ops: read on every op while a NaN is around, and at the end
            return outputs[0].kind
        kind = None
        for o in outputs:
            if o.kind == "nan":
                return "nan"
            kind = kind or o.kind
        return kind

    @property
    def pending(self) -> bool:
        return any(o.pending is not None for o in self.outputs)


T = TypeVar("T", Record, Leaf)


class Store(Generic[T]):
    """Items by index, in index order. `len()` counts every item ever added (indices stay
    comparable with it); iterating yields the ones kept."""

    def __init__(self, placeholder: Any) -> None:
        self._items: dict[int, T] = {}
        self._placeholder = placeholder  # index -> stand-in for a forgotten item
        self.count = 0

    def append(self, item: T) -> None:
        self._items[item.index] = item
        self.count = max(self.count, item.index + 1)

    def __getitem__(self, index: int) -> T:
        item = self._items.get(index)
        if item is None:
            if not 0 <= index < self.count:
                raise IndexError(index)
            item = self._placeholder(index)
        return item

    def __contains__(self, index: object) -> bool:
        return index in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items.values()))

    def __len__(self) -> int:
        return self.count

    @property
    def by_index(self) -> dict[int, T]:
        """The kept items by index: the dict itself, not a copy. The trace reads and writes it
        for every op it records, where `[]` would build a placeholder for a forgotten index and
        `append` would cost a call; whoever adds to it keeps `count` past every index added."""
        return self._items

    @property
    def kept(self) -> int:
        return len(self._items)

    def keep_only(self, indices: Iterable[int]) -> None:
        keep = set(indices)
        for i in [i for i in self._items if i not in keep]:  # in place: the tracer holds this dict
            del self._items[i]


def forgotten_record(index: int) -> Record:
    """A finite record nothing alive referred to any more."""
    return Record(index, "<finite op, not kept>", "forward", None, None, False, None, None, None, [])


def forgotten_leaf(index: int) -> Leaf:
    return Leaf(index, "input", (), "unknown")
