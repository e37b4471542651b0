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
    all_finite,
    cosine,
    due,
    flat_sample,
    floating,
    l2_norm,
    rel_error,
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
    # the largest error an op's conditioning forces on fp32 (its floor there): what it explains end to end
    forced: float = 0.0

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
    ) -> None:
        super().__init__()
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
        # shape depends on the data): an OpOverload's __hash__ is Python code, asked for every op
        self._kinds: dict[int, tuple[bool, Any, bool]] = {}
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
                kind = self._kinds[id(func)] = (func.is_view or _packet(func) in _NOT_JUDGED, func, data_shaped)
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
                if self.record is not None:
                    self.record(func, out)
                return out
        out = func(*args, **kwargs)
        if self.record is not None:
            self.record(func, out)
        return out

    def _judge(self, own: Own, func: Any, rerun: _Rerun, out: Any, *, torch_made: bool) -> None:
        full = next(floating(out), None)
        part = rerun.pick(full) if full is not None and full.layout == torch.strided else None
        if part is None:
            return
        name = str(func)
        big = _largest((rerun.args, rerun.kwargs))
        (cand_args, cand_kwargs), saturated = _cast((rerun.args, rerun.kwargs), self.dtype, self.device, big)
        try:
            cand = next(floating(_on(func, self.device)(*cand_args, **cand_kwargs)), None)
        except Exception as exc:  # no kernel for this dtype here: the figure is missing, with why
            if len(own.failed) < 3:
                own.failed.append(f"{name} raised {type(exc).__name__} in {_dtype(self.dtype)}: {_first_line(exc)}")
            return
        truth = flat_sample(part)
        if cand is None or truth is None or cand.shape != part.shape:
            return
        limit = torch.finfo(cand.dtype).max
        keep: torch.Tensor | slice = slice(None)  # every sampled value, unless some are not to be judged
        if saturated or not all_finite(truth):
            keep = torch.isfinite(truth) & (truth.abs() <= limit) if saturated else torch.isfinite(truth)
        kept = truth[keep]
        norm = l2_norm(kept)
        made = not all_finite(cand) and _made_nonfinite(cand, part, limit if saturated else None)
        sample = flat_sample(cand)
        if sample is None or sample.numel() != truth.numel():
            return
        error = math.inf if made else rel_error(sample[keep], kept, norm)
        # rounded to the dtype the re-run's output is in: an input the user keeps in fp32 promotes it
        rounding = rel_error(kept.to(cand.dtype).double(), kept, norm)
        reference = None
        if self.reference == cand.dtype and self.device is None:
            reference = error  # the same kernel on the same inputs: the reference's error is the candidate's
        elif self.reference is not None and not (self.coarse and error <= DIVERGENCE_RATIO * rounding):
            ref_args, ref_kwargs = _cast((rerun.args, rerun.kwargs), self.reference, None, big)[0]
            try:
                ref_sample = flat_sample(next(floating(func(*ref_args, **ref_kwargs)), None))
            except Exception:  # the reference cannot run it: the floor is the rounding alone
                ref_sample = None
            if ref_sample is not None and ref_sample.numel() == truth.numel():
                reference = rel_error(ref_sample[keep], kept, norm)
        floor = max(0.0 if math.isinf(rounding) else rounding, reference or 0.0, 1e-300)
        conditioned = None
        if self.dtype == torch.float32 and not made and error > DIVERGENCE_RATIO * floor:
            # fp32 is the most precise format a run takes: what the op's conditioning forces on any fp32
            # computation of it (its inputs rounded to fp32, then run exactly) is the floor, not a divergence
            conditioned = _conditioned(func, (cand_args, cand_kwargs), keep, truth, norm)
            floor = max(floor, conditioned or 0.0)
            own.forced = max(own.forced, conditioned or 0.0)
        values = rerun.values or (kept.numel(), part.numel(), sample_step(part.numel()))
        left_out = truth.numel() - kept.numel() if saturated else 0
        judged = OpError(
            name, error, floor, rounding, reference, None if made else cosine(sample[keep], kept, norm),
            values, rerun.rows, left_out, made, conditioned=conditioned,
        )  # fmt: skip
        own.judged += 1
        if name not in own.ops:
            own.ops.append(name)
        if own.worst is None or judged.ratio > own.worst.ratio:
            if made:
                judged.absmax = float(part.abs().max())
            elif judged.ratio > DIVERGENCE_RATIO and judged.conditioned is None:
                judged.conditioned = _conditioned(func, (cand_args, cand_kwargs), keep, truth, norm)
            judged.location = _where(sys._getframe(), torch_made)
            own.worst = judged


def _conditioned(func: Any, cand: Any, keep: torch.Tensor | slice, truth: torch.Tensor, norm: float) -> float | None:
    """The op in fp64 on its inputs as the candidate held them (rounded to its dtype): the error its
    conditioning alone makes of that rounding, on the sample the op's error was measured on."""
    args, kwargs = map_tensors(cand, lambda t: t.to(torch.float64) if t.is_floating_point() else t)
    try:
        exact = flat_sample(next(floating(func(*args, **kwargs)), None))
    except Exception:  # no fp64 kernel for it here: not measured
        return None
    if exact is None or exact.numel() != truth.numel():
        return None
    return rel_error(exact.cpu()[keep], truth[keep], norm)


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

    def pick(out: torch.Tensor) -> torch.Tensor | None:
        return out.reshape(rows, *inner).index_select(0, index) if out.shape == x.shape else None

    return _Rerun(tuple(new), kwargs, pick, rows=(ROWS, rows))


def _largest(call: Any) -> dict[int, float]:
    """The largest magnitude of each float64 tensor in `call` (NaN where it holds NaN), by id."""
    found = {}
    for t in tensors_in(call):
        if t.dtype == torch.float64 and t.numel():
            # amin and amax: on a transposed weight, aminmax's reduction is 25x slower
            found[id(t)] = float(torch.maximum(-t.detach().amin(), t.detach().amax()))
    return found


def _cast(call: Any, dtype: torch.dtype, device: torch.device | None, big: dict[int, float]) -> tuple[Any, bool]:
    """((args, kwargs) with float64 tensors in `dtype`, the others in their own dtype (the user's
    casts), all on `device`; whether a finite value beyond `dtype`'s range was saturated). `big`:
    _largest() of the same call."""
    limit = torch.finfo(dtype).max
    saturated = False

    def cast(t: torch.Tensor) -> torch.Tensor:
        nonlocal saturated
        if t.dtype != torch.float64:
            return t.to(device=device)
        if big.get(id(t), 0.0) <= limit:  # NaN compares False: then it is looked at closely
            return t.to(device=device, dtype=dtype)
        if bool((torch.isfinite(t) & (t.abs() > limit)).any()):
            saturated = True
            return torch.where(torch.isfinite(t), t.clamp(-limit, limit), t).to(device=device, dtype=dtype)
        return t.to(device=device, dtype=dtype)

    def number(value: Any) -> Any:
        nonlocal saturated
        if isinstance(value, float) and math.isfinite(value) and abs(value) > limit:
            saturated = True
            return math.copysign(limit, value)
        return value

    args, kwargs = call
    args = tuple(number(a) for a in args)
    kwargs = {k: number(v) for k, v in kwargs.items()}
    return (map_tensors(args, cast), map_tensors(kwargs, cast)), saturated


def _made_nonfinite(cand: torch.Tensor, truth: torch.Tensor, limit: float | None) -> bool:
    """Whether the re-run has a non-finite value where the fp64 output is finite (and, with
    saturated inputs, within `limit`): one the op made itself."""
    expected = ~torch.isfinite(truth)
    if limit is not None:
        expected |= truth.abs() > limit
    return bool((~torch.isfinite(cand.to(truth.device)) & ~expected).any())
