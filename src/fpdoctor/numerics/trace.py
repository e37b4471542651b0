"""`fpdoctor.trace()`: which op *produced* the NaN/Inf that reaches what the user sees.

A TorchDispatchMode sees every aten op, in forward, backward (the mode travels with autograd's
thread-local state) and the optimizer step. Each floating output gets one reduction: a sum,
which is non-finite whenever the tensor is, or for fp16/bf16/fp8 an `aminmax`, whose exact range
dtype headroom needs. Views alias their input and ops that only move or select finite values
are not reduced. Every output remembers which op produced it, so a non-finite value is traced
back to the ops that *produced* it (finite inputs, non-finite output) rather than those that
passed it on, and forward to the *sinks* it reaches: module outputs, values nobody consumed (a
loss), parameter gradients and optimizer updates. A NaN that never reaches a sink was masked
away and is not an error. On CPU every result is read at once (CPU ops are synchronous, so it
costs no sync); on an accelerator results are read in batches, one host sync per `SYNC_EVERY`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fpdoctor.numerics.modules import ModuleTracker

SYNC_EVERY = 256
_TAG = "_fpdoctor_source"  # attribute on traced tensors: (session, "op", record) or (session, "leaf", leaf, version)
_SESSIONS = itertools.count(1)

# Ops that cannot turn finite inputs into NaN/Inf: they move, select, compare or zero values.
_VALUE_PRESERVING = frozenset({
    "_unsafe_view", "clone", "copy", "copy_", "relu", "threshold_backward", "select_backward",
    "slice_backward", "embedding", "index_select", "gather", "cat", "stack", "where", "bernoulli", "bernoulli_",
    "repeat", "max", "min", "amax", "amin", "max_pool2d_with_indices", "index", "masked_select", "sort", "topk",
    "flip", "roll", "tril", "triu", "zero_", "zeros_like",
})  # fmt: skip
# Fresh memory holds garbage until it is written: not a value to check.
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that take a tensor only for its shape, dtype and device.
_SHAPE_ONLY = frozenset({
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_ones", "new_zeros", "new_empty", "new_full", "new_empty_strided",
})  # fmt: skip
_LOW_PRECISION = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_TORCH_DIR = os.path.dirname(torch.__file__)
_FPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fpdoctor's own frames are not the user's, except the casebook's models, which stand in for them.
_INTERNAL = (
    *(os.path.join(_FPDOCTOR_DIR, d) + os.sep for d in ("numerics", "env", "report", "cli", "catalog", "precision")),
    os.path.join(_FPDOCTOR_DIR, "__init__.py"),
    os.path.join(_FPDOCTOR_DIR, "__main__.py"),
)
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
        if not (filename.startswith((_TORCH_DIR, *_INTERNAL, _STDLIB_DIR)) or filename.startswith("<frozen")):
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


@dataclass(slots=True)
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
    inputs: list[tuple[str, int]]  # ("op", record index) or ("leaf", leaf index)
    outputs: list[Output] = field(default_factory=list)
    input_stats: list[dict[str, Any]] | None = None  # taken while the inputs were alive (non-finite records)
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
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))


def _checkable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.layout == torch.strided and t.numel() > 0


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t = t.float()
    return t


def _minmax(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.aminmax(_plain(t))


def _reduce(t: torch.Tensor) -> tuple[Any, ...]:
    """One reduction per output. Low-precision dtypes get aminmax: their exact range is what
    overflow headroom needs. Others get a sum, about 3x cheaper on a CPU, which is non-finite
    whenever the tensor is; the rare finite tensor whose sum overflows is re-checked exactly."""
    if t.dtype in _LOW_PRECISION:
        return _minmax(t)
    if t.is_complex():
        return (torch.view_as_real(t).sum(),)
    # Inside __torch_dispatch__ we run below autograd: no graph is recorded, no detach needed.
    return (t.sum(),)


def _counts(t: torch.Tensor) -> dict[str, int]:
    t = _plain(t)
    return {
        "nan": int(torch.isnan(t).sum()),
        "+inf": int(torch.isposinf(t).sum()),
        "-inf": int(torch.isneginf(t).sum()),
    }


def _resolve(output: Output, values: list[float], alive: torch.Tensor | None) -> None:
    """Set kind (and the exact range when known) from the reduction's values."""
    if len(values) == 2:
        output.lo, output.hi = values
        output.kind = kind_of(values[0], values[1])
    elif not math.isfinite(values[0]):
        if alive is None:  # gone before it could be re-checked (deferred mode)
            output.kind = "nan" if math.isnan(values[0]) else ("+inf" if values[0] > 0 else "-inf")
            return
        lo, hi = _minmax(alive)
        output.lo, output.hi = float(lo), float(hi)
        output.kind = kind_of(output.lo, output.hi)
    if output.kind and alive is not None:
        output.counts = _counts(alive)


def _stats(t: torch.Tensor) -> dict[str, Any]:
    lo, hi = _minmax(t)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "min": float(lo), "max": float(hi)}


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _tag(t: torch.Tensor, value: tuple[Any, ...]) -> None:
    # An attribute on the tensor object is the cheapest map from tensor to producer, and it dies
    # with the tensor. Python keeps one object per tensor, so the user sees the same object.
    setattr(t, _TAG, value)


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
        self._leaf_refs: list[Any] = []  # weak references to leaves that require grad
        self._pending: list[int] = []
        self._alive: dict[int, list[Any]] = {}  # record -> weakrefs to outputs, until read (deferred mode)
        self._func_info: dict[Any, tuple[str, str]] = {}
        self.immediate = immediate
        self.raise_on = raise_on
        self.on_nonfinite = on_nonfinite
        self.session = next(_SESSIONS)
        # autograd node sequence number -> (module, call, op, location) of the forward op that made it
        self._by_seq: dict[int, tuple[Any, ...]] = {}
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
        tag = getattr(t, _TAG, None)
        if tag is None and t._base is not None:
            return self._source(t._base, consumer)  # a view: its values (and its name) are its base's
        if tag is not None and tag[0] == self.session:
            if tag[1] == "op":
                self.records[tag[2]].consumed = True
                return ("op", tag[2])
            if tag[3] == t._version:
                return ("leaf", tag[2])
        name = self.tracker.param_names.get(t)
        leaf = Leaf(len(self.leaves), name or "input", tuple(t.shape), str(t.dtype), first_use=consumer)
        probe = Output(leaf.shape, leaf.dtype)
        _resolve(probe, [float(v) for v in _reduce(t)], t)  # same one-reduction check as op outputs
        leaf.lo, leaf.hi, leaf.kind, leaf.counts = probe.lo, probe.hi, probe.kind, probe.counts
        self.leaves.append(leaf)
        _tag(t, (self.session, "leaf", leaf.index, t._version))
        if t.requires_grad and t.is_leaf:
            self._leaf_refs.append((leaf.index, weakref.ref(t)))
        return ("leaf", leaf.index)

    def _inputs(self, values: Any, consumer: int, into: list[tuple[str, int]]) -> None:
        for value in values:
            if isinstance(value, torch.Tensor):
                if _checkable(value):
                    into.append(self._source(value, consumer))
            elif isinstance(value, (list, tuple)):
                self._inputs(value, consumer, into)

    def _input_stats(self, args: Any, kwargs: Any) -> list[dict[str, Any]]:
        tensors = [t for t in _tensors((args, kwargs)) if isinstance(t, torch.Tensor) and _checkable(t)]
        return [_stats(t) for t in tensors[:6]]

    def _finite(self, src: tuple[str, int]) -> bool:
        """Known finite right now (immediate mode); pending results count as unknown."""
        if src[0] == "leaf":
            return self.leaves[src[1]].kind is None
        return all(o.kind is None and o.pending is None for o in self.records[src[1]].outputs)

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any, seq: int) -> None:
        self.ops_seen += 1
        if func.is_view:
            # A view aliases its base: copy the base's tag (cheap). Views this misses (several
            # outputs) are found through `_base` when they are consumed.
            if type(out) is torch.Tensor and args and isinstance(args[0], torch.Tensor):
                tag = getattr(args[0], _TAG, None)
                if tag is not None:
                    setattr(out, _TAG, tag)
            return
        if type(out) is torch.Tensor:  # the common case, without the generic walk
            outs = [out] if _checkable(out) else []
        else:
            outs = [t for t in _tensors(out) if _checkable(t)]
        if not outs:
            return
        session = self.session
        info = self._func_info.get(func)
        if info is None:
            info = self._func_info[func] = (str(func), func.overloadpacket.__name__)
        op, name = info
        immediate = self.immediate if self.immediate is not None else outs[0].device.type == "cpu"
        if immediate and name in _VALUE_PRESERVING and len(outs) == 1:
            # One finite input moved or selected into one output (clone, reshape copies, relu):
            # alias it like a view. With a non-finite input it is recorded: relu(-inf) masks.
            sources = [t for t in _tensors(args) if isinstance(t, torch.Tensor) and _checkable(t)]
            if len(sources) == 1:
                src = self._source(sources[0], len(self.records))
                if self._finite(src):
                    t = outs[0]
                    _tag(t, (session, "op", src[1]) if src[0] == "op" else (session, "leaf", src[1], t._version))
                    module, call, _ = self.tracker.current
                    self._by_seq.setdefault(seq, (module, call, op, None))
                    return
        index = len(self.records)
        tracker = self.tracker
        # tracker.phase and tracker.current, inlined: this runs for every op
        in_bw = torch._C._current_graph_task_id() != -1
        phase = "backward" if in_bw else "optimizer" if tracker.in_optimizer else "forward"
        node_name = forward_op = location = None
        module, call, recompute = tracker.stack[-1] if tracker.stack else (None, None, False)
        if in_bw:
            node = torch._C._current_autograd_node()
            if node is not None:
                node_name = node.name()
                forward = self._by_seq.get(node._sequence_nr())
                if forward is not None:
                    module, call, forward_op, location = forward
        elif not immediate:
            # Deferred mode learns about a NaN later, when this stack is gone: take it now.
            location = user_location(sys._getframe(3))
        inputs: list[tuple[str, int]] = []
        if name not in _SHAPE_ONLY and name not in _UNINITIALISED:
            self._inputs(args, index, inputs)
            if kwargs:
                self._inputs(kwargs.values(), index, inputs)
        record = Record(index, op, phase, module, call, recompute, node_name, forward_op, location, inputs)
        if phase == "optimizer" and name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            record.mutates = tracker.param_names.get(args[0])
        self.records.append(record)
        self._by_seq.setdefault(seq, (module, call, op, location))
        # Ops that cannot make NaN/Inf out of finite values need no reduction when their inputs
        # are known finite.
        skip = name in _UNINITIALISED or (
            immediate and name in _VALUE_PRESERVING and all(self._finite(s) for s in inputs)
        )
        for t in outs:
            output = Output(tuple(t.shape), _dtype_name(t.dtype))
            if skip:
                output.derived = True
            else:
                reduced = _reduce(t)
                if immediate:
                    _resolve(output, [float(v) for v in reduced], t)
                else:
                    output.pending = reduced
            record.outputs.append(output)
            _tag(t, (session, "op", index))
        if immediate:
            if record.kind:
                record.input_stats = self._input_stats(args, kwargs)
                if record.location is None:
                    # forward: the line that ran this op; backward: the line that called backward()
                    record.location = user_location(sys._getframe(3))
                self._on_nonfinite(record)
        else:
            self._alive[index] = [weakref.ref(t) for t in outs]
            self._pending.append(index)
            if len(self._pending) >= SYNC_EVERY:
                self.flush()

    def flush(self) -> None:
        """Read pending results in one host transfer (deferred mode)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        flat = [v.float() for i in pending for o in self.records[i].outputs if o.pending for v in o.pending]
        devices = {v.device for v in flat}
        # One host transfer when everything is on one device.
        values = torch.stack(flat).tolist() if len(devices) == 1 else [float(v) for v in flat]
        position = 0
        for i in pending:
            record = self.records[i]
            refs = self._alive.pop(i, [])
            for n, output in enumerate(record.outputs):
                if output.pending is None:
                    continue
                width = len(output.pending)
                output.pending = None
                alive = refs[n]() if n < len(refs) else None
                _resolve(output, values[position : position + width], alive)
                position += width
            if record.kind:
                self._on_nonfinite(record)

    def _on_nonfinite(self, record: Record) -> None:
        if self.on_nonfinite is not None:
            self.on_nonfinite(self, record)

    # -- sinks -------------------------------------------------------------------------------
    def producer_of(self, t: torch.Tensor) -> int | None:
        tag = getattr(t, _TAG, None)
        if tag is None and t._base is not None:
            tag = getattr(t._base, _TAG, None)
        return tag[2] if tag is not None and tag[0] == self.session and tag[1] == "op" else None

    def absmax_of(self, t: torch.Tensor) -> float | None:
        """The largest magnitude the producing op's aminmax saw, when it took and read one."""
        index = self.producer_of(t)
        if index is None:
            return None
        out = self.records[index].outputs[0]
        return None if out.pending is not None else out.absmax

    def module_output(self, name: str, call: int, output: Any, recompute: bool) -> None:
        if recompute:
            return
        for t in _tensors(output):
            if isinstance(t, torch.Tensor):
                index = self.producer_of(t)
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
            index = self.producer_of(t.grad)
            if index is not None:
                self.sinks.append(("op", index, f"gradient of {name}"))
        for record in self.records:
            if record.mutates is not None:
                self.sinks.append(("op", record.index, f"parameter {record.mutates} (optimizer step)"))
            elif record.module is None and record.phase == "forward" and not record.consumed:
                self.sinks.append(("op", record.index, "a value returned to your code"))
