"""The tracer behind `fpdoctor.trace()`: which op *produced* the NaN/Inf that reaches what the user sees.

A TorchDispatchMode sees every aten op, in forward, backward (the mode travels with autograd's
thread-local state) and the optimizer step. Each floating output gets one reduction, and so does
every tensor an op writes in place (foreach and fused optimizers return nothing: what they write
is their output). Views alias their input and ops that only move or select finite values are not
reduced. Every output remembers, in a side table, which op produced it, so a non-finite value is
traced back to the ops that *produced* it (finite inputs, non-finite output) rather than those
that passed it on, and forward to the *sinks* it reaches: module outputs, values nobody consumed
(a loss), gradients of leaf tensors and parameters written in place. A NaN that never reaches a
sink was masked away and is not an error.

On CPU every result is read at once (CPU ops are synchronous, so it costs no sync) and the
reduction is a sum, non-finite whenever the tensor is, re-checked exactly while the tensor is
alive (a finite fp32 tensor's sum can overflow). On an accelerator results are read in batches,
one host sync per `sync_every` ops, when the tensor may be gone: there the reduction is an
`aminmax`, exact on any finite data and one kernel like the sum.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
import weakref
from collections import Counter
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from fpdoctor.formats import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE
from fpdoctor.numerics.engine import on_loss, stable
from fpdoctor.numerics.engine.reruns import (
    PICKS,
    PRODUCER_LINES,
    PRODUCERS,
    SINGULAR,
    ZEROING,
    Experiment,
    OnLoss,
    Step,
    Window,
    completed_form,
    decide,
    op_packet,
    zeroed_exactly,
)
from fpdoctor.numerics.observe import records as _records
from fpdoctor.numerics.observe.loader import bad_rows, reading
from fpdoctor.numerics.observe.records import Leaf, Output, Record, Store, kind_of
from fpdoctor.numerics.observe.values import (
    AMINMAX,
    CHECKABLE,
    REAL,
    STRIDED,
    checkable,
    deferred_range,
    dtype_name,
    minmax,
    narrows,
    read_scalars,
    reduce,
    resolve,
    stats,
    version,
)
from fpdoctor.numerics.trace.bounds import output_bound
from fpdoctor.numerics.trace.flushed import SQUARES, FlushedSquares
from fpdoctor.numerics.trace.lost_updates import OUT_FORMS, WATCHED, LostUpdates, Statement, same_memory
from fpdoctor.numerics.trace.modules import ModuleTracker
from fpdoctor.numerics.trace.ops import FUNCTIONAL, GENERAL, IN_PLACE, SELECTS, VIEW, OpInfo, tensor_args
from fpdoctor.provenance import Provenance
from fpdoctor.pytrees import tensors_in
from fpdoctor.torchprivate import (
    DisableTorchDispatch,
    EagerDispatchMode,
    current_autograd_node,
    graph_task_id,
    mode_stack,
    queue_callback,
    sequence_nr,
)
from fpdoctor.userframes import dataset_item, user_location, user_place

__all__ = ["Leaf", "NonFiniteError", "Output", "Record", "Tracer", "kind_of"]

SYNC_EVERY = 256  # deferred mode: pending results read per host sync, unless the tracer says otherwise
COMPACT_EVERY = 4096  # records made between two passes that forget what nothing refers to
_PIN_LIMIT = 100_000  # records kept for being non-finite or made from non-finite values
# From this magnitude a forward output is near its format's max (fp32: near fp16's, the what-if):
# its source line is taken at once, as for a non-finite value (immediate mode has no other).
_NEAR = {
    getattr(torch, name.removeprefix("torch.")): OVERFLOW_SHARE * FORMATS["fp16" if fmt == "fp32" else fmt].max
    for name, fmt in DTYPE_FORMAT.items()
}
# Ops that can make values much larger than their inputs: products and their sums, powers,
# exponentials, divisions. Where fp32 values come near fp16's max inside a module, one of these
# made them; the others stay within their inputs' range (norms, softmax, activations) or at
# most double it (add: a residual sum, which the module's output shows), so the fp16 what-ifs
# of ops take exact ranges of these alone.
GROWS = frozenset({
    "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "matmul", "linear", "einsum", "convolution",
    "_convolution", "mkldnn_convolution", "exp", "exp2", "expm1", "pow", "square", "sum", "cumsum", "prod", "mul",
    "div", "reciprocal", "rsqrt", "var", "var_mean", "std", "linalg_vector_norm", "norm", "sinh", "cosh",
})  # fmt: skip


_OP_INFO: dict[int, OpInfo] = {}  # per aten overload, shared by every trace (a replay traces a few steps)
# looked up once: the hot path runs for every op
Tensor = torch.Tensor
_ref = weakref.ref
_aminmax = torch.aminmax
_sequence_nr = sequence_nr
_graph_task_id = graph_task_id

# the sink of a value the traced code handed back to Python (read there: a .item(), a comparison)
RETURNED = "a value returned to your code"


class NonFiniteError(FloatingPointError):
    """Raised at the producing op when `trace(raise_on="nonfinite")`; `.finding` says where."""

    def __init__(self, message: str, finding: Any = None) -> None:
        super().__init__(message)
        self.finding = finding


_NARROW = (torch.float16, torch.bfloat16)
# the ops of a hand-written backward that compute a derivative singular where its forward's is (1 / (2 sqrt(x)))
_DIVISIONS = frozenset({"div", "div_", "reciprocal", "rsqrt"})
GUARD_EPS = 1e-3  # the largest constant added before a log read as a guard against log(0)
_COMPLETES = frozenset({"log", "div"})  # ops that may complete a form whose exp overflowed (_completed)
STATEMENT_OPS = 32  # ops of one statement a copy_ writes back, redone to check it (lost_updates.py)
# the visits of a line kept (the first record of each): a state rebound there is read a visit later, or a
# loop over a model's parameters later (one visit per parameter)
VISITS_KEPT = 8192
_TINY = {dt: float(torch.finfo(dt).smallest_normal) * float(torch.finfo(dt).eps) / 2 for dt in _NARROW}


def _rounds_away(args: Any, dtype: torch.dtype) -> bool:
    """A non-zero float among the op's positional arguments that is 0 in `dtype` (below half its
    smallest subnormal): one comparison per float argument, no tensor touched."""
    tiny = _TINY[dtype]
    return any(type(a) is float and a != 0.0 and abs(a) < tiny for a in args)


def _near_limit(output: Output, dtype: torch.dtype) -> bool:
    """A finite output whose exact range reaches `overflow-risk`'s share of its format's max."""
    lo, hi = output.lo, output.hi
    return output.kind is None and lo is not None and hi is not None and max(hi, -lo) >= _NEAR.get(dtype, math.inf)


class Tracer(EagerDispatchMode):
    """The recording half of `trace()`; `fpdoctor.numerics.trace.blame` turns records into findings."""

    def __init__(
        self,
        tracker: ModuleTracker,
        *,
        immediate: bool | None = None,
        raise_on: str | None = None,
        on_nonfinite: Any = None,
        sync_every: int | None = None,
        ranges: bool = False,
        fast_paths: bool = True,
        on_produced: Any = None,
    ) -> None:
        """`ranges`: exact ranges (aminmax) of the fp32 forward outputs of the ops that GROWS
        names, in immediate mode too, for headroom's fp16 what-ifs of ops; off by default, as a
        sum costs a third of it on a CPU. `fast_paths=False` sends every op through `_record`,
        the general path, as inside an outer trace: the fast paths must record the same.
        `on_produced(record, func, args, kwargs, outs=, written=)` is called, in immediate mode,
        when an op makes non-finite values from finite inputs, while its inputs are still alive."""
        super().__init__()
        self.tracker = tracker
        self.records: Store[Record] = Store(_records.forgotten_record)
        self.leaves: Store[Leaf] = Store(_records.forgotten_leaf)
        self.errors: list[str] = []
        self.sinks: list[tuple[str, int, str]] = []  # (kind "op"/"leaf", index, description)
        self.provenance = Provenance()  # tensor -> (("op"|"leaf", index), leaf version or None)
        self.immediate = immediate
        self.raise_on = raise_on
        self.on_nonfinite = on_nonfinite
        self.on_produced = on_produced
        self.sync_every = sync_every or SYNC_EVERY
        self.ranges = ranges
        self.fast_paths = fast_paths
        self.ops_seen = 0
        # Read and written for every op, without the Store's and Provenance's methods (a call each)
        self._items = self.records.by_index
        self._table = self.provenance.table
        self._sink_keys: set[tuple[int, str]] = set()
        self._grad_leaves: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}  # leaves that require grad
        self._received: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}  # written by a collective
        self._compiled: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}  # made by a compiled graph
        self._graph_task = -1  # the last backward that was asked to report gradient sinks at its end
        # deferred mode, until read: each record with weak references to its outputs, and each
        # leaf with one to its tensor and what its rows need (its version then, whether a batch)
        self._pending: list[tuple[Record, tuple[Any, ...]]] = []
        self._pending_leaves: list[tuple[Leaf, Any, int, bool]] = []
        self._site_calls: Counter[tuple[str, Any]] = Counter()  # (op, user line) -> calls outside modules
        # autograd node sequence number -> (module, call, op, location) of the forward op that made it
        self._by_seq: dict[int, tuple[Any, ...]] = {}
        self._seq_index: dict[int, int] = {}  # an autograd node's number -> the record of the op that made it
        self.aside = 0  # > 0 while an observer's own work runs inside the traced program (TracedStep.aside)
        # gradients of a scaled output watched until an op reads them (scaled_grads.py): each op passes
        # through its `read` while any is watched
        self.scaled_grads: Any = None
        self._reading = False
        self._pinned: set[int] = set()  # records blame may read: non-finite ones and their inputs
        self._pinned_leaves: set[int] = set()
        self._tainted: set[tuple[str, int]] = set()  # non-finite values and what was made from them
        self._overflow_best: dict[tuple[Any, ...], tuple[float, int]] = {}  # kept for headroom's overflow
        self._exemplars: dict[tuple[Any, ...], int] = {}  # kept: the latest record of each kind of op
        self._next_compact = COMPACT_EVERY
        # the last ops' arguments, by reference, for the experiments at the first NaN and Inf producers
        self._window = Window()
        self.lost_updates = LostUpdates()  # in-place running updates a narrow tensor rounds away
        # per line outside modules: (start of its previous visit, start of its current one), record indices
        # each line's visits outside modules (its records in a row), by the index of their first record
        self._visits: dict[tuple[str, int], list[int]] = {}
        self._visit_line: tuple[str, int] | None = None  # the line outside modules the last record ran at
        self._visit_lasti: tuple[int, int] | None = None  # its frame and bytecode offset
        self.flushed = FlushedSquares()  # squares a narrow format flushes to zero (a norm by hand)
        self._decided: Counter[str] = Counter()  # "nan" / "inf": producers experimented on
        self._keys: set[tuple[Any, ...]] = set()  # their (op, forward op, location)s
        self.experiments: dict[int, Experiment] = {}  # record index -> what was re-run there
        # (op, line) of an op that made an overflow's Inf finite -> whether the exact computation gives the same
        self.zeroed_exact: dict[tuple[str, Any], bool | None] = {}
        self._zeroed_calls: dict[tuple[str, Any], int] = {}  # such calls seen per op and line
        # hand-written composites met once an exp overflowed, by the line of their exp (_completed)
        self.forms: dict[str, stable.Met] = {}
        self._loss_checked: set[int] = set()  # experiments whose fixes were re-run down to the loss
        self._nested = False
        self._general_only = not fast_paths  # every op through `_record`: nested, or asked for
        tracker.on_names = self._named

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Dynamo then compiles and runs a frame entered under the trace (instead of running it
        # uncompiled), with this mode off while it traces; around each compiled graph the mode
        # steps aside (numerics/compiled/under_trace.py), so it never sees the compiled program's inside.
        return True

    def made_by_compiled(self, tensors: list[torch.Tensor], graph: str) -> None:
        """`tensors` were made by compiled graph `graph`, which the trace did not see run: an op
        that uses one names it as its source."""
        for t in tensors:
            base = t._base if t._base is not None else t
            self._table.pop(id(base), None)
            self._table.pop(id(t), None)
            self._compiled[id(base)] = (weakref.ref(base), graph)

    def __enter__(self) -> Tracer:
        # Inside an outer trace, our own statistics must not be recorded by it as the user's ops.
        self._nested = any(isinstance(m, Tracer) for m in mode_stack())
        self._general_only = self._nested or not self.fast_paths
        super().__enter__()
        return self

    # -- recording ---------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.aside:  # an observer's own work in the program's hooks (the watch judging a step): not the program's
            return func(*args, **(kwargs or {}))
        watched = self.scaled_grads
        if watched is not None and watched.pending and not self._reading:
            self._reading = True
            try:
                out = self.__torch_dispatch__(func, types, args, kwargs)
            finally:
                self._reading = False
            try:
                watched.read(func, args, out, func.is_view)
            except Exception as exc:  # the observer never kills the job
                self._error(func, exc)
            return out
        info = _OP_INFO.get(id(func))  # by id: an OpOverload's __hash__ is Python code
        if info is None:
            info = _OP_INFO[id(func)] = OpInfo(func)
        path = info.path
        if path == VIEW and not self._general_only:
            out = func(*args, **kwargs) if kwargs else func(*args)
            self.ops_seen += 1
            try:
                # `_view`, inlined: views are about a third of all ops
                if type(out) is Tensor and args:
                    entry = self._table.get(id(args[0]))
                    if entry is not None and entry[0]() is args[0]:
                        self._set(out, entry[1])
            except Exception as exc:  # the observer never kills the job
                self._error(func, exc)
            return out
        if info.rebuilds:  # a tensor rebuilt from memory made elsewhere: an input at its first read, as a batch is
            out = func(*args, **kwargs) if kwargs else func(*args)
            self.ops_seen += 1
            self._table.pop(id(args[0]), None)
            return out
        # Autograd numbers the node it creates for this op just before dispatching below itself:
        # the counter read here is that node's number + 1 (the first op to see a number owns it).
        seq = _sequence_nr() - 1
        if path != GENERAL and not self._general_only:
            # The common cases without the general bookkeeping: a value out of values, or an
            # in-place op on its first argument (probed first when the trace has not met it).
            probed = None
            if path == IN_PLACE and not self._met(args[0]):
                try:
                    probed = self._before_write([args[0]])
                except Exception as exc:  # the observer never kills the job
                    self._error(func, exc)
            # a running update a narrow tensor may round away (add_, a norm's statistics, lerp(..., out=s))
            if info.name in WATCHED or (kwargs and info.name in OUT_FORMS):
                out = self._running_update(info, func, args, kwargs)
            else:
                out = func(*args, **kwargs) if kwargs else func(*args)
            if info.name in SQUARES:  # a square whose values a narrow format flushes (flushed.py)
                try:
                    self.flushed.seen(info.name, args, out)
                except Exception as exc:  # the observer never kills the job
                    self._error(func, exc)
            try:
                if type(out) is Tensor if path == FUNCTIONAL else out is args[0]:
                    self._one(info, args, kwargs, out, seq=seq, before=probed, written=path == IN_PLACE)
                elif not isinstance(out, (Tensor, tuple, list)):  # a number (`.item()`) or None
                    self.ops_seen += 1
                else:
                    wrote = info.written(args, kwargs or {}) if path == IN_PLACE else []
                    self._record(info, args, kwargs or {}, out, seq=seq, written=wrote, before=probed)
            except NonFiniteError:
                raise
            except Exception as exc:  # the observer never kills the job
                self._error(func, exc)
            return out
        kwargs = kwargs or {}
        if info.collective:
            return self._collective(info, func, args, kwargs)
        written: list[torch.Tensor] = []
        before: dict[int, tuple[str, int]] | None = None
        if info.writes and not info.is_view:
            try:
                written = info.written(args, kwargs)
                if not info.overwrites:
                    if self._nested:
                        with DisableTorchDispatch():
                            before = self._before_write(written)
                    else:
                        before = self._before_write(written)
            except Exception as exc:  # the observer never kills the job
                self._error(func, exc)
        if (info.name in WATCHED or (kwargs and info.name in OUT_FORMS)) and not self._nested:  # as above
            out = self._running_update(info, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        try:
            if self._nested:
                with DisableTorchDispatch():
                    self._record(info, args, kwargs, out, seq=seq, written=written, before=before)
            else:
                self._record(info, args, kwargs, out, seq=seq, written=written, before=before)
        except NonFiniteError:
            raise
        except Exception as exc:  # the observer never kills the job
            self._error(func, exc)
        return out

    def _collective(self, info: OpInfo, func: Any, args: Any, kwargs: Any) -> Any:
        """An all-reduce (DDP's gradient buckets), broadcast or all-gather: what it writes or
        returns holds other ranks' values once the work completes, after this op returns. Those
        tensors start over as leaves "received through" the op, checked when first used, so a
        NaN another rank sent is an input here, not a fault of the next op (the optimizer's
        add_). A tensor already non-finite here before it was sent keeps its local story."""
        out = func(*args, **kwargs)
        self.ops_seen += 1
        try:
            for t in [*info.written(args, kwargs), *tensors_in(out)]:
                src = self._lookup(t)
                if src is not None and self.kind_of(src):
                    continue
                base = t._base if t._base is not None else t
                self._table.pop(id(base), None)
                self._table.pop(id(t), None)
                self._received[id(base)] = (weakref.ref(base), info.op)
        except Exception as exc:  # the observer never kills the job
            self._error(func, exc)
        return out

    def _met(self, t: Any) -> bool:
        """`t` holds an output of this trace's ops: writing it needs no probe beforehand."""
        entry = self._table.get(id(t))
        return entry is not None and entry[0]() is t and entry[1][1] is None

    def _set(self, t: torch.Tensor, value: Any) -> None:
        """Provenance.set, inlined for the hot path."""
        table = self._table
        table[id(t)] = (_ref(t), value)
        if len(table) >= self.provenance.sweep_at:
            self.provenance.sweep()

    def _view(self, args: Any, out: Any) -> None:
        """A view aliases its base: it shares its entry (views autograd links to a base are also
        found through `_base`; `detach` and inference-mode views are not)."""
        if type(out) is Tensor and args:
            entry = self._table.get(id(args[0]))
            if entry is not None and entry[0]() is args[0]:
                self._set(out, entry[1])

    def _one(
        self, info: OpInfo, args: Any, kwargs: Any, t: torch.Tensor, *, seq: int, before: Any, written: bool
    ) -> None:
        """Record an op with one tensor output, or one tensor written in place (`written`):
        `_record` without its walk over outputs and written arguments, nor the cases no op on
        this path has (views, value-preserving ops, copies into parameters)."""
        self.ops_seen += 1
        if t.dtype not in CHECKABLE or t.layout is not STRIDED or not t.numel() or t.is_meta:
            return
        immediate = self.immediate
        if immediate is None:
            immediate = t.is_cpu
        index = self.records.count
        inputs = self._inputs(tensor_args(args, []) if info.lists else args, index, before)
        if kwargs:
            inputs.extend(self._inputs(tensor_args(kwargs.values(), []), index, before))
        self._commit(
            info, args, kwargs, [t], inputs=inputs, seq=seq, immediate=immediate, written=(t,) if written else ()
        )

    def _commit(
        self,
        info: OpInfo,
        args: Any,
        kwargs: Any,
        outs: list[torch.Tensor],
        *,
        inputs: list[tuple[str, int]],
        seq: int,
        immediate: bool,
        written: Any,
        arg_tensors: list[torch.Tensor] | None = None,
    ) -> None:
        """The one place an op becomes a record, whichever path it came by: where it ran (phase,
        module, call, source line), the check of each output, the side table entries, and what a
        non-finite output sets off. Called by `_one` and `_record`, which are called by
        `__torch_dispatch__`: the frame three up is the code that ran the op."""
        index = self.records.count
        tracker = self.tracker
        this_thread = tracker.this_thread
        stack = this_thread.stack
        module, call, recompute = stack[-1] if stack else (None, None, False)
        node_name = forward_op = location = None
        task = _graph_task_id()
        if task != -1:
            phase = "backward"
            self._visit_line = None
            node = current_autograd_node()
            if task != self._graph_task:
                if len(self._loss_checked) < len(self.experiments):
                    self._check_on_loss()
                self._at_backward_end()
                made = self._seq_index.get(node._sequence_nr()) if node is not None else None
                record = self._items.get(made) if made is not None else None
                # the backward's first node is the loss's, where its op ran in the forward: a NaN loss is never
                # "masked" (a reentrant checkpoint's inner backward starts at a segment recomputed in the backward)
                if made is not None and record is not None and record.phase == "forward":
                    self._sink(made, "the loss (what backward() starts from)")
            if node is not None:
                node_name = node.name()
                forward = self._by_seq.get(node._sequence_nr())
                if forward is not None:
                    module, call, forward_op, location = forward
                if isinstance(node, BackwardCFunction):  # a custom autograd.Function: its backward is code of
                    location = user_location(sys._getframe(3)) or location  # the user's, its line the op's own
                    # and its ops are the user's own: a division there after a singular forward op is that op's
                    # derivative (g / (2 * sqrt(x)) at 0: sqrt's), any other op is told by what it is (a pow of a
                    # large base overflows as any pow does; a division after a neg is no neg's derivative)
                    singular = forward_op is not None and forward_op.split(".")[1] in SINGULAR
                    if info.op.split(".")[1] not in _DIVISIONS or not singular:
                        forward_op = None
        elif this_thread.in_optimizer:
            phase = "optimizer"
            self._visit_line = None
            if module is None:
                call = tracker.optimizer_steps - 1  # the optimizer's step
            if not immediate:
                location = user_location(sys._getframe(3))
        else:
            phase = "forward"
            # Outside modules, and inside one in a method of the user's other than its forward (a
            # LightningModule's training_step, which Lightning runs through the module's call), a
            # line's visits are followed: a narrow state rebound there is judged (_rebound).
            frame, location = user_place(sys._getframe(3))
            if module is None:
                # Outside modules the iteration is how often this op ran at this line before.
                key = (info.op, location)
                call = self._site_calls[key]
                self._site_calls[key] = call + 1
            if location is not None and (module is None or location[2] != "forward"):
                where = (location[0], location[1])  # visits of a line: its records in a row (a loop too)
                # the line run again (a loop whose body is this line alone: no other line's op between)
                # starts its bytecode over: an op at an earlier instruction of the same frame is a new visit
                lasti = (id(frame), frame.f_lasti) if frame is not None else None
                again = (
                    lasti is not None
                    and self._visit_lasti is not None
                    and (lasti[0] == self._visit_lasti[0] and lasti[1] < self._visit_lasti[1])
                )
                if where != self._visit_line or again:
                    starts = self._visits.setdefault(where, [])
                    starts.append(index)
                    if len(starts) > VISITS_KEPT:  # a state is read within a few thousand visits of its line
                        del starts[: VISITS_KEPT // 2]
                    self._visit_line = where
                self._visit_lasti = lasti
                if outs[0].dtype in _NARROW and not outs[0].requires_grad:
                    self._rebound(where, index, inputs, args)
            else:
                self._visit_line = None
            # Inside a module's forward the line is kept too: deferred mode learns about a NaN later, when
            # this stack is gone, and the upstream walk names the lines of the finite ops that made it (a
            # `1 + exp(s)` two lines before the log), whose fix it checks.
        record = Record(index, info.op, phase, module, call, recompute, node_name, forward_op, location, inputs)
        self._items[index] = record  # Store.append without the call (Store.by_index)
        self.records.count = index + 1
        self._window.append((record, info.func, args, kwargs))
        if self.experiments and info.name in _COMPLETES:  # the end of log(exp(x).sum()) whose exp overflowed
            self._completed(record)
        by_seq = self._by_seq
        if seq not in by_seq:  # the first op to see a node number is the one that made it
            by_seq[seq] = (module, call, info.op, location)
            self._seq_index[seq] = index
        # Outputs that need no reduction: fresh memory (garbage until written), and, when the
        # inputs are known finite, values a value-preserving op moved without narrowing them or
        # a finite value scaled down.
        first = outs[0].dtype
        if location is None and first in _NARROW and _rounds_away(args, first):
            # a Python constant the op's dtype cannot hold (an eps that is 0 in fp16): its line is
            # what the experiments name as the fix's place, and this stack is gone by then
            record.location = location = user_location(sys._getframe(3))
        derived = info.uninitialised
        if immediate and not derived:
            if info.preserving:
                derived = self._preserved(inputs, arg_tensors or self._arg_tensors(info, args, kwargs), first)
            elif info.scales:
                derived = self._scaled_down(info.scales, args, kwargs, first, inputs)
        entry = (("op", index), None)
        table = self._table
        nonfinite = False
        for t in outs:
            dtype = t.dtype
            output = Output(t.shape, dtype_name(dtype))
            # one tensor written, the output itself: the common case, without a generator
            if written and phase != "backward" and (written[0] is t or any(t is w for w in written)):
                output.param = tracker.param_names.own(t)
                if output.param is not None and record.mutates is None:
                    record.mutates = output.param
            if derived:
                output.derived = True
            elif not immediate:
                output.pending = _aminmax(t) if dtype in AMINMAX else deferred_range(t)  # deferred_range, inlined
            elif (dtype is torch.float32 or dtype is torch.float64) and not (
                self.ranges and dtype is torch.float32 and phase == "forward" and info.name in GROWS
            ):
                value = float(t.sum())  # Inside __torch_dispatch__: below autograd, no graph recorded
                if value - value:  # NaN for NaN and for +-inf: look closer
                    resolve(output, [value], t)
            else:
                resolve(output, [float(v) for v in (minmax(t) if dtype is torch.float32 else reduce(t))], t)
                if record.location is None and phase == "forward" and _near_limit(output, dtype):
                    record.location = user_location(sys._getframe(3))
            nonfinite = nonfinite or output.kind is not None
            record.outputs.append(output)
            table[id(t)] = (_ref(t), entry)  # Provenance.set without the call (Provenance.table)
            if written and t._base is not None and not self._still_bad(t._base, immediate and output.kind is None):
                table[id(t._base)] = (_ref(t._base), entry)  # written through a view: the base holds it too
        if len(table) >= self.provenance.sweep_at:
            self.provenance.sweep()
        if immediate:
            if nonfinite:
                if arg_tensors is None:
                    arg_tensors = self._arg_tensors(info, args, kwargs)
                record.input_stats = self._input_stats(arg_tensors, written)
                if record.location is not None and record.location[2] == "__getitem__":
                    record.item = dataset_item(sys._getframe())  # bad data: which item the DataLoader read
                if not any(self.kind_of(s) for s in inputs):  # from finite inputs: could arithmetic do it?
                    record.bound = output_bound(info.op, args, kwargs or {})
                    if self.on_produced is not None:
                        self.on_produced(record, info.func, args, kwargs, outs=outs, written=written)
                if record.location is None:
                    # forward: the line that ran this op; backward: the line that called backward()
                    record.location = user_location(sys._getframe(3))
                self._settle(record)
            elif self._tainted:
                self._settle(record)
        else:
            self._pending.append((record, (_ref(t),) if len(outs) == 1 else tuple(_ref(o) for o in outs)))
            if len(self._pending) >= self.sync_every:
                self.flush()
        if index + 1 >= self._next_compact:
            self.compact()

    def _preserved(self, inputs: list[Any], arg_tensors: list[torch.Tensor], dtype: torch.dtype) -> bool:
        """A value-preserving op of inputs known finite that narrows none of them: finite."""
        return all(self._finite(s) for s in inputs) and not any(
            narrows(a.dtype, dtype) for a in arg_tensors if checkable(a)
        )

    @staticmethod
    def _arg_tensors(info: OpInfo, args: Any, kwargs: Any) -> list[torch.Tensor]:
        found = tensor_args(args, []) if info.lists else [a for a in args if isinstance(a, Tensor)]
        return tensor_args(kwargs.values(), found) if kwargs else found

    def _scaled_down(self, scales: int, args: Any, kwargs: Any, dtype: torch.dtype, inputs: list[Any]) -> bool:
        """`x * s` with |s| <= 1 or `x / s` with |s| >= 1, x real and known finite, same dtype:
        never larger in magnitude than x (rounding is monotonic), so finite without a reduction."""
        if kwargs or len(args) != 2 or not inputs:
            return False
        x, s = args
        if type(s) is not float and type(s) is not int:
            return False
        if not (abs(s) <= 1 if scales > 0 else abs(s) >= 1):  # False for a NaN scalar
            return False
        return isinstance(x, Tensor) and x.dtype is dtype and dtype in REAL and self._finite(inputs[0])

    def _before_write(self, written: list[torch.Tensor]) -> dict[int, tuple[str, int]] | None:
        """A tensor the trace has not met yet is probed before an in-place op changes it; the
        entries of the others stay valid until the op is recorded (autograd bumps the version
        counter after the mode returns)."""
        unseen = [t for t in written if checkable(t) and self._lookup(t) is None]
        if not unseen:
            return None
        return {id(t): self._source(t, self.records.count) for t in unseen}

    def _error(self, func: Any, exc: Exception) -> None:
        if len(self.errors) < 20:
            self.errors.append(f"{func}: {type(exc).__name__}: {exc}")

    def _lookup(self, t: torch.Tensor) -> tuple[str, int] | None:
        found = self._table.get(id(t))  # Provenance.own, inlined
        if found is None or found[0]() is not t:
            base = t._base  # a view: its values (and its name) are its base's
            if base is None:
                return None
            found = self._table.get(id(base))
            if found is None or found[0]() is not base:
                return None
            t = base
        entry = found[1]
        if entry[1] is not None and entry[1] != version(t):
            return None  # a leaf changed since it was probed
        return entry[0]

    def _source(self, t: torch.Tensor, consumer: int) -> tuple[str, int]:
        src = self._lookup(t)
        if src is None:
            # A view of a tensor not seen yet (weight.t()): the base is the leaf, under its name.
            base = t._base if t._base is not None else t
            received = self._received.get(id(base))
            if received is not None and received[0]() is base:
                src = self._new_leaf(base, consumer, f"a tensor received through {received[1]}")
                self.leaves[src[1]].origin = "collective"
            elif (made := self._compiled.get(id(base))) is not None and made[0]() is base:
                src = self._new_leaf(base, consumer, f"an output of compiled graph {made[1]}")  # trace_compiled.LABEL
                self.leaves[src[1]].origin = "compiled"
            else:
                src = self._new_leaf(base, consumer, self.tracker.param_names.get(base) or "input")
        elif src[0] == "op":
            record = self._items.get(src[1])
            if record is not None:
                record.consumed = True
        else:
            leaf = self.leaves.by_index.get(src[1])
            if leaf is not None and leaf.first_use is None:  # a parameter reloaded in place
                leaf.first_use = consumer
                if leaf.kind:
                    self._pinned.add(consumer)
        if t.requires_grad:  # a leaf that will get a gradient (weight.t() stands for weight)
            try:
                g = t if t.is_leaf else t._base
            except RuntimeError:  # a view made under no_grad whose base was written in place (w[:8] *= k)
                g = None  # autograd refuses to say: it gets no gradient through this view
            if g is not None and g.is_leaf:
                known = self._grad_leaves.get(id(g))
                if known is None or known[0]() is not g:  # an id a dead tensor had is no match
                    self._grad_leaves[id(g)] = (weakref.ref(g), self._grad_name(g, src))
        return src

    def _grad_name(self, t: torch.Tensor, src: tuple[str, int]) -> str:
        name = self.tracker.param_names.get(t)
        if name is None:
            name = self.leaves[src[1]].name if src[0] == "leaf" else f"tensor {list(t.shape)} made in the traced block"
        return name

    def _new_leaf(self, t: torch.Tensor, consumer: int | None, name: str) -> tuple[str, int]:
        dtype = t.dtype
        leaf = Leaf(self.leaves.count, name, t.shape, dtype_name(dtype), first_use=consumer)
        src = ("leaf", leaf.index)
        if not (self.immediate if self.immediate is not None else t.is_cpu):
            # Read with the ops' results: a read here would be a host sync for every parameter
            # and optimizer state a trace meets. A non-finite one's rows are read at the flush,
            # from the tensor if it still holds the values it was met with.
            leaf.pending = deferred_range(t)
            batch = not self.tracker.this_thread.in_optimizer and self.tracker.param_names.own(t) is None
            self._pending_leaves.append((leaf, _ref(t), version(t), batch))
            self.leaves.append(leaf)
            self._set(t, (src, version(t)))
            return src
        # the same one-reduction check as op outputs
        if dtype is torch.float32 or dtype is torch.float64:
            value = float(t.sum())
            if value - value:  # NaN for NaN and for +-inf: look closer
                resolve(leaf, [value], t)
        else:
            resolve(leaf, [float(v) for v in reduce(t)], t)
        self.leaves.append(leaf)
        self._set(t, (src, version(t)))
        if leaf.kind:
            # a tensor first met in the forward that is not a weight: the step's data
            self._bad_leaf(
                leaf, t, batch=not self.tracker.this_thread.in_optimizer and self.tracker.param_names.own(t) is None
            )
        return src

    def _bad_leaf(self, leaf: Leaf, t: torch.Tensor | None, *, batch: bool) -> None:
        """A leaf found non-finite: its rows while it holds the values it was met with, and the
        pins that keep it and its first consumer for blame."""
        if t is not None:
            with reading((t,)):  # bad data: which rows, which dataset items (the batch it is one of)
                leaf.rows = bad_rows(t, batch=batch)
        self._tainted.add(("leaf", leaf.index))
        self._pinned_leaves.add(leaf.index)
        if leaf.first_use is not None:
            self._pinned.add(leaf.first_use)

    def _inputs(self, values: Any, consumer: int, before: dict[int, Any] | None) -> list[Any]:
        """Where each checkable tensor among `values` came from (other values are skipped)."""
        inputs = []
        table = self._table
        items = self._items
        for t in values:
            if not isinstance(t, Tensor) or t.dtype not in CHECKABLE or t.layout is not STRIDED or not t.numel():
                continue
            src = before.get(id(t)) if before else None
            if src is None:
                # the common case inlined: an op's output, not a view, not a leaf (see _source)
                entry = table.get(id(t))
                if (
                    entry is not None
                    and entry[0]() is t
                    and entry[1][1] is None
                    and not (t.requires_grad and (t.is_leaf or t._base is not None))
                ):
                    src = entry[1][0]
                    record = items.get(src[1])
                    if record is not None:
                        record.consumed = True
                else:
                    src = self._source(t, consumer)
            inputs.append(src)
        return inputs

    def _input_stats(self, tensors: list[torch.Tensor], written: Any = ()) -> list[dict[str, Any] | None]:
        """Live statistics of an op's inputs; None for one it wrote in place (its values now are
        the op's result, not what it read: blame shows what the trace knew of it before)."""
        return [None if any(t is w for w in written) else stats(t) for t in tensors if checkable(t)][:6]

    def kind_of(self, src: tuple[str, int]) -> str | None:
        return self.records[src[1]].kind if src[0] == "op" else self.leaves[src[1]].kind

    def _finite(self, src: tuple[str, int]) -> bool:
        """Known finite right now (immediate mode); pending results count as unknown."""
        if src[0] == "leaf":
            leaf = self.leaves[src[1]]
            return leaf.kind is None and leaf.pending is None
        record = self._items.get(src[1])
        return record is None or all(o.kind is None and o.pending is None for o in record.outputs)

    def _still_bad(self, base: torch.Tensor, finite_write: bool) -> bool:
        """A finite write through a view into a base that held NaN/Inf elsewhere leaves those
        values there (autograd's CopySlices zeroes one slice of a NaN gradient): the base keeps
        the entry that explains them, unless its values show the write covered them all (known
        at once in immediate mode; deferred mode keeps the old entry)."""
        if not finite_write:
            return False
        old = self._lookup(base)
        if old is None or not self.kind_of(old):
            return False
        if self.immediate if self.immediate is not None else base.is_cpu:
            return not bool(torch.isfinite(base).all())  # a NaN run only: the base held NaN/Inf
        return True

    def _alias(self, t: torch.Tensor, src: tuple[str, int]) -> None:
        self.provenance.set(t, (src, version(t) if src[0] == "leaf" else None))

    def _record(
        self,
        info: OpInfo,
        args: Any,
        kwargs: Any,
        out: Any,
        *,
        seq: int,
        written: list[torch.Tensor],
        before: dict[int, Any] | None,
    ) -> None:
        """Record any op: views, several outputs, tensors written besides the first argument,
        value-preserving ops, copies into parameters; the record itself is `_commit`'s."""
        self.ops_seen += 1
        if info.is_view:
            self._view(args, out)
            return
        if type(out) is torch.Tensor:  # the common case, without the generic walk
            outs = [out] if checkable(out) else []
        else:
            outs = [t for t in tensors_in(out) if checkable(t)]
        if written:  # checkable now: set_ and resize_ give an empty tensor its values
            written = [t for t in written if checkable(t)]
        for t in written:  # foreach/fused ops return nothing: what they write is their output
            if not any(t is o for o in outs):
                outs.append(t)
        if not outs:
            return
        immediate = self.immediate if self.immediate is not None else outs[0].is_cpu
        index = self.records.count
        if info.name == "copy_" and written and self._copy_into_parameter(args, index):
            return
        arg_tensors = tensor_args(args, [])
        if kwargs:
            tensor_args(kwargs.values(), arg_tensors)
        if info.overwrites:
            arg_tensors = [t for t in arg_tensors if not any(t is w for w in written)]
        if immediate and info.preserving and len(outs) == 1:
            # One finite input moved or selected into one output (clone, reshape copies, relu):
            # alias it like a view. With a non-finite input it is recorded: relu(-inf) masks.
            sources = [t for t in arg_tensors if checkable(t)]
            t = outs[0]
            if len(sources) == 1 and not narrows(sources[0].dtype, t.dtype):
                src = self._source(sources[0], index)
                if self._finite(src):
                    self._alias(t, src)
                    if info.name in SELECTS and src[0] == "op":  # a part of an op's output: kept to re-run
                        self._window.select(t, info.func, args, kwargs)
                    if t._base is not None and not self._still_bad(t._base, True):
                        self._alias(t._base, src)  # written through a view: the base holds it too
                    module, call, _ = self.tracker.current
                    # a widening cast's line (recon.float() before a loss): its backward casts the gradient back
                    # to the narrow dtype, where it can pass the range; other aliases keep no line (a frame walk
                    # per view would cost the trace its budget)
                    at = user_location(sys._getframe(1)) if info.name == "_to_copy" else None
                    self._by_seq.setdefault(seq, (module, call, info.op, at))
                    return
        inputs = self._inputs(arg_tensors, index, before) if info.reads_inputs else []
        self._commit(
            info,
            args,
            kwargs,
            outs,
            inputs=inputs,
            seq=seq,
            immediate=immediate,
            written=written,
            arg_tensors=arg_tensors,
        )

    def _running_update(self, info: OpInfo, func: Any, args: Any, kwargs: Any) -> Any:
        """Run an in-place update that lost_updates.py may check: its target's values kept before,
        the update it kept compared after (calls of each source line spread over the run only)."""
        kept = None
        try:
            kept = self.lost_updates.before(
                info.name, args, lambda: self.tracker.phase, self.tracker.param_names.get, self._statement,
                written=(func, kwargs or {}),
            )  # fmt: skip
        except Exception as exc:  # the observer never kills the job
            self._error(func, exc)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if kept is not None:
            try:
                self.lost_updates.after(kept, func, args, kwargs)
            except Exception as exc:  # the observer never kills the job
                self._error(func, exc)
        return out

    def _rebound(self, where: tuple[str, int], index: int, inputs: list[tuple[str, int]], args: Any) -> None:
        """A narrow tensor bound again to what its line computes from its previous value, outside the
        model (`shadow[n] = shadow[n] * d + p * (1 - d)`: an EMA by rebinding, no in-place op): an op
        of this visit of the line reads what its previous visit made. What that visit made is then
        judged as a copy_'s statement is (lost_updates.LostUpdates.rebound)."""
        starts = self._visits[where]
        for kind, i in inputs:
            # made at this line in an earlier visit: the one before (a loop over steps), or one a loop over
            # the parameters' entries ran in between (shadow[n] for each n: the same n a pass earlier)
            made = self._items.get(i) if kind == "op" and starts[0] <= i < starts[-1] else None
            if made is None or made.location is None or (made.location[0], made.location[1]) != where:
                continue
            previous = starts[bisect.bisect_right(starts, i) - 1]  # the start of the visit that made it
            value = next((a for a in args if isinstance(a, torch.Tensor) and self.producer_of(a) == i), None)
            if value is None:
                return
            try:  # the value the earlier visit made: its statement, from what that visit read
                statement = self._statement(value, where, value, since=previous)
                if statement:
                    made_before = lambda t, since=previous: self._made_before(t, where, since)  # noqa: E731
                    with DisableTorchDispatch():
                        self.lost_updates.rebound(where, value, statement, made_before)
            except Exception as exc:  # the observer never kills the job
                self._error("rebinding", exc)
            return

    def _made_before(self, t: torch.Tensor, where: tuple[str, int], since: int) -> bool:
        """Whether `t` was made at line `where` before index `since`: a state's previous value."""
        index = self.producer_of(t)
        made = self._items.get(index) if index is not None and index < since else None
        return made is not None and made.location is not None and (made.location[0], made.location[1]) == where

    def _statement(
        self, t: torch.Tensor | None, where: tuple[str, int], target: torch.Tensor, *, since: int = 0,
        final: tuple[Any, Any, Any] | None = None,
    ) -> Statement | None:  # fmt: skip
        """The ops at source line `where` that made `t`, in the order they ran, from the window: the
        statement a copy_ writes back into `target` (ema.copy_(d * ema + (1 - d) * w)). The walk
        stops at what another line made, at what the window no longer holds, and at the target (its
        values came from the same line's statement on an earlier call): those are values it read.
        `final`: an op about to run that ends the statement (func, args, kwargs without its out=:
        torch.add(ema * d, w, alpha=1 - d, out=ema)), walked from its arguments and put last."""
        steps = {step[0].index: step for step in self._window.steps}
        found: dict[int, tuple[Any, ...]] = {}
        todo = [t] if t is not None else []
        if final is not None:
            todo += [x for x in (*final[1], *final[2].values()) if isinstance(x, torch.Tensor)]
        while todo:
            x = todo.pop()
            index = self.producer_of(x) if x is t or not same_memory(x, target) else None
            if index is None or index in found or index < since:
                continue
            step = steps.get(index)
            location = step[0].location if step is not None else None
            if step is None or location is None or (location[0], location[1]) != where:
                continue
            found[index] = step
            if len(found) > STATEMENT_OPS:
                return None
            todo.extend(x for x in (*step[2], *(step[3] or {}).values()) if isinstance(x, torch.Tensor))
        position = {index: n for n, index in enumerate(sorted(found))}
        statement: Statement = []
        ops = [found[index][1:] for index in sorted(found)] + ([final] if final is not None else [])
        for func, args, kwargs in ops:
            named = list((kwargs or {}).items())
            sources = {
                j: position[p]
                for j, x in [*enumerate(args), *((-1 - n, v) for n, (_, v) in enumerate(named))]
                if isinstance(x, torch.Tensor)
                and (x is t or not same_memory(x, target))
                and (p := self.producer_of(x)) in position
            }
            statement.append((func, tuple(args), dict(named), sources))
        return statement

    def _copy_into_parameter(self, args: Any, index: int) -> bool:
        """`param.copy_(loaded)` (load_state_dict): the parameter starts over as a leaf under its
        own name when what it received came from outside the trace (an input, or a tensor built
        from storage with no tensor inputs), so a NaN in a checkpoint is the parameter's."""
        dst, src_t = args[0], args[1]
        if not isinstance(src_t, torch.Tensor) or not checkable(src_t) or graph_task_id() != -1:
            return False
        name = self.tracker.param_names.get(dst)
        if name is None and not isinstance(dst, torch.nn.Parameter):
            return False
        src = self._source(src_t, index)
        if src[0] == "op":
            record = self._items.get(src[1])
            if record is None or record.inputs:
                return False
        self._new_leaf(dst, None, name or "input")  # named when its model is (`_named`)
        return True

    def _named(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Parameters the trace met before their model was named (loaded, then called) take
        their names now."""
        for name, t in named:
            entry = self.provenance.own(t)
            if entry is not None and entry[0][0] == "leaf":
                leaf = self.leaves.by_index.get(entry[0][1])
                if leaf is not None and leaf.name == "input":
                    leaf.name = name

    def _settle(self, record: Record) -> None:
        """Keep what blame will read about a record whose values are known: a non-finite one, or
        a finite one made from non-finite values (an overflow zeroed by rsqrt, a masked NaN) and
        what derives from it, with their inputs; then tell the session about a non-finite one."""
        tainted = self._tainted
        kind = record.kind
        fed = bool(tainted) and any(src in tainted for src in record.inputs)
        if not kind and not fed:
            return
        # A run that stays NaN taints everything after it: past the limit only the records that
        # make non-finite values out of finite ones are kept, which is what blame reports.
        if len(self._pinned) < _PIN_LIMIT or (kind and not fed):
            tainted.add(("op", record.index))
            self._pinned.add(record.index)
            for src_kind, i in record.inputs:
                (self._pinned if src_kind == "op" else self._pinned_leaves).add(i)
        # a producer: from finite inputs, or a NaN from inputs without NaN (inf - inf, 0 * inf); by their values,
        # not the taint (a step after a skipped one reads weights whose gradients were non-finite)
        finite_in = not fed or not any(self.kind_of(s) for s in record.inputs)
        if kind and (finite_in or (kind == "nan" and all(self.kind_of(s) != "nan" for s in record.inputs))):
            self._experiment(record)
        elif not kind and op_packet(record.op) in ZEROING:
            self._zeroed_check(record)
        if kind and self.on_nonfinite is not None:
            self.on_nonfinite(self, record)

    def _experiment(self, record: Record) -> None:
        """At the first NaN producers and the first Inf producers, re-run the op and what is
        upstream of it (numerics/engine/reruns.py), outside the trace."""
        kind = "nan" if record.kind == "nan" else "inf"
        if not record.inputs:
            return
        # past the first producers, the first of each other op and line too (a scaler that stalls at step 44
        # on a line the calibration's early overflows did not reach): its finding's fix is then checked
        key = (record.op, record.forward_op, record.location)
        if self._decided[kind] >= PRODUCERS and (key in self._keys or len(self._keys) >= PRODUCER_LINES):
            return
        self._decided[kind] += 1
        self._keys.add(key)
        try:
            # what the op read: where its rows are bad, the batch they are of is looked for there first
            ran = next(((s[2], s[3]) for s in reversed(self._window.steps) if s[0] is record), ())
            with DisableTorchDispatch(), reading(ran):
                found = decide(record, self._window, self._lookup)
            if found is not None:
                self.experiments[record.index] = found
                self._pinned.update(r.index for r in found.chain)
        except Exception as exc:  # the observer never kills the job (SPEC 4)
            self._error("experiment", exc)

    def _zeroed_check(self, record: Record) -> None:
        """An op that made an overflow's Inf finite (tanh(inf) = 1): whether that is what the exact
        computation gives too (reruns.zeroed_exactly). Per op and line, the 1st, 2nd, 4th, ... such
        call is checked (a line called on harmless values first, on destroyed ones later), and one that
        is not exact, or that cannot be re-run, decides for the line: blame reports only the overflows
        whose zeroing destroyed values, and those it could not judge."""
        producer = self._overflow_behind(record)
        if producer is None:  # finite values made from an earlier Inf, not an Inf of its own: not this check's
            return
        key = (record.op, record.location)
        count = self._zeroed_calls.get(key, 0)
        self._zeroed_calls[key] = count + 1
        if self.zeroed_exact.get(key, True) is not True or count & (count + 1):
            return
        if key not in self.zeroed_exact and len(self.zeroed_exact) >= PRODUCER_LINES:
            return
        try:
            with DisableTorchDispatch():
                exact = zeroed_exactly(record, producer, self._window, self._lookup)
        except Exception as exc:  # the observer never kills the job (SPEC 4)
            self._error("experiment", exc)
            exact = None
        self.zeroed_exact[key] = exact

    def _overflow_behind(self, record: Record) -> int | None:
        """The op that first overflowed on the way to `record`'s Inf input: back through inputs that hold
        +-inf to one whose own inputs are finite."""
        src = next((s for s in record.inputs if self.kind_of(s) in ("+inf", "-inf")), None)
        for _ in range(64):
            if src is None or src[0] != "op":
                return None
            made = self.records[src[1]]
            behind = next((s for s in made.inputs if self.kind_of(s) in ("+inf", "-inf")), None)
            if behind is None:
                return made.index if not any(self.kind_of(s) for s in made.inputs) else None
            src = behind
        return None

    def _completed(self, record: Record) -> None:
        """A log or a div of what an exp whose overflow was experimented on made: log(exp(x).sum(dim)),
        exp(x) / exp(x).sum(dim) (a softmax by hand, its exp written once or twice) and its log; a log
        of a cosh that overflowed (log-cosh loss). The
        form is complete now, and its stable form (torch.logsumexp, torch.softmax, F.log_softmax) is
        checked on what the exp read (reruns.completed_form); a longer form found later replaces it."""
        chain, pick = [record], None
        made = self._made_by(record) if record.op.startswith("aten.log") else record
        if made is not None and made is not record and self._guard(made):  # log(p + 1e-8): the eps between
            chain.insert(0, made)
            made = self._made_by(made)
        if made is not None and made.op.startswith("aten.div") and len(made.inputs) == 2:
            if made is not record:
                chain.insert(0, made)
            exp = self._made_by(made)
            # exp(s).diag() / exp(s).sum(1) (InfoNCE): the softmax's values picked, the pick passed over
            if exp is not None and exp.op.split(".")[1] in PICKS:
                pick, exp = exp, self._made_by(exp)
            total = self._made_by(made, 1)
            summed = self._made_by(total) if total is not None and total.op.startswith("aten.sum") else None
            if exp is None or total is None or summed is None:
                return
            if not exp.op.startswith("aten.exp") or not summed.op.startswith("aten.exp"):
                return
            first = summed if exp is summed else exp
            if summed is not exp and summed.inputs != exp.inputs:  # x.exp() / x.exp().sum(): the same x
                # or exp(x.diag()) / exp(x).sum(1) (InfoNCE by hand): the numerator's x picked before its exp, the
                # form then of the summed exp's x, picked the same way
                picked = self._made_by(exp)
                if (
                    pick is not None or picked is None or picked.op.split(".")[1] not in PICKS
                    or picked.inputs[:1] != summed.inputs[:1]
                ):  # fmt: skip
                    return
                pick, first = picked, summed
            chain[:0] = [first, *([pick] if pick else []), total]
            # the exp the experiment ran at (the first of them to run), or the sum, where the exps stayed
            # finite and their sum overflowed
            keys = [exp.index] if exp is summed else sorted((exp.index, summed.index))
            keys.append(total.index)
        elif made is not None and made is not record and made.op.startswith("aten.cosh"):
            chain.insert(0, made)  # log(cosh(x)), whose cosh overflowed
            keys = [made.index]
        elif (
            made is not None
            and made is not record
            and made.op.startswith("aten.add")
            and (exp := self._made_by(made)) is not None
            and exp.op.startswith("aten.exp")
            and (add := self._window.by_index().get(made.index)) is not None
            and stable.one_plus(add.args) is not None
        ):
            chain[:0] = [exp, made]  # log(1 + exp(x)), a softplus by hand whose exp overflowed
            keys = [exp.index]
        else:
            if made is None or made is record or not made.op.startswith("aten.sum"):
                return
            exp = self._made_by(made)
            if exp is None or not exp.op.startswith("aten.exp"):
                return
            chain[:0] = [exp, made]
            keys = [exp.index, made.index]  # the exp overflowed, or its values' sum did
        # every experiment of the form's ops: the exp's, and a division's that made NaN of its Infs (each its fix)
        held = [self.experiments[k] for k in dict.fromkeys([*keys, *(r.index for r in chain)]) if k in self.experiments]
        experiment = held[0] if held else None
        steps = self._window.by_index()
        ran = [steps.get(r.index) for r in chain]
        form = stable.form_of([p for r in chain if (p := r.op.split(".")[1]) not in PICKS])
        at = chain[0].location
        line = f"{at[0]}:{at[1]}" if at else None
        if any(s is None for s in ran) or form is None or form.prefix or len(form.ops) != len(chain) - bool(pick):
            return
        try:
            with DisableTorchDispatch():
                for each in held:
                    completed_form(each, [s for s in ran if s is not None])
                x = form.operand(ran[0].args)  # type: ignore[union-attr]
                if line is None or x is None:
                    return
                dtype = dtype_name(x.dtype).removeprefix("torch.")
                met = self.forms.get(line)
                if experiment is not None:  # what overflowed, its longest form (its log, a line later) kept
                    checked = experiment.stable is not None and experiment.stable.form is form
                    if met is None or (len(form.ops), checked) > (len(met.ops), met.checked):
                        self.forms[line] = stable.Met(form.ops, form.written, form.stable, dtype, True, checked)
                elif met is None and x.dtype in _NARROW:
                    self.forms[line] = stable.Met(
                        form.ops, form.written, form.stable, dtype, False, False, float(x.abs().max())
                    )
        except Exception as exc:  # the observer never kills the job (SPEC 4)
            self._error("experiment", exc)

    def _check_on_loss(self) -> None:
        """The forward is complete (its backward begins): the step's fixes re-run down to its loss
        (on_loss.py), each experiment of the step told what they give there."""
        fresh = [
            e for k, e in self.experiments.items()
            if k not in self._loss_checked and e.origin is not None and e.origin.phase == "forward"
        ]  # fmt: skip
        self._loss_checked.update(self.experiments)
        if not fresh:
            return
        try:
            self.flush()  # the loss's kind, in deferred mode
            steps = [Step(*s) for s in self._window.steps]
            # the op the backward starts from: the loss (its forward op and line), not a metric after it
            node = current_autograd_node()
            known = self._by_seq.get(node._sequence_nr()) if node is not None else None
            root = (known[2], known[3]) if known is not None else None
            with DisableTorchDispatch(), torch.no_grad():
                found = on_loss.check(fresh, steps, self._lookup, root)
        except Exception as exc:  # the observer never kills the job (SPEC 4)
            self._error("experiment", exc)
            return
        for experiment in fresh:
            experiment.on_loss = found
        if found is None or found.after is not None:  # its backward, once autograd is done with this one
            queue_callback(lambda: self._check_backward(fresh, steps, root, found))

    def _check_backward(
        self, fresh: list[Experiment], steps: list[Step], root: tuple[str, Any] | None, found: OnLoss | None
    ) -> None:
        """At the end of the step's backward (a callback autograd runs): for a finite loss, whether the
        changes make its non-finite gradients finite (on_loss.check_gradients); for a loss they made
        finite (`found`), whether its gradients still are not (on_loss.gradients_left)."""
        try:
            with DisableTorchDispatch():
                if found is None:
                    checked = on_loss.check_gradients(fresh, steps, self._lookup, root)
                    for experiment in fresh:
                        experiment.on_loss = experiment.on_loss or checked
                elif on_loss.gradients_left(fresh, steps, self._lookup, root):
                    for experiment in fresh:
                        if experiment.on_loss is found:
                            experiment.on_loss = dataclasses.replace(found, gradients_left=True)
        except Exception as exc:  # runs inside autograd's engine: never raise there
            self._error("experiment", exc)

    def _guard(self, record: Record) -> bool:
        """An add of a small constant to one tensor (p + 1e-8 before a log): a guard against log(0)."""
        if not record.op.startswith("aten.add") or len(record.inputs) != 1:
            return False
        ran = next((s for s in reversed(self._window.steps) if s[0] is record), None)
        numbers = [a for a in (ran[2] if ran else ()) if type(a) in (int, float)]
        return len(numbers) == 1 and 0 < abs(numbers[0]) <= GUARD_EPS

    def _made_by(self, record: Record, argument: int = 0) -> Record | None:
        """The record that made one of `record`'s inputs (its first, or `argument`), where an op did."""
        if len(record.inputs) <= argument:
            return None
        kind, index = record.inputs[argument]
        return self._items.get(index) if kind == "op" else None

    def flush(self) -> None:
        """Read pending results in one host transfer (deferred mode): the leaves first, which
        the records of the same batch consumed, then the records in the order they ran."""
        if not self._pending and not self._pending_leaves:
            return
        pending, self._pending = self._pending, []
        leaves, self._pending_leaves = self._pending_leaves, []
        flat: list[torch.Tensor] = []
        for leaf, *_ in leaves:
            flat.extend(leaf.pending)
        for record, _ in pending:
            for o in record.outputs:
                if o.pending is not None:
                    flat.extend(o.pending)  # a (min, max) pair: deferred_range
        values = read_scalars(flat)
        position = 0
        for leaf, ref, seen, batch in leaves:
            leaf.pending = None
            leaf.lo = lo = values[position]
            leaf.hi = hi = values[position + 1]
            position += 2
            # 0 for finite values, NaN for NaN or an infinity (or finite fp64 values whose sum
            # passes the double range, which `resolve` then reads exactly): most stop here
            if not (lo + hi) * 0.0:
                continue
            t = ref()
            if t is not None and version(t) != seen:
                t = None  # written in place since: its values now are not the ones it was met with
            resolve(leaf, [lo, hi], t)
            if leaf.kind:
                self._bad_leaf(leaf, t, batch=batch)
        tainted = self._tainted
        for record, refs in pending:
            suspect = False
            for n, output in enumerate(record.outputs):
                if output.pending is None:
                    continue
                output.pending = None
                output.lo = lo = values[position]
                output.hi = hi = values[position + 1]
                position += 2
                if (lo + hi) * 0.0:  # as for the leaves
                    suspect = True
                    resolve(output, [lo, hi], refs[n]() if n < len(refs) else None)
            if suspect or tainted:
                self._settle(record)

    # -- bounding memory ---------------------------------------------------------------------
    def compact(self) -> None:
        """Forget finite records and leaves that nothing alive refers to any more."""
        self.flush()
        keep, keep_leaves = set(self._pinned), set(self._pinned_leaves)
        for _, (src, _) in self.provenance.items():
            (keep if src[0] == "op" else keep_leaves).add(src[1])
        self.provenance.sweep()
        self._keep_representatives(keep)
        keep.update(i for _, i in self._overflow_best.values())
        keep.update(self._exemplars.values())
        self.records.keep_only(keep)
        self.leaves.keep_only(keep_leaves)
        self.sinks = [s for s in self.sinks if s[0] != "op" or s[1] in keep]
        self._sink_keys = {(s[1], s[2]) for s in self.sinks}
        self._grad_leaves = {k: v for k, v in self._grad_leaves.items() if v[0]() is not None}
        self._received = {k: v for k, v in self._received.items() if v[0]() is not None}
        self._compiled = {k: v for k, v in self._compiled.items() if v[0]() is not None}
        if len(self._by_seq) > 1 << 17:  # nodes that old have run their backward (or never will)
            self._by_seq = dict(list(self._by_seq.items())[len(self._by_seq) // 2 :])
            self._seq_index = {k: v for k, v in self._seq_index.items() if k in self._by_seq}
        self._next_compact = self.records.count + max(COMPACT_EVERY, 2 * self.records.kept)

    def _keep_representatives(self, keep: set[int]) -> None:
        """Of the finite records about to be forgotten, keep what whole-run checks read: the
        latest of each kind of op (phase, op, module, dtypes: which phases ran, which casts
        autocast made) and, for headroom, the worst forward value near its format's max per
        (module, op, dtype), fp32 values against fp16's (the what-if). Both are bounded by the
        model's structure, not by the number of steps."""
        for record in self.records:
            if record.index in keep or record.kind:
                continue
            first = record.outputs[0].dtype if record.outputs else None
            source = record.inputs[0][0] if record.inputs else None
            self._exemplars[(record.phase, record.op, record.module, first, source)] = record.index
            if record.phase != "forward":
                continue
            for out in record.outputs:
                fmt = DTYPE_FORMAT.get(out.dtype)
                absmax = out.absmax
                if fmt == "fp32":
                    fmt = "fp16"
                if absmax is None or fmt in (None, "fp32"):
                    continue
                share = absmax / FORMATS[fmt].max
                key = (record.module, record.op, out.dtype)
                if share >= OVERFLOW_SHARE and share > self._overflow_best.get(key, (0.0, -1))[0]:
                    self._overflow_best[key] = (share, record.index)

    # -- sinks -------------------------------------------------------------------------------
    def _sink(self, index: int, description: str) -> None:
        record = self._items.get(index)
        if record is None or not (record.kind or record.pending or ("op", index) in self._tainted):
            return  # a finite value that no non-finite one went into says nothing
        key = (index, description)
        if key not in self._sink_keys:
            self._sink_keys.add(key)
            self.sinks.append(("op", index, description))

    def _at_backward_end(self) -> None:
        """Ask autograd to report gradient sinks when this backward finishes."""
        task = graph_task_id()
        if task != self._graph_task:
            self._graph_task = task
            queue_callback(self._gradient_sinks)

    def _gradient_sinks(self) -> None:
        """Every leaf that requires grad and holds a gradient: the gradient is a sink."""
        try:
            for key, (ref, name) in list(self._grad_leaves.items()):
                t = ref()
                if t is None:
                    del self._grad_leaves[key]
                    continue
                grad = t.grad
                src = self._lookup(grad) if grad is not None else None
                if src is not None and src[0] == "op":
                    self._sink(src[1], f"gradient of {name}")
        except Exception as exc:  # runs inside autograd's engine: never raise there
            self._error("gradient sinks", exc)

    def _state_sinks(self) -> None:
        """Each optimizer's state as the trace ends: a moment that holds Inf or NaN holds it for every
        later step (Adam's update divides by the root of an Inf second moment: that weight no longer
        moves), so the value that went into it was not masked, however finite the weights stayed."""
        names = self.tracker.param_names
        optimizers, self.tracker.optimizers = self.tracker.optimizers, {}  # read once: held no longer
        for optimizer in optimizers.values():
            for param, state in list(optimizer.state.items()):
                name = names.own(param) if isinstance(param, torch.Tensor) else None
                for key, value in list(state.items()) if isinstance(state, dict) else ():
                    src = self._lookup(value) if isinstance(value, torch.Tensor) else None
                    if src is not None and src[0] == "op":
                        self._sink(src[1], f"optimizer state {key} of {name or 'a parameter'}")

    def has_read(self, t: torch.Tensor) -> bool:
        """An op of this trace has read `t`, a view of it, or a value-preserving copy made of it
        (which shares its source): its source is a leaf (made at first use) or an op's output
        that was consumed."""
        src = self._lookup(t)
        if src is None:
            return False
        if src[0] == "leaf":
            return True
        record = self._items.get(src[1])
        return record is not None and record.consumed

    def producer_of(self, t: torch.Tensor) -> int | None:
        src = self._lookup(t)
        return src[1] if src is not None and src[0] == "op" else None

    def absmax_of(self, t: torch.Tensor) -> float | None:
        """The largest magnitude the producing op's aminmax saw, when it took and read one."""
        index = self.producer_of(t)
        record = self._items.get(index) if index is not None else None
        if record is None:
            return None
        out = record.outputs[0]
        return None if out.pending is not None else out.absmax

    def module_output(self, name: str, call: int, output: Any, recompute: bool) -> None:
        if recompute:
            return
        for t in tensors_in(output):
            index = self.producer_of(t)
            if index is not None:
                self._sink(index, f"output of module {name or '<root>'} (call {call + 1})")

    def finish(self) -> None:
        """Read what is pending and collect the end-of-block sinks: gradients and loose values."""
        self.flush()
        self._window.clear()  # experiments ran at the producers: the arguments go back to the user
        self._gradient_sinks()
        self._state_sinks()
        for record in self.records:
            tainted = ("op", record.index) in self._tainted
            if not (record.kind or tainted):
                continue
            if record.mutates is not None:
                when = "optimizer step" if record.phase == "optimizer" else "written in place"
                for out in record.outputs:
                    if out.param is not None and (out.kind or tainted):
                        self._sink(record.index, f"parameter {out.param} ({when})")
            elif record.module is None and record.phase == "forward" and not record.consumed:
                self._sink(record.index, RETURNED)
