"""A container's own ops - what its forward computes outside its submodules (attention's q·kᵀ and
softmax written in the container's forward, a residual add) - judged op by op in the fp64 pass.

compare's hooks say which module is innermost (`enter`, `leave`); an op that runs while a
container is innermost is one of that container's own. Each such op with a floating tensor input
and a floating output is re-run on its fp64 inputs cast to the candidate's compute dtype (on the
candidate's device; compare sets the candidate's backend flags for the whole comparison) and
compared with the fp64 output: the op's isolated error, and its floor (the fp64 output rounded to
the dtype the re-run's output is in, or the reference's error if that is larger; the reference's
dtype is re-run where its error can be the larger one). A container keeps its worst op by
error / floor.

Nothing large is kept or recomputed: an elementwise op is re-run on the evenly strided sample
of its output's elements (SAMPLE of them, its inputs gathered at the same positions); GEMMs,
attention, softmax and layer norm on ROWS of their rows (of a few batches or heads, spread)
where compare uses row subsets; any other op whole, compared on the strided sample of its output.

Not judged: views, casts and copies (exact, or the user's own choice of dtype), random ops (a
re-run would advance the RNG the fp64 pass draws from), ops without a floating tensor input.
Tensors the fp64 pass holds in another floating dtype (the user's own `.float()`) keep it, as
they do in the candidate's run. Finite fp64 values beyond a dtype's range (an additive mask made
from torch.finfo(torch.float64).min) are saturated to the dtype's max, as the candidate's own
constant (torch.finfo(torch.float16).min) would be, and the output values they carry beyond that
range are left out of the error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.precision.candidates import map_tensors
from fpdoctor.precision.metrics import (
    ROWS,
    Later,
    Reads,
    cosine_of,
    device_sample,
    diff_later,
    dot_later,
    due,
    floating,
    integral,
    norm_later,
    relative,
    sample_step,
    spread_index,
)
from fpdoctor.precision.profile import DIVERGENCE_RATIO
from fpdoctor.pytrees import tensors_in
from fpdoctor.torchprivate import EagerDispatchMode, current_mode, mode_popped
from fpdoctor.userframes import user_location

# Exact ops (they move, select or fill values) and casts: a re-run says nothing about precision.
_NOT_JUDGED = {
    "aten._to_copy", "aten.to", "aten.clone", "aten.contiguous", "aten._unsafe_view", "aten.copy_", "aten.copy",
    "aten.lift_fresh", "aten.detach", "aten.cat", "aten.stack", "aten.index_select", "aten.gather", "aten.index",
    "aten.repeat", "aten.constant_pad_nd", "aten.flip", "aten.roll", "aten.fill_", "aten.zero_", "aten.zeros_like",
    "aten.ones_like", "aten.empty_like", "aten.full_like", "aten.new_zeros", "aten.new_ones", "aten.new_empty",
    "aten.new_full", "aten.slice_scatter", "aten.select_scatter", "aten.masked_fill", "aten.masked_fill_",
}  # fmt: skip
# Ops that make values the candidate's format rounds before anything computes with them, where they
# are made in the model's dtype: whole numbers from none (an arange) or from integers (a cast of
# positions, of timesteps) or counted from a mask (positions as mask.cumsum(-1) - 1), past the
# format's exact range; random draws (a uniform draw in bf16 takes bf16's values only: none above
# 0.996, and 0 once in 512 draws).
_MAKERS = {
    "aten.arange": "whole", "aten._to_copy": "whole", "aten.cumsum": "count",
    "aten.rand": "draw", "aten.rand_like": "draw", "aten.randn": "draw", "aten.randn_like": "draw",
    "aten.uniform_": "draw", "aten.normal_": "draw",
}  # fmt: skip
MADE_SITES = 4  # lines recorded per pass, at most
OTHERS = 3  # lines besides the worst's that leave their floor, kept per call
OTHER_RATIO = 4.0  # x their floor: tried with the worst's lines only where those alone are not enough


@dataclass(frozen=True)
class Made:
    """A line that makes values in the model's dtype which the candidate's format rounds: whole
    numbers past its exact range (`largest`, the largest of them), or a random draw."""

    location: str
    kind: str  # "whole" or "draw"
    largest: float | None = None


# An op re-run whole is kept, its figures read at the pass's end with the others, when its inputs
# hold at most this much (its follow-ups re-run it from them); a larger one is read at once, so that
# the pass never holds more than a few activations: its own work dwarfs the wait for the device.
KEPT_BYTES = 1 << 20
# What the pending own ops of a pass may hold (their re-runs' inputs, samples) before their figures are
# read and they are judged, mid-pass: one more wait for the device per HELD_BYTES, where keeping them
# all to the pass's end grew its memory with the model's depth (~2.5 MiB a layer, dim 256).
HELD_BYTES = 16 << 20
# Ops whose output rows (dim -2) are computed from the same rows of their `first` input alone.
_GEMMS = {"aten.mm": 0, "aten.bmm": 0, "aten.addmm": 1, "aten.baddbmm": 1}
_ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu"
_LAST_DIM = {"aten._softmax", "aten._log_softmax", "aten._safe_softmax"}  # along dim, the last one
# A batched GEMM or attention is re-run on ROWS rows spread over BATCHES of its batches (heads),
# MIN_ROWS of each at the least: a few positions of each, rather than one row everywhere.
BATCHES = 8
MIN_ROWS = 8

_TORCH_ROOT = os.path.dirname(os.path.dirname(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# torch's frames between an op's Python call and this mode: never where the op is written
_PLUMBING = tuple(
    os.path.join(os.path.dirname(torch.__file__), p)
    for p in ("_ops.py", "utils/_python_dispatch.py", "_tensor.py", "overrides.py", "_compile.py", "_dynamo")
)


@dataclass
class OpError:
    """One own op judged: its isolated error against fp64 and its floor, on stated elements."""

    op: str
    error: float
    floor: float
    rounding: float  # the fp64 output rounded to the dtype of the re-run's output
    reference: float | None
    cosine: float | None
    values: tuple[int, int, int]  # (values compared, values of the output part re-run, every k-th)
    rows: tuple[int, int] | None = None  # (rows re-run, rows of the output) for a row subset
    left_out: int = 0  # sampled values beyond the dtype's range that only saturated inputs carry
    overflow: bool = False  # non-finite values where the fp64 output is finite
    absmax: float | None = None  # the fp64 output's largest magnitude, when it overflows
    location: str | None = None  # file:line in the user's code (and in torch's, for torch's modules)
    # the op run exactly (fp64) on its inputs rounded to the candidate's dtype: what its conditioning
    # forces on any computation that reads inputs in that dtype (None: not measured)
    conditioned: float | None = None

    @property
    def ratio(self) -> float:
        return math.inf if math.isinf(self.error) else self.error / max(self.floor, 1e-300)


@dataclass
class Own:
    """What one call of a container computed itself, and its worst op."""

    judged: int = 0
    worst: OpError | None = None
    ops: list[str] = field(default_factory=list)  # the ops judged, each once, in order
    failed: list[str] = field(default_factory=list)  # ops that did not run in the candidate's dtype, and why
    # calls of each (op, input shapes) so far: a loop repeats one op thousands of times per forward
    repeats: dict[tuple[Any, ...], int] = field(default_factory=dict)
    # the largest error an op's conditioning forces on fp32 (its floor there): what it explains end to end;
    # and that op, with its line (a difference of two large totals: what makes the error, though no fp32 op can
    # do better on what it reads)
    forced: float = 0.0
    forced_at: tuple[str, str | None] | None = None
    # per user line, its worst op past OTHER_RATIO x its floor: a second line that leaves its floor beside the
    # worst's (two running sums subtracted, each on its own line), tried with it where the worst's alone is not enough
    diverging: dict[str, OpError] = field(default_factory=dict)

    def as_dict(self, dtype: str) -> dict[str, Any]:
        worst = self.worst
        return {
            "judged": self.judged,
            "ops": self.ops,
            "dtype": dtype,
            "failed": self.failed,
            "op": None if worst is None else worst.op,
            "location": None if worst is None else worst.location,
            "error_rel": None if worst is None else worst.error,
            "floor_rel": None if worst is None else worst.floor,
            "overflow": False if worst is None else worst.overflow,
            "absmax": None if worst is None else worst.absmax,
            "values": None if worst is None else list(worst.values),
            "rows": None if worst is None or worst.rows is None else list(worst.rows),
            "left_out": 0 if worst is None else worst.left_out,
            "conditioned_rel": None if worst is None else worst.conditioned,
            "forced_rel": self.forced or None,
            "forced_op": None if self.forced_at is None else self.forced_at[0],
            "forced_location": None if self.forced_at is None else self.forced_at[1],
            "others": [
                {"op": e.op, "location": e.location, "ratio": e.ratio}
                for e in sorted(self.diverging.values(), key=lambda e: -e.ratio)
                if worst is None or e.location != worst.location
            ][:OTHERS],
        }


@dataclass
class _Rerun:
    """How an op is re-run: its inputs (a part of them, or copies of an in-place op's), and the
    part of its fp64 output they compute."""

    args: Any
    kwargs: Any
    pick: Callable[[torch.Tensor], torch.Tensor | None]
    rows: tuple[int, int] | None = None
    values: tuple[int, int, int] | None = None  # an elementwise op's sample: (values, of, every k-th)


class OwnOps(EagerDispatchMode):
    """Judges the ops each container call runs itself (see the module's docstring).

    `torch_made`: containers whose class is torch's (nn.MultiheadAttention): their ops' lines are
    in torch, named beside the user's line that called them. `record`: called with (op, output)
    for every op this mode sees (the fp64 pass's op ranges, near_limit.OpRanges.record): one
    Python dispatch per op for both, since each dispatch mode costs more per op than a tiny op."""

    def __init__(
        self,
        containers: set[str],
        *,
        dtype: torch.dtype,
        reference: torch.dtype | None,
        device: torch.device | None,
        subsets: bool,
        torch_made: set[str] | None = None,
        record: Callable[[Any, Any], None] | None = None,
        reads: Reads | None = None,
        model_storages: set[int] | None = None,
    ) -> None:
        super().__init__()
        # the figures of the ops judged, read at the pass's end (compare reads `reads`, then settle())
        self.reads = Reads() if reads is None else reads
        self.pending: list[_Pending] = []
        self._held = 0  # bytes the pending ops hold (HELD_BYTES)
        # the storages of the model's parameters and buffers: alive anyway, so not counted as held
        self.model_storages = model_storages or set()
        self.containers, self.dtype, self.reference, self.device = containers, dtype, reference, device
        self.subsets, self.torch_made, self.record = subsets, torch_made or set(), record
        # A reference that rounds far finer than the candidate's dtype (fp32 against fp16, bf16)
        # has an error above the candidate's rounding only where the op amplifies errors so much
        # that the candidate's error is far above that rounding too: it is re-run only there.
        self.coarse = reference is not None and torch.finfo(dtype).eps > DIVERGENCE_RATIO * torch.finfo(reference).eps
        self.stack: list[tuple[str, int]] = []
        self.calls: dict[tuple[str, int], Own] = {}
        self.current: Own | None = None  # the innermost module call's, if it is a container's
        self.pause = 0
        # id(op overload) -> (never judged, the overload, kept so its id stays its own, its output's
        # shape depends on the data, what it makes (_MAKERS)): an OpOverload's __hash__ is Python code
        self._kinds: dict[int, tuple[bool, Any, bool, str | None]] = {}
        # values made in the model's dtype that the candidate's format rounds (Made), and the lines
        # whose values are not whole numbers (read once: a read waits for the device)
        self.made: list[Made] = []
        self._not_made: set[str] = set()
        # while a list: the repeat key of each op counted (own_calls.OwnCalls learns a call's ops from
        # it), and None after an op whose output's shape depends on the values (nonzero, item)
        self.log: list[Any] | None = None

    def enter(self, name: str, index: int) -> None:
        self.stack.append((name, index))
        self.current = None
        if name in self.containers:
            self.current = self.calls[(name, index)] = Own()

    def leave(self, name: str, index: int) -> None:
        while self.stack and self.stack.pop() != (name, index):
            pass
        self.current = self.calls.get(self.stack[-1]) if self.stack else None

    def take(self, name: str, index: int) -> Own | None:
        return self.calls.pop((name, index), None)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """compare's own work in its hooks (samples, a leaf's re-runs) is no op of the model's: off
        the dispatch stack while it runs, so its ops skip this mode's Python call; below another
        mode (the replayed noise, which the re-runs need), just ignored."""
        if current_mode() is self:
            with mode_popped():
                yield
            return
        self.pause += 1
        try:
            yield
        finally:
            self.pause -= 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        own = None if self.pause else self.current
        if own is not None:
            kind = self._kinds.get(id(func))
            if kind is None:
                data_shaped = bool({torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output} & set(func.tags))
                packet = _packet(func)
                kind = self._kinds[id(func)] = (
                    func.is_view or packet in _NOT_JUDGED,
                    func,
                    data_shaped,
                    _MAKERS.get(packet),
                )
            # first the tests that cost least: a view, cast or copy is never judged, and a repeat
            # of an op (same op, same input shapes) is re-run only when due
            judged = not kind[0] and _due(own, func, args, self.log) and not _random(func, args, kwargs)
            if self.log is not None and kind[2]:  # the shapes of the ops after it depend on the values
                self.log.append(None)
            if judged and any(True for _ in floating((args, kwargs))):
                # planned before the op runs: an in-place op changes its inputs
                rerun = _plan(func, args, kwargs, subsets=self.subsets)
                out = func(*args, **kwargs)
                self._judge(own, func, rerun, out, torch_made=self.stack[-1][0] in self.torch_made)
                if kind[3] is not None and len(self.made) < MADE_SITES:  # a count of a mask is judged too
                    self._made(kind[3], args, out)
                if self.record is not None:
                    self.record(func, out)
                return out
            if kind[3] is not None and len(self.made) < MADE_SITES:
                out = func(*args, **kwargs)
                self._made(kind[3], args, out)
                if self.record is not None:
                    self.record(func, out)
                return out
        out = func(*args, **kwargs)
        if self.record is not None:
            self.record(func, out)
        return out

    def _made(self, kind: str, args: Any, out: Any) -> None:
        """Values made in float64 in this pass, so in the model's dtype, which is the candidate's
        there: a random draw in a 16-bit candidate; an arange or integers cast to a floating dtype
        past exact_whole (positions past 256 in bf16). Recorded once per line."""
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float64 or out.numel() == 0:
            return
        if kind == "draw" and torch.finfo(self.dtype).bits > 16:
            return
        source = args[0] if args else None
        if kind == "whole" and isinstance(source, torch.Tensor) and not integral(source):
            return  # a cast of floats (compare's own, the user's .double()), or of a mask: no whole numbers
        kind = "whole" if kind == "count" else kind  # a cumsum: whole numbers where what it sums is (a mask)
        at = _where(sys._getframe(), torch_made=False)
        if at is None or at in self._not_made or any(m.location == at for m in self.made):
            return
        if kind == "draw":
            self.made.append(Made(at, kind))
            return
        if not bool((out == out.round()).all()):
            self._not_made.add(at)  # not whole numbers (a cumsum of activations): never read again
            return
        largest = float(out.abs().max())  # whole numbers within the range are read again: positions grow
        if largest > 2.0 / torch.finfo(self.dtype).eps:
            self.made.append(Made(at, kind, largest))

    def _judge(self, own: Own, func: Any, rerun: _Rerun, out: Any, *, torch_made: bool) -> None:
        full = next(floating(out), None)
        part = rerun.pick(full) if full is not None and full.layout == torch.strided else None
        if part is None:
            return
        name = str(func)
        (cand_args, cand_kwargs), saturated = _cast((rerun.args, rerun.kwargs), self.dtype, self.device)
        try:
            cand = next(floating(_on(func, self.device)(*cand_args, **cand_kwargs)), None)
        except Exception as exc:  # no kernel for this dtype here: the figure is missing, with why
            if len(own.failed) < 3:
                own.failed.append(f"{name} raised {type(exc).__name__} in {_dtype(self.dtype)}: {_first_line(exc)}")
            return
        truth = device_sample(part)
        if cand is not None and cand.shape != part.shape and cand.numel() == part.numel():
            cand = cand.reshape(part.shape)  # a 0-d output, picked as one value (the difference of two totals)
        if cand is None or truth is None or cand.shape != part.shape:
            return
        sample = device_sample(cand)
        if sample is None or sample.numel() != truth.numel():
            return
        sample = sample.to(truth.device)
        limit = torch.finfo(cand.dtype).max
        # the sampled values judged: the finite ones, and with saturated inputs those within the range
        keep = torch.isfinite(truth)
        if saturated is not None:
            keep &= ~saturated.to(truth.device) | (truth.abs() <= limit)
        kept = torch.where(keep, truth, 0.0)
        made = _made_nonfinite(cand, part, limit, saturated)
        mine = torch.where(keep, sample, 0.0)
        pending = _Pending(
            own, name, func, rerun, part.numel(), keep, kept, _where(sys._getframe(), torch_made),
            same=self.reference == cand.dtype and self.device is None,
        )  # fmt: skip
        figures: list[torch.Tensor | Later | float | None] = [
            made, norm_later(kept), diff_later(mine, kept), norm_later(mine), dot_later(mine, kept),
            # kept is 0 where not judged, and so is it rounded
            diff_later(kept.to(cand.dtype).double(), kept), part.abs().max(), keep.sum(),
            torch.where(saturated.to(keep.device), (~keep).sum(), 0) if saturated is not None else 0.0,
            # the reference's error, where it is always wanted (not far coarser than the candidate): run now
            _error_of(func, self.reference, None, rerun, keep=keep, kept=kept)
            if self.reference is not None and not pending.same and not self.coarse else None,
        ]  # fmt: skip
        self.pending.append(pending)
        if rerun.rows is not None or rerun.values is not None or _nbytes(rerun) <= KEPT_BYTES:
            self.reads.later(figures, pending.read)
            self._held += keep.numel() * (keep.element_size() + kept.element_size()) + sum(
                t.numel() * t.element_size()
                for t in tensors_in((rerun.args, rerun.kwargs))
                if t.untyped_storage().data_ptr() not in self.model_storages
            )
            if self._held > HELD_BYTES:
                self.reads.read()
                self.settle()
            return
        # A re-run of the whole op on large inputs: read at once and followed up, its inputs not kept.
        now = Reads()
        now.later(figures, pending.read)
        now.read()
        self._follow([pending])
        pending.rerun = _Rerun(None, None, rerun.pick, rerun.rows, rerun.values)

    def _follow(self, pending: list[_Pending]) -> None:
        """The reference's and the exact run's errors of the ops whose figures call for them (an error
        far above its rounding: few ops), read together."""
        later = Reads()
        for p in pending:
            if p.error is None or p.followed:
                continue
            p.followed = True
            far = not p.error <= DIVERGENCE_RATIO * p.rounding  # the reference's error may be the larger
            if self.reference is not None and not p.same and self.coarse and far:
                later.later([_error_of(p.func, self.reference, None, p.rerun, keep=p.keep, kept=p.kept)],
                            p.read_reference)  # fmt: skip
            if not p.made and p.error > DIVERGENCE_RATIO * (0.0 if math.isinf(p.rounding) else p.rounding):
                exact = _error_of(p.func, torch.float64, self.device, p.rerun, keep=p.keep, kept=p.kept, via=self.dtype)
                later.later([exact], p.read_exact)
        later.read()

    def settle(self) -> None:
        """After the pass's figures are read (compare's Reads): the follow-ups, then each container's
        worst op, judged in the order its ops ran by the rules OwnOps applied op by op."""
        pending, self.pending, self._held = self.pending, [], 0
        self._follow(pending)
        for p in pending:
            if p.error is not None:
                p.settle(self.dtype)


@dataclass
class _Pending:
    """One own op judged in the pass, its figures read at the pass's end (metrics.Reads): what the
    judgement needs of it until then, small (a sample, a few rows)."""

    own: Own
    name: str
    func: Any
    rerun: _Rerun
    numel: int  # values of the output part re-run
    keep: torch.Tensor  # the sampled values judged
    kept: torch.Tensor  # the fp64 sample, 0 where not judged
    location: str | None
    same: bool = False  # the reference runs the candidate's kernel on the same inputs: its error is the candidate's
    followed: bool = False
    error: float | None = None
    rounding: float = 0.0
    made: bool = False
    cosine: float | None = None
    absmax: float = 0.0
    values: int = 0
    left_out: int = 0
    reference: float | None = None  # None: not run (or it could not run)
    exact: float | None = None  # the op run exactly on its inputs rounded to the candidate's dtype
    norm: float = 0.0

    def read(self, *figures: Any) -> None:
        """_judge's figures, read: made, norms (truth, error, re-run), dot, rounding's error norm, the
        output part's largest magnitude, values judged, values left out, the reference's error norm."""
        made, norm, diff, a_norm, dot, rounded, absmax, kept, left_out, reference = figures
        self.made, self.norm = bool(made), norm
        self.error = math.inf if self.made else relative(diff, norm)
        self.rounding = relative(rounded, norm)
        self.cosine = None if self.made else cosine_of(dot, a_norm, norm)
        self.absmax, self.values, self.left_out = absmax, int(kept), int(left_out)
        self.read_reference(reference)

    def read_reference(self, diff: float | None) -> None:
        self.reference = None if diff is None else relative(diff, self.norm)

    def read_exact(self, diff: float | None) -> None:
        self.exact = None if diff is None else relative(diff, self.norm)

    def settle(self, dtype: torch.dtype) -> None:
        """The judgement OwnOps made op by op before its figures were read at the pass's end: the same
        rules on the same figures."""
        own, error = self.own, self.error
        assert error is not None
        reference = error if self.same else self.reference
        floor = max(0.0 if math.isinf(self.rounding) else self.rounding, reference or 0.0, 1e-300)
        conditioned = None
        if dtype == torch.float32 and not self.made and error > DIVERGENCE_RATIO * floor:
            # fp32 is the most precise format a run takes: what the op's conditioning forces on any fp32
            # computation of it (its inputs rounded to fp32, then run exactly) is the floor, not a divergence
            conditioned = self.exact
            floor = max(floor, conditioned or 0.0)
            if conditioned is not None and conditioned > own.forced:
                own.forced, own.forced_at = conditioned, (self.name, self.location)
        rerun = self.rerun
        values = rerun.values or (self.values, self.numel, sample_step(self.numel))
        judged = OpError(
            self.name, error, floor, self.rounding, reference, self.cosine, values, rerun.rows, self.left_out,
            self.made, conditioned=conditioned,
        )  # fmt: skip
        own.judged += 1
        if self.name not in own.ops:
            own.ops.append(self.name)
        if judged.ratio > OTHER_RATIO and self.location is not None:
            known = own.diverging.get(self.location)
            if known is None or judged.ratio > known.ratio:
                own.diverging[self.location] = dataclasses.replace(judged, location=self.location)
        if own.worst is None or judged.ratio > own.worst.ratio:
            if self.made:
                judged.absmax = self.absmax
            elif judged.ratio > DIVERGENCE_RATIO and judged.conditioned is None:
                judged.conditioned = self.exact
            judged.location = self.location
            own.worst = judged


def _nbytes(rerun: _Rerun) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_in((rerun.args, rerun.kwargs)))


def _error_of(
    func: Any, dtype: torch.dtype, device: torch.device | None, rerun: _Rerun, *, keep: torch.Tensor,
    kept: torch.Tensor, via: torch.dtype | None = None,
) -> Later | None:  # fmt: skip
    """The norm of the error of `func` run in `dtype` on the re-run's inputs, on the judged sample,
    not read; with `via`, its inputs first rounded to `via` (on `device`, as the candidate ran them)
    and every floating one then raised to `dtype` (the exact run on the candidate's inputs). None when
    it cannot run there or its output does not match."""
    call = _cast((rerun.args, rerun.kwargs), via or dtype, device)[0]
    if via is not None:
        call = map_tensors(call, lambda t: t.to(dtype) if t.is_floating_point() else t)
    try:
        got = device_sample(next(floating(func(*call[0], **call[1])), None))
    except Exception:  # no kernel for it here: not measured
        return None
    if got is None or got.numel() != kept.numel():
        return None
    return diff_later(torch.where(keep, got.to(kept.device), 0.0), kept)


def _due(own: Own, func: Any, args: Any, log: list[Any] | None = None) -> bool:
    """Whether this call of a repeated op (same op, same input shapes) is re-run (metrics.due);
    `log` gets its key."""
    key = (id(func), *[a.shape if type(a) is torch.Tensor else None for a in args])  # no hash of func: per op
    if log is not None:
        log.append(key)
    k = own.repeats.get(key, 0)
    own.repeats[key] = k + 1
    return due(k)


def _on(func: Any, device: torch.device | None) -> Callable[..., Any]:
    """The op as the candidate's device runs it: CPU attention is the CPU's own kernel, elsewhere
    the same attention picks that device's."""
    if device is None or device.type == "cpu" or _packet(func) != _ATTENTION:
        return func

    def attention(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, **kwargs: Any) -> Any:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=kwargs.get("attn_mask"), is_causal=is_causal, scale=kwargs.get("scale")
        )

    return attention


def _packet(func: Any) -> str:
    return str(func.overloadpacket)


def _random(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether the op draws random numbers: attention is tagged so for its dropout, drawn only
    when dropout_p > 0."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return True
    k = names.index("dropout_p")
    return bool(args[k] if len(args) > k else kwargs.get("dropout_p", 0.0))


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def _where(frame: Any, torch_made: bool) -> str | None:
    """file:line of the op in the user's code; in a torch module, torch's line too."""
    user = user_location(frame)
    at = None if user is None else f"{user[0]}:{user[1]}"
    if not torch_made:
        return at
    while frame is not None and frame.f_code.co_filename.startswith((_OWN_DIR, *_PLUMBING)):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_TORCH_ROOT):
        return at
    inner = f"{frame.f_code.co_filename.removeprefix(_TORCH_ROOT)}:{frame.f_lineno} ({frame.f_code.co_name})"
    return inner if at is None else f"{inner}, called from {at}"


def _plan(func: Any, args: Any, kwargs: Any, *, subsets: bool) -> _Rerun:
    """How to re-run the op: elementwise on a sample, row-wise on some rows, else whole."""
    planned = _elementwise(args, kwargs) if torch.Tag.pointwise in func.tags else None
    if planned is None and subsets:
        planned = _rowwise(func, args, kwargs)
    if planned is not None:
        return planned
    if func._schema.is_mutable:  # the values it got, not those it leaves
        args, kwargs = map_tensors((args, kwargs), lambda t: t.clone())
    return _Rerun(args, kwargs, lambda out: out)


def _elementwise(args: Any, kwargs: Any) -> _Rerun | None:
    """An elementwise op on the evenly strided sample of its output's elements: each input
    (broadcast to the output's shape) gathered at the same positions."""
    tensors = tensors_in((args, kwargs))
    shape = _broadcast([t.shape for t in tensors])
    if shape is None:
        return None
    total = math.prod(shape)
    if not total:
        return None
    step = sample_step(total)
    device = next((t.device for t in tensors if t.dim()), tensors[0].device)
    positions: list[tuple[torch.Tensor, ...]] = []

    def at() -> tuple[torch.Tensor, ...]:  # the sampled positions, for a broadcast or strided tensor
        if not positions:
            positions.append(_unravel(torch.arange(0, total, step, device=device), shape))
        return positions[0]

    def take(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t.clone()
        if t.shape == shape and t.is_contiguous():  # the same positions, read as flat_sample reads them
            return t.reshape(-1)[::step].clone()
        return t.expand(shape)[at()]

    def pick(out: torch.Tensor) -> torch.Tensor | None:
        if out.shape != shape:
            return None
        return out.reshape(-1)[::step] if out.is_contiguous() else out[at()]

    args, kwargs = map_tensors((args, kwargs), take)
    return _Rerun(args, kwargs, pick, values=(-(-total // step), total, step))


def _broadcast(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """torch.broadcast_shapes without its first call's import of sympy (~40 MiB); None if they do not."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for shape in shapes:
        for k, size in enumerate(shape, ndim - len(shape)):
            if size != 1 and out[k] not in (1, size):
                return None
            out[k] = size if size != 1 else out[k]
    return tuple(out)


def _unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """torch.unravel_index without its first call's import of sympy (~40 MiB)."""
    coords = []
    for size in reversed(shape):
        coords.append(flat % size)
        flat = flat // size
    return tuple(reversed(coords))


def _rowwise(func: Any, args: Any, kwargs: Any) -> _Rerun | None:
    """A GEMM, CPU attention, softmax or layer norm on a few of its output's rows: of a batched
    one, a few rows of a few batches (heads), spread; None when it is small or no such op."""
    packet = _packet(func)
    if packet in _LAST_DIM or packet == "aten.native_layer_norm":
        return _last_dim_rows(packet, args, kwargs)
    if packet not in _GEMMS and packet != _ATTENTION:
        return None
    first = _GEMMS.get(packet, 0)
    if len(args) <= first or not isinstance(args[first], torch.Tensor) or args[first].dim() < 2:
        return None
    x = args[first]
    batch_shape, rows = tuple(x.shape[:-2]), x.shape[-2]
    batch = math.prod(batch_shape)
    batches = min(batch, BATCHES)
    keep = min(rows, max(MIN_ROWS, math.ceil(ROWS / batches)))
    if batches * keep * 2 > batch * rows:
        return None  # at least half of it: as cheap whole
    index = spread_index(rows, keep, x.device)
    at = _unravel(spread_index(batch, batches, x.device), batch_shape) if batch_shape else ()
    attention = packet == _ATTENTION
    if attention and ((len(args) > 4 and args[4]) or kwargs.get("is_causal")):
        return None  # the causal mask is aligned to the first query row: it needs them all

    def part(t: Any, *, rows_too: bool) -> Any:
        """`t` (broadcast against x's batch dims) at the chosen batches, and rows where it has x's."""
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return t
        if t.dim() - 2 < len(batch_shape):  # broadcast over the leading batch dims
            t = t.reshape((1,) * (len(batch_shape) + 2 - t.dim()) + tuple(t.shape))
        sizes = t.shape[: len(batch_shape)]
        if t.dim() - 2 != len(batch_shape) or any(n not in (1, m) for n, m in zip(sizes, batch_shape, strict=True)):
            return None
        picked = t[tuple(i if n > 1 else torch.zeros_like(i) for i, n in zip(at, sizes, strict=True))]
        if attention:  # the kernel takes (batch, heads, rows, width): the chosen pairs as heads of one batch
            picked = picked.unsqueeze(0)
        if rows_too and t.shape[-2] == rows and rows > 1:
            picked = picked.index_select(-2, index)
        return picked

    new = [part(a, rows_too=k == first or (k == 0 and first == 1)) for k, a in enumerate(args)]
    kwargs = {k: part(v, rows_too=k == "attn_mask") for k, v in kwargs.items()}
    if any(n is None for n in new) or any(v is None for v in kwargs.values()):
        return None  # an operand with other batch dims (grouped-query attention): whole

    def pick(out: torch.Tensor) -> torch.Tensor | None:
        if tuple(out.shape[:-2]) != batch_shape or out.shape[-2] != rows:
            return None
        picked = out[at] if batch_shape else out
        return (picked.unsqueeze(0) if attention else picked).index_select(-2, index)

    return _Rerun(tuple(new), kwargs, pick, rows=(batches * keep, batch * rows))


def _last_dim_rows(packet: str, args: Any, kwargs: Any) -> _Rerun | None:
    """Softmax along the last dim, layer norm over the last dims: ROWS of the rows before them."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.is_contiguous():
        return None
    if packet == "aten.native_layer_norm":
        width = len(args[1])
    elif len(args) > 1 and args[1] in (-1, x.dim() - 1):
        width = 1
    else:
        return None
    inner = x.shape[x.dim() - width :]
    rows = math.prod(x.shape[: x.dim() - width])
    if rows <= ROWS:
        return None
    index = spread_index(rows, ROWS, x.device)
    new = list(args)
    new[0] = x.reshape(rows, *inner).index_select(0, index)
    if packet in _LAST_DIM:
        new[1] = -1

    shape = x.shape  # not x: the plan is kept to the pass's end, and x may be a large activation

    def pick(out: torch.Tensor) -> torch.Tensor | None:
        return out.reshape(rows, *inner).index_select(0, index) if out.shape == shape else None

    return _Rerun(tuple(new), kwargs, pick, rows=(ROWS, rows))


def _cast(call: Any, dtype: torch.dtype, device: torch.device | None) -> tuple[Any, torch.Tensor | None]:
    """((args, kwargs) with float64 tensors in `dtype`, the others in their own dtype (the user's
    casts), all on `device`; whether a finite value beyond `dtype`'s range was saturated, as a 0-d
    bool on the device, not read (None: no float64 tensor). A finite float64 value beyond the range
    becomes the range's end, as the candidate's own constant (torch.finfo(torch.float16).min) is:
    clamped on the device whatever the values, so that no value is read to decide it."""
    limit = torch.finfo(dtype).max
    flags: list[torch.Tensor] = []
    numbers = [False]

    def cast(t: torch.Tensor) -> torch.Tensor:
        if t.dtype != torch.float64:
            return t.to(device=device)
        finite = torch.isfinite(t)
        flags.append((finite & (t.abs() > limit)).any())
        return torch.where(finite, t.clamp(-limit, limit), t).to(device=device, dtype=dtype)

    def number(value: Any) -> Any:
        if isinstance(value, float) and math.isfinite(value) and abs(value) > limit:
            numbers[0] = True
            return math.copysign(limit, value)
        return value

    args, kwargs = call
    args = tuple(number(a) for a in args)
    kwargs = {k: number(v) for k, v in kwargs.items()}
    cast_call = (map_tensors(args, cast), map_tensors(kwargs, cast))
    saturated: torch.Tensor | None = None
    for flag in flags:
        saturated = flag if saturated is None else saturated | flag.to(saturated.device)
    if numbers[0]:
        saturated = torch.ones((), dtype=torch.bool) if saturated is None else torch.ones_like(saturated)
    return cast_call, saturated


def _made_nonfinite(
    cand: torch.Tensor, truth: torch.Tensor, limit: float, saturated: torch.Tensor | None
) -> torch.Tensor:
    """Whether the re-run has a non-finite value where the fp64 output is finite (and, with
    saturated inputs, within `limit`): one the op made itself; a 0-d bool, not read."""
    judged = torch.isfinite(truth)
    if saturated is not None:
        judged &= ~saturated.to(truth.device) | (truth.abs() <= limit)
    return (judged > torch.isfinite(cand.to(truth.device))).any()  # judged and not finite
