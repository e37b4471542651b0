"""`fpdoctor.trace()`: which op *produced* the NaN/Inf that reaches what the user sees.

A TorchDispatchMode sees every aten op, in forward, backward (the mode travels with autograd's
thread-local state) and the optimizer step. For each floating output it takes one reduction,
`aminmax`, which is NaN when the tensor holds a NaN and +-inf when it holds an infinity, and
doubles as the value range for dtype headroom. Views alias their input and are not reduced.
Every output remembers which op produced it, so a non-finite value is traced back to the ops
that *produced* it (finite inputs, non-finite output) rather than those that passed it on, and
forward to the *sinks* it reaches: module outputs, values nobody consumed (a loss), parameter
gradients and optimizer updates. A NaN that never reaches a sink was masked away and is not an
error. On CPU every result is read at once (CPU ops are synchronous, so it costs no sync); on
an accelerator results are read in batches, one host sync per `SYNC_EVERY` ops.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fpdoctor.numerics.modules import ModuleTracker

SYNC_EVERY = 256
# Ops that take a tensor only for its shape, dtype and device.
_SHAPE_ONLY = frozenset(
    {
        "ones_like",
        "zeros_like",
        "empty_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_ones",
        "new_zeros",
        "new_empty",
        "new_full",
        "new_empty_strided",
    }
)
_TORCH_DIR = os.path.dirname(torch.__file__)
_FPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = os.path.dirname(os.__file__)


class NonFiniteError(FloatingPointError):
    """Raised at the producing op when `trace(raise_on="nonfinite")`; `.finding` says where."""

    def __init__(self, message: str, finding: Any = None) -> None:
        super().__init__(message)
        self.finding = finding


def user_location(frame: FrameType | None) -> tuple[str, int, str] | None:
    """The innermost frame outside torch, fpdoctor and the standard library: the user's line."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith((_TORCH_DIR, _FPDOCTOR_DIR, _STDLIB_DIR)) or filename.startswith("<frozen")):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def kind_of(lo: float, hi: float) -> str | None:
    """Non-finite kind from (min, max): aminmax propagates NaN, and infinities are extremes."""
    if math.isnan(lo) or math.isnan(hi):
        return "nan"
    if hi == math.inf:
        return "+inf"
    if lo == -math.inf:
        return "-inf"
    return None


@dataclass
class Output:
    shape: tuple[int, ...]
    dtype: str
    pending: Any = None  # (min, max) 0-dim tensors not read yet
    lo: float = 0.0
    hi: float = 0.0
    kind: str | None = None
    counts: dict[str, int] | None = None  # nan / inf counts, taken while the tensor was alive

    @property
    def absmax(self) -> float:
        return max(abs(self.lo), abs(self.hi))


@dataclass
class Leaf:
    """A tensor the trace did not see being produced: a parameter, buffer, input or constant."""

    index: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    lo: float = 0.0
    hi: float = 0.0
    kind: str | None = None
    counts: dict[str, int] | None = None
    first_use: int | None = None  # the record that first consumed it


@dataclass
class Record:
    index: int
    op: str
    phase: str
    module: str | None
    call: int | None  # which call of the module (its iteration index)
    recompute: bool
    node: str | None  # the autograd node running, in backward
    forward_op: str | None  # in backward: the forward op whose backward this is
    location: tuple[str, int, str] | None
    inputs: list[tuple[str, int]]  # ("op", record index) or ("leaf", leaf index), with kind looked up later
    outputs: list[Output] = field(default_factory=list)
    consumed: bool = False
    mutates: str | None = None  # the parameter an in-place optimizer op writes

    @property
    def kind(self) -> str | None:
        kinds = {o.kind for o in self.outputs}
        return "nan" if "nan" in kinds else next((k for k in kinds if k), None)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _checkable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0 and t.layout == torch.strided


def _minmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or getattr(t, "is_quantized", False):
        t = t.float()
    return torch.aminmax(t)


def _counts(t: torch.Tensor) -> dict[str, int]:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    nan = int(torch.isnan(t).sum())
    pos = int(torch.isposinf(t).sum())
    neg = int(torch.isneginf(t).sum())
    return {"nan": nan, "+inf": pos, "-inf": neg}


class Tracer(TorchDispatchMode):
    """The recording half of `trace()`; `fpdoctor.numerics.blame` turns records into findings."""

    def __init__(
        self,
        tracker: ModuleTracker,
        *,
        immediate: bool | None = None,
        raise_on: str | None = None,
        on_nonfinite: Any = None,
    ) -> None:
        super().__init__()
        self.tracker = tracker
        self.records: list[Record] = []
        self.leaves: list[Leaf] = []
        self.errors: list[str] = []
        self.sinks: list[tuple[str, int, str]] = []  # (kind "op"/"leaf", index, description)
        self._producer: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> record index
        self._leaf_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> (leaf index, version)
        self._leaf_refs: list[Any] = []  # weak references to leaves that require grad
        self._pending: list[int] = []
        self._alive: dict[int, list[Any]] = {}  # record -> weakrefs to outputs, until read (deferred mode)
        self.immediate = immediate
        self.raise_on = raise_on
        self.on_nonfinite = on_nonfinite
        self._by_seq: dict[int, int] = {}  # autograd node sequence number -> forward record
        self.ops_seen = 0

    # -- recording ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # Autograd numbers the node it creates for this op just before dispatching below itself:
        # the counter read here is that node's number + 1 (the first op to see a number owns it).
        seq = torch._C._autograd._get_sequence_nr() - 1
        out = func(*args, **kwargs)
        try:
            self._record(func, args, kwargs, out, seq)
        except NonFiniteError:
            raise
        except Exception as exc:  # the observer never kills the job (SPEC 4)
            if len(self.errors) < 20:
                self.errors.append(f"{func}: {type(exc).__name__}: {exc}")
        return out

    def _source(self, t: torch.Tensor, consumer: int) -> tuple[str, int]:
        index = self._producer.get(t)
        if index is not None:
            self.records[index].consumed = True
            return ("op", index)
        seen = self._leaf_of.get(t)
        if seen is not None and seen[1] == t._version:
            return ("leaf", seen[0])
        name = self.tracker.param_names.get(t)
        leaf = Leaf(len(self.leaves), name or "input", tuple(t.shape), str(t.dtype), first_use=consumer)
        lo, hi = _minmax(t)
        leaf.lo, leaf.hi = float(lo), float(hi)
        leaf.kind = kind_of(leaf.lo, leaf.hi)
        if leaf.kind:
            leaf.counts = _counts(t)
        self.leaves.append(leaf)
        self._leaf_of[t] = (leaf.index, t._version)
        if t.requires_grad and t.is_leaf:
            import weakref

            self._leaf_refs.append((leaf.index, weakref.ref(t)))
        return ("leaf", leaf.index)

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any, seq: int) -> None:
        self.ops_seen += 1
        outs = [t for t in _tensors(out) if _checkable(t)]
        if not outs:
            return
        if func.is_view:
            # A view aliases its base: same values, same producer (or the same leaf).
            base = next((t for t in _tensors(args) if isinstance(t, torch.Tensor)), None)
            if base is not None and _checkable(base):
                kind, ref = self._source(base, len(self.records))
                for t in outs:
                    if kind == "op":
                        self._producer[t] = ref
                    else:
                        self._leaf_of[t] = (ref, t._version)
            return
        index = len(self.records)
        tracker = self.tracker
        phase = tracker.phase
        node_name = forward_op = None
        module, call, recompute = tracker.current
        if phase == "backward":
            node = torch._C._current_autograd_node()
            if node is not None:
                node_name = node.name()
                forward = self._by_seq.get(node._sequence_nr())
                if forward is not None:
                    fwd = self.records[forward]
                    module, call, forward_op = fwd.module, fwd.call, fwd.op
        if func.overloadpacket.__name__ in _SHAPE_ONLY:
            inputs: list[tuple[str, int]] = []  # reads the shape, not the values (backward()'s ones_like(loss))
        else:
            inputs = [self._source(t, index) for t in _tensors(args) if isinstance(t, torch.Tensor) and _checkable(t)]
            inputs += [
                self._source(t, index) for t in _tensors(kwargs) if isinstance(t, torch.Tensor) and _checkable(t)
            ]
        record = Record(
            index,
            str(func),
            phase,
            module,
            call,
            recompute,
            node_name,
            forward_op,
            user_location(sys._getframe(2)),
            inputs,
        )
        if phase == "optimizer" and func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            record.mutates = tracker.param_names.get(args[0])
        self.records.append(record)
        self._by_seq.setdefault(seq, index)
        immediate = self.immediate if self.immediate is not None else outs[0].device.type == "cpu"
        for t in outs:
            output = Output(tuple(t.shape), str(t.dtype))
            lo, hi = _minmax(t)
            if immediate:
                output.lo, output.hi = float(lo), float(hi)
                output.kind = kind_of(output.lo, output.hi)
                if output.kind:
                    output.counts = _counts(t)
            else:
                output.pending = (lo, hi)
            record.outputs.append(output)
            self._producer[t] = index
        if immediate:
            if record.kind:
                self._on_nonfinite(record)
        else:
            import weakref

            self._alive[index] = [weakref.ref(t) for t in outs]
            self._pending.append(index)
            if len(self._pending) >= SYNC_EVERY:
                self.flush()

    def flush(self) -> None:
        """Read pending results in one host transfer (deferred mode)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flat = [v.float() for i in pending for o in self.records[i].outputs for v in o.pending]
        devices = {v.device for v in flat}
        # One host transfer when everything is on one device.
        values = torch.stack(flat).tolist() if len(devices) == 1 else [float(v) for v in flat]
        position = 0
        for i in pending:
            record = self.records[i]
            refs = self._alive.pop(i, [])
            for n, output in enumerate(record.outputs):
                output.lo, output.hi = values[position], values[position + 1]
                position += 2
                output.pending = None
                output.kind = kind_of(output.lo, output.hi)
                if output.kind and n < len(refs):
                    alive = refs[n]()
                    if alive is not None:
                        output.counts = _counts(alive)
            if record.kind:
                self._on_nonfinite(record)

    def _on_nonfinite(self, record: Record) -> None:
        if self.on_nonfinite is not None:
            self.on_nonfinite(self, record)

    # -- sinks -------------------------------------------------------------------------------
    def module_output(self, name: str, call: int, output: Any, recompute: bool) -> None:
        if recompute:
            return
        for t in _tensors(output):
            if isinstance(t, torch.Tensor):
                index = self._producer.get(t)
                if index is not None:
                    self.sinks.append(("op", index, f"output of module {name or '<root>'} (call {call})"))

    def finish(self) -> None:
        """Read what is pending and collect the end-of-block sinks: gradients and loose values."""
        self.flush()
        for leaf_index, ref in self._leaf_refs:
            t = ref()
            if t is None or t.grad is None:
                continue
            name = self.leaves[leaf_index].name
            index = self._producer.get(t.grad)
            if index is not None:
                self.sinks.append(("op", index, f"gradient of {name}"))
        for record in self.records:
            if record.mutates is not None:
                self.sinks.append(("op", record.index, f"parameter {record.mutates} (optimizer step)"))
            elif record.module is None and record.phase == "forward" and not record.consumed:
                self.sinks.append(("op", record.index, "a value returned to your code"))
