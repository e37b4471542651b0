"""What an optimizer step did to low-precision weights, measured on a sample of each parameter.

A bf16 weight of magnitude 0.05 sits between neighbours 2^-12 apart; an update below half that gap
is rounded away and the weight does not move at all. Nothing goes NaN: the loss just stops falling.
To see it, each bf16/fp16 trainable parameter gets a fixed random sample of element indices (at most
`SAMPLE`, drawn once from a private generator: the user's RNG is not touched). On a measured step:

- before `optimizer.step()`, the sampled weights, gradients and optimizer state are copied to fp32
  and the same optimizer class with the same hyperparameters steps that copy (a *shadow*): its
  change is the update the step intends, in fp32. Only optimizers whose update is elementwise
  (SGD, Adam, AdamW, ...) can be shadowed on a sample; others are said not to be judged.
- after the step, the sampled weights again: an element bit-identical after the step although its
  intended update was non-zero was *rounded away*. Weight decay is counted apart (`lr*wd*|w|`
  against half the spacing, where the decay is a term of its own: AdamW's decoupled one, SGD's).
- low-precision optimizer state (Adam's exp_avg_sq in bf16) is judged the same way: what the
  shadow's fp32 state became against what the low-precision state became (unchanged although the
  fp32 one moved: stalled; zero although the fp32 one is not: flushed).
- gradients accumulated over micro-batches in a bf16/fp16 `.grad`: a hook on each parameter adds
  every incoming micro-batch gradient, sampled, into an fp32 sum, against the `.grad` the
  low-precision accumulator holds at the end of the window (`GradAccumulation`).

Everything is computed on the device and read back once per measured step (`UpdateSample.read`);
steps are measured every `every`-th optimizer step, so the cost is a fraction of that; with the
default period, after the first PACE_AFTER measured steps, every `paced`-th: a measured step costs a
few small steps' time (~50 small ops, seven gathers a parameter), and its period stretches until
that cost is under SHARE of the steps between. The check's
own work is not the program's (`ours`): it stays out of any dispatch mode (a trace's records), and
its shadow step out of the global optimizer hooks (a trace's step count, `fpdoctor watch`).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.torchprivate import DisableTorchDispatch, named_parameters, snapshot_optimizer_hooks

LOW_PRECISION = (torch.bfloat16, torch.float16)
SAMPLE = 256  # elements per parameter: a share measured on 256 has a standard error under 3.2%
EVERY = 10  # measure every 10th optimizer step (the first one too)
# With that default period, after the first PACE_AFTER measured steps (steps 1, 11 and 21) the
# period stretches, in multiples of EVERY, until a measured step's own cost is under SHARE of the
# steps' time between two (`paced`): on a 1 ms step a ~1.5 ms check is measured every 300th step, on
# a step 100 times its cost every 10th as before. A period given by the front end is kept.
PACE_AFTER = 3
SHARE = 0.005
# optimizers whose update of an element depends on that element's weight, gradient and state only
# (and on scalars): a shadow step on a sample computes exactly what the step does to those elements
ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop", "Adagrad")
# a decay that is a term of its own in the update: decoupled (AdamW's), or SGD's, which adds
# wd*w to the gradient before anything rescales it
_DECOUPLED = ("AdamW", "SGD")
# the numbers per parameter read back, in this order
_COLUMNS = ("intended", "rounded", "decay_considered", "decay_lost", "sq_intended", "sq_actual", "sq_weight", "log2")
# A parameter has lost its updates when half its sampled non-zero updates were rounded away (an
# element moves on at most every other step: the optimizer's direction is no longer followed); the
# finding needs such parameters to hold a quarter of the low-precision weights, so that one small
# tensor near convergence (a bias whose gradient is ~0) does not make it.
ROUNDED_SHARE = 0.5
AFFECTED_SHARE = 0.25
# A low-precision sum 5% off its fp32 twin: bf16's own rounding of a sum is ~0.4% (2^-8); 5% is
# additions lost, not rounding noise.
ACCUMULATED_ERROR = 0.05
# How far past the worst case of rounding n additions ((n - 1) u sum |g_i|) a low-precision sum may
# be and still be rounding: more is a write of the user's code, not the sum's arithmetic.
ROUNDING_ROOM = 4.0
# Half the state elements the fp32 step changes left as they were (or flushed): the state no longer
# follows the gradients.
STALLED_SHARE = 0.5


@contextlib.contextmanager
def no_global_optimizer_hooks() -> Iterator[None]:
    """A step of ours (the shadow's, a what-if's) is not the program's: inside the block torch's global
    optimizer hooks are empty dicts of their own, put back after (torch may be iterating the real
    ones, when the block runs inside one of their hooks: they are swapped, never changed)."""
    from torch.optim import optimizer as optimizer_mod

    with snapshot_optimizer_hooks(optimizer_mod, empty=True):
        yield


@contextlib.contextmanager
def ours() -> Iterator[None]:
    """The check's own tensor work: no gradient, and out of any dispatch mode (a trace records the
    program's ops, not these)."""
    with torch.no_grad(), DisableTorchDispatch():
        yield


def spacing(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gap between neighbouring `dtype` values at |w| (fp32 in, fp32 out): 2^(e-1) * eps for
    |w| in [2^(e-1), 2^e), and the subnormal spacing below the smallest normal.

    Read from w's fp32 bits: its exponent field alone is 2^(e-1), and eps = 2^-k moves it k places
    down; zero, fp32 subnormals and (for fp16) values under its smallest normal come out smaller (or
    negative) and are clamped to the subnormal spacing. Three kernels, where frexp and ldexp took
    eight: bit for bit the same gaps (w finite)."""
    info = torch.finfo(dtype)
    places = round(-math.log2(info.eps)) << 23  # eps = 2^-places, in the exponent field
    exponent = w.float().contiguous().view(torch.int32) & 0x7F800000
    return exponent.sub_(places).view(torch.float32).clamp_(min=info.tiny * info.eps)


def shadowable(optimizer: Any) -> str | None:
    """None when a shadow step on a sample computes what `optimizer` does; else why not."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or name not in ELEMENTWISE:
        return f"{name}'s update is not known to be elementwise, so a sample cannot be stepped on its own"
    return None


@dataclass
class ParamUpdate:
    """One parameter's measured step (host numbers)."""

    name: str
    dtype: str
    numel: int
    sampled: int
    intended: int  # sampled elements whose fp32 update was non-zero
    rounded: int  # of those, bit-identical after the step
    decay_considered: int
    decay_lost: int
    update_rms: float  # the intended update's RMS over the sample
    actual_rms: float  # what the step did to the low-precision weights
    weight_rms: float
    typical_ratio: float  # geometric mean of |intended update| / spacing at the weight

    @property
    def rounded_share(self) -> float:
        return self.rounded / self.intended if self.intended else 0.0

    @property
    def decay_lost_share(self) -> float | None:
        return self.decay_lost / self.decay_considered if self.decay_considered else None

    @property
    def update_to_weight(self) -> float:
        return self.update_rms / self.weight_rms if self.weight_rms else math.inf


@dataclass
class StateUpdate:
    """One low-precision optimizer-state tensor kind (exp_avg_sq) over the sampled parameters."""

    key: str
    dtype: str
    parameters: list[str]
    changed: int  # sampled elements the fp32 shadow changed
    stalled: int  # of those, bit-identical in the low-precision state
    flushed: int  # of those, zero in the low-precision state

    @property
    def lost_share(self) -> float:
        return (self.stalled + self.flushed) / self.changed if self.changed else 0.0


@dataclass
class UpdateStats:
    """One measured optimizer step, or why none could be measured (`why_not`)."""

    step: int
    optimizer: str
    params: list[ParamUpdate] = field(default_factory=list)
    states: list[StateUpdate] = field(default_factory=list)
    hyper: dict[str, Any] = field(default_factory=dict)  # lr, weight_decay of the first group
    # gradients accumulated over micro-batches: (parameter, dtype, additions, relative error, low/fp32 norm)
    grads: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    why_not: str | None = None
    paced: int | None = None  # the period from here on, where this step's measured cost stretched it (`paced`)


def rounded_away(stats: UpdateStats) -> list[ParamUpdate]:
    """The parameters that lost their updates, most weights lost first, when they hold enough of the weights."""
    lost = [p for p in stats.params if p.rounded_share >= ROUNDED_SHARE]
    total = sum(p.numel for p in stats.params)
    if not lost or sum(p.numel for p in lost) < AFFECTED_SHARE * total:
        return []
    return sorted(lost, key=lambda p: -p.rounded_share * p.numel)  # the most weights that stopped first


def stalled_states(stats: UpdateStats) -> list[StateUpdate]:
    return [s for s in stats.states if s.changed and s.lost_share >= STALLED_SHARE]


def stalled_grads(stats: UpdateStats) -> list[tuple[str, str, int, float, float]]:
    return sorted((g for g in stats.grads if g[3] >= ACCUMULATED_ERROR), key=lambda g: -g[3])


@dataclass
class UpdateSummary:
    """What the run's measured steps judged, for the report's line (an OK says what it covered)."""

    steps: int = 0
    every: int = EVERY
    params: int = 0
    dtypes: set[str] = field(default_factory=set)
    worst: float = 0.0
    worst_name: str | None = None
    why_not: str | None = None
    paced: int | None = None  # the period the last measured step's cost set (`paced`), where it was longer

    def add(self, stats: UpdateStats) -> None:
        if stats.why_not is not None:
            self.why_not = stats.why_not
            return
        if stats.paced is not None:
            self.paced = stats.paced
        if not stats.params:  # a window's gradients alone: no update was measured
            return
        self.steps += 1
        self.params = max(self.params, len(stats.params))
        self.dtypes.update(p.dtype for p in stats.params)
        total = sum(p.numel for p in stats.params)
        share = sum(p.rounded_share * p.numel for p in stats.params) / total if total else 0.0
        if share >= self.worst:  # weighted by size: a one-element bias does not speak for the model
            self.worst, self.worst_name = share, f"step {stats.step}"

    def text(self) -> str:
        if not self.steps:
            return f"not judged: {self.why_not}" if self.why_not else "not judged yet: no optimizer step measured"
        dtypes = "/".join(sorted(self.dtypes))
        every = f"every {self.every}th"
        if self.paced is not None and self.paced > self.every:
            every += (
                f" for the first {PACE_AFTER}, then every {self.paced}th: a measured step's cost kept under "
                f"{SHARE:.1%} of the steps' time"
            )
        return (
            f"judged on {self.steps} step(s) ({every}, {SAMPLE} sampled elements per parameter): "
            f"{self.params} {dtypes} parameter(s), at most {self.worst:.0%} of the weights' updates rounded away "
            f"({self.worst_name}, weighted by parameter size)"
        )


@dataclass
class _StateSample:
    """One low-precision optimizer-state key over one bucket's parameters, before and after the shadow."""

    key: str
    members: list[int]  # indices into the probe's parameters
    low_before: torch.Tensor  # the state's sampled elements, in its own dtype
    shadow_before: torch.Tensor  # the same in fp32
    shadow_after: torch.Tensor  # the fp32 shadow's state after its step (updated in place)


@dataclass
class UpdateSample:
    """What `UpdateProbe.before` took, device tensors: the after-step gathers complete it."""

    step: int
    tracked: list[int]  # indices into the probe's parameters, in the order of the elements below
    before: torch.Tensor  # sampled weights, fp32, concatenated
    intended: torch.Tensor  # the shadow's update, fp32
    decay: torch.Tensor  # lr*wd*|w| where the decay is a term of its own, else NaN
    segment: torch.Tensor  # which tracked parameter each element belongs to
    gap: torch.Tensor  # the dtype's spacing at each sampled weight
    states: list[_StateSample]
    stats: torch.Tensor | None = None
    state_stats: torch.Tensor | None = None


class UpdateProbe:
    """Measures optimizer steps on the sampled elements of the low-precision trainable parameters.

    `model`: the module whose parameters are named, or the (name, parameter) pairs themselves (a
    front end that knows no model, `trace`).

    The cost is per-parameter Python, so a measured step does the least per parameter: one gather
    (`torch.take`) of its weight, gradient and each state tensor. Everything else runs on flat
    buffers: the parameters that step alike (same param group, dtype and optimizer-state layout,
    usually all of them) form one *bucket*, whose sampled elements are one fp32 tensor stepped by
    one shadow optimizer; the update is elementwise, so each element gets the arithmetic it would get
    in its own parameter."""

    def __init__(
        self,
        model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
        optimizer: torch.optim.Optimizer,
        *,
        sample: int = SAMPLE,
        every: int = EVERY,
        seed: int = 0,
    ) -> None:
        if sample < 1 or every < 1:
            raise ValueError("sample and every must be >= 1")
        self.optimizer = optimizer
        self.every = every
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        pairs = named_parameters(model) if isinstance(model, torch.nn.Module) else model
        named = [
            (name, p)
            for name, p in pairs
            if p.requires_grad and p.dtype in LOW_PRECISION and p.numel() and id(p) in in_optimizer
        ]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        gen = torch.Generator().manual_seed(seed)  # a private generator: the user's RNG stays as it was
        with ours():
            self.index = self._sample_indices(gen, sample)
        self.why_not = shadowable(optimizer) if self.params else None
        self.measured = 0
        # the pace (`paced`): the first step measured again where the period was stretched, the check's
        # own seconds on the measured step in progress and since the last one began, the steps' time
        self._next: int | None = None
        self._cost = 0.0
        self._spent = 0.0
        self._last: tuple[int, float] | None = None  # (step, perf_counter) when the last measured step began
        self._step_times: deque[float] = deque(maxlen=64)
        self._costs: deque[float] = deque(maxlen=8)  # the last measured steps' own seconds
        self._segment_of: tuple[tuple[int, ...], torch.Tensor] | None = None

    def _sample_indices(self, gen: torch.Generator, sample: int) -> list[torch.Tensor]:
        """`sample` distinct element indices per parameter (all of a smaller one), stratified: one at
        a random place in each of `sample` equal stretches of the flattened tensor, so that every
        part of it is seen. One draw for all parameters: a `randperm` of each cost more than the
        steps a short trace measures."""
        sizes = torch.tensor([p.numel() for p in self.params], dtype=torch.float64)
        edges = (torch.arange(sample + 1, dtype=torch.float64) * sizes[:, None] / sample).floor()
        start, width = edges[:, :-1], edges[:, 1:] - edges[:, :-1]  # width >= 1 where numel >= sample
        drawn = start + (torch.rand(start.shape, generator=gen, dtype=torch.float64) * width).floor()
        return [
            (row.long() if p.numel() >= sample else torch.arange(p.numel())).to(p.device)
            for p, row in zip(self.params, drawn, strict=True)
        ]

    @property
    def low_precision(self) -> bool:
        return bool(self.params)

    def due(self, step: int) -> bool:
        """Whether `step` is measured: every `every`-th (the first too), from the paced step on where
        the pace stretched the period (front ends ask ahead, for a window's gradients: no side effects)."""
        if not self.low_precision or self.why_not is not None:
            return False
        return (step - 1) % self.every == 0 and (self._next is None or step >= self._next)

    def _clock(self, step: int, now: float) -> None:
        """At a measured step: the time of the steps since the last one, less the check's own work."""
        last = self._last
        if last is not None and step > last[0]:
            self._step_times.append(max(now - last[1] - self._spent, 0.0) / (step - last[0]))
        self._last, self._spent = (step, now), 0.0

    def _took(self, started: float) -> None:
        spent = time.perf_counter() - started
        self._cost += spent
        self._spent += spent

    def _pace(self, step: int) -> int | None:
        """After a measured step: the period from here on, where its cost stretched the default one."""
        self._costs.append(self._cost)
        if self.every != EVERY or self.measured < PACE_AFTER or not self._step_times:
            return None
        # medians: one measured step slowed by another process does not set the period alone
        gap = paced(self.every, statistics.median(self._costs), statistics.median(self._step_times))
        self._next = step + gap
        return gap if gap > self.every else None

    def _gather(self, tensors: Iterable[torch.Tensor], members: list[int]) -> torch.Tensor:
        """The sampled elements of each member's tensor (shaped like its parameter), concatenated."""
        return torch.cat([torch.take(t, self.index[i]) for t, i in zip(tensors, members, strict=True)])

    def _buckets(self, tracked: list[int]) -> list[tuple[dict[str, Any], list[int], list[str], dict[str, Any]]]:
        """The tracked parameters that step alike: (param group, members, the keys of their per-element
        state, their other state entries). Alike: same group, dtype, device, per-element state keys and
        dtypes, and equal other entries (Adam's `step`)."""
        opt = self.optimizer
        group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
        layouts = []
        host: list[torch.Tensor] = []  # scalar state (Adam's `step`): read together, once, not one .item() each
        for i in tracked:  # one pass over each parameter's state: this loop is the probe's per-parameter Python
            p = self.params[i]
            shape = p.shape
            elementwise: list[tuple[str, torch.dtype]] = []
            other: dict[str, Any] = {}
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    if v.shape == shape:
                        elementwise.append((k, v.dtype))
                        continue
                    if v.numel() == 1:
                        host.append(v)
                other[k] = v
            layouts.append((p, tuple(elementwise), other))
        values = _read_scalars(host)
        buckets: dict[Any, tuple[dict[str, Any], list[int], list[str], dict[str, Any]]] = {}
        for i, (p, per_element, other) in zip(tracked, layouts, strict=True):
            group = group_of[id(p)]
            # a 0-dim parameter's `step` has its shape: told from its per-element state by nothing, so
            # it steps alone (as a one-element tensor, its state too)
            alone = i if p.dim() == 0 else None
            signature = tuple((k, _signature(v, values)) for k, v in other.items())
            key = (id(group), p.dtype, p.device, alone, per_element, signature)
            buckets.setdefault(key, (group, [], [k for k, _ in per_element], other))[1].append(i)
        return list(buckets.values())

    # -- before the step -------------------------------------------------------------------------
    def before(self, step: int) -> UpdateSample | None:
        """Gather the sample and step the fp32 shadow; None when no parameter has a gradient."""
        started = time.perf_counter()
        self._clock(step, started)
        self._cost = 0.0
        try:
            return self._before(step)
        finally:
            self._took(started)

    def _before(self, step: int) -> UpdateSample | None:
        opt = self.optimizer
        tracked = [i for i, p in enumerate(self.params) if p.grad is not None and not p.grad.is_sparse]
        if not tracked:
            return None
        with ours():
            order: list[int] = []
            shadows, befores, decays, gaps, groups = [], [], [], [], []
            states: list[_StateSample] = []
            shadow_state: list[dict[str, Any]] = []
            for group, members, keys, other in self._buckets(tracked):
                params = [self.params[i] for i in members]
                w = self._gather(params, members).float()
                shadow = w.clone().requires_grad_(True)
                shadow.grad = self._gather([p.grad for p in params], members).float()  # type: ignore[misc]
                copied = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in other.items()}
                for key in keys:
                    low = self._gather([opt.state[p][key] for p in params], members)
                    copied[key] = low.float()
                    if low.dtype in LOW_PRECISION:
                        states.append(_StateSample(key, members, low, copied[key].clone(), copied[key]))
                order += members
                shadows.append(shadow)
                shadow_state.append(copied)
                groups.append((group, [shadow]))
                befores.append(w)
                decays.append(_decay(opt, group, w))
                gaps.append(spacing(w, params[0].dtype))
            shadow_opt = _shadow_optimizer(opt, groups)
            for shadow, copied in zip(shadows, shadow_state, strict=True):
                if copied:
                    shadow_opt.state[shadow] = copied
            before = torch.cat(befores)
            with no_global_optimizer_hooks():
                shadow_opt.step()
            intended = torch.cat([s.detach() for s in shadows]) - before
            return UpdateSample(
                step, order, before, intended, torch.cat(decays), self._segment(order), torch.cat(gaps), states
            )

    def _segment(self, order: list[int]) -> torch.Tensor:
        """Which entry of `order` each concatenated sampled element belongs to (the last one kept:
        the same parameters usually step in the same order)."""
        key = tuple(order)
        if self._segment_of is None or self._segment_of[0] != key:
            counts = torch.tensor([len(self.index[i]) for i in order])
            segment = torch.repeat_interleave(torch.arange(len(order)), counts)
            self._segment_of = (key, segment.to(self.index[order[0]].device))
        return self._segment_of[1]

    # -- after the step --------------------------------------------------------------------------
    def after(self, sample: UpdateSample) -> None:
        """Gather the sampled weights after the step and reduce everything on the device."""
        started = time.perf_counter()
        try:
            self._after(sample)
        finally:
            self._took(started)

    def _after(self, sample: UpdateSample) -> None:
        with ours():
            after = self._gather([self.params[i] for i in sample.tracked], sample.tracked).float()
            before, intended = sample.before, sample.intended
            gap = sample.gap
            nonzero = intended != 0
            rounded = nonzero & (after == before)
            decay_ok = ~torch.isnan(sample.decay)
            decay_lost = decay_ok & (sample.decay < gap / 2)
            actual = after - before
            ratio = (intended.abs() / gap).clamp(min=1e-30).log2().where(nonzero, torch.zeros_like(gap))
            columns = torch.stack(
                [nonzero, rounded, decay_ok, decay_lost, intended**2, actual**2, before**2, ratio], dim=1
            ).double()
            stats = torch.zeros(len(sample.tracked), len(_COLUMNS), dtype=torch.float64, device=columns.device)
            stats.index_add_(0, sample.segment, columns)
            sample.stats = stats
            if sample.states:
                rows = []
                state = self.optimizer.state
                for s in sample.states:
                    low_after = self._gather([state[self.params[i]][s.key] for i in s.members], s.members)
                    changed = s.shadow_after != s.shadow_before
                    kept = changed & (low_after == s.low_before)
                    flushed = changed & (low_after == 0) & (s.low_before != 0)
                    rows.append(torch.stack([changed, kept, flushed]).sum(dim=1))
                sample.state_stats = torch.stack(rows).double()

    def read(self, sample: UpdateSample) -> UpdateStats:
        """The host numbers of a measured step: one read back; then the pace of the next."""
        started = time.perf_counter()
        try:
            stats = self._read(sample)
        finally:
            self._took(started)
        stats.paced = self._pace(sample.step)
        return stats

    def _read(self, sample: UpdateSample) -> UpdateStats:
        assert sample.stats is not None
        parts = [sample.stats.flatten()] + ([] if sample.state_stats is None else [sample.state_stats.flatten()])
        with ours():
            values = torch.cat(parts).tolist()
        width = len(_COLUMNS)
        params = []
        for seg, i in enumerate(sample.tracked):
            row = dict(zip(_COLUMNS, values[seg * width : (seg + 1) * width], strict=True))
            n = len(self.index[i])
            params.append(
                ParamUpdate(
                    name=self.names[i],
                    dtype=str(self.params[i].dtype).removeprefix("torch."),
                    numel=self.params[i].numel(),
                    sampled=n,
                    intended=int(row["intended"]),
                    rounded=int(row["rounded"]),
                    decay_considered=int(row["decay_considered"]),
                    decay_lost=int(row["decay_lost"]),
                    update_rms=math.sqrt(row["sq_intended"] / n),
                    actual_rms=math.sqrt(row["sq_actual"] / n),
                    weight_rms=math.sqrt(row["sq_weight"] / n),
                    typical_ratio=2 ** (row["log2"] / row["intended"]) if row["intended"] else 0.0,
                )
            )
        states: dict[str, StateUpdate] = {}
        offset = len(sample.tracked) * width
        for r, s in enumerate(sample.states):
            changed, stalled, flushed = values[offset + 3 * r : offset + 3 * r + 3]
            dtype = str(s.low_before.dtype).removeprefix("torch.")
            state = states.setdefault(s.key, StateUpdate(s.key, dtype, [], 0, 0, 0))
            state.parameters += [self.names[i] for i in s.members]
            state.changed += int(changed)
            state.stalled += int(stalled)
            state.flushed += int(flushed)
        self.measured += 1
        group = self.optimizer.param_groups[0]
        hyper: dict[str, Any] = {k: _plain(group[k]) for k in ("lr", "weight_decay") if k in group}
        return UpdateStats(sample.step, type(self.optimizer).__name__, params, list(states.values()), hyper)

    def measure(self, step: int, run_step: Callable[[], Any]) -> UpdateStats | None:
        """before, `run_step()` (the optimizer's step), after, read: for a front end that steps on the host."""
        sample = self.before(step)
        result = run_step()
        if sample is None:
            return None
        self.after(sample)
        del result
        return self.read(sample)


def paced(every: int, cost: float, step_time: float) -> int:
    """The period after a measured step that cost `cost` seconds, with steps of `step_time`: `every`,
    or the least multiple of it that keeps the cost under SHARE of the steps between."""
    if cost <= 0 or step_time <= 0:
        return every
    return every * max(1, math.ceil(cost / (SHARE * step_time) / every))


def _read_scalars(tensors: list[torch.Tensor]) -> dict[int, float]:
    """The values of one-element state tensors (Adam's `step` of each parameter), by id: one stack
    and one read per device and dtype (the values exact, as `.item()` gives them), not one read
    back per parameter."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    values: dict[int, float] = {}
    for group in by_kind.values():
        read = torch.stack([t if t.dim() == 0 else t.reshape(()) for t in group]).tolist()  # under no_grad
        values.update(zip(map(id, group), read, strict=True))
    return values


def _signature(value: Any, on_device: dict[int, float]) -> Any:
    """A state entry that is not per-element, as something hashable: equal entries step alike."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return ("tensor", id(value))  # not known to be equal to another's: a bucket of its own
        number = on_device[id(value)] if id(value) in on_device else value.item()
        return ("scalar", value.dtype, number)
    try:
        hash(value)
    except TypeError:
        return ("object", id(value))
    return value


def _plain(value: Any) -> Any:
    return float(value) if isinstance(value, torch.Tensor) else value


def _decay(opt: Any, group: dict[str, Any], w: torch.Tensor) -> torch.Tensor:
    """lr*wd*|w| where the decay is a term of its own in the update, else NaN (not counted)."""
    wd = float(group.get("weight_decay") or 0.0)
    decoupled = type(opt).__name__ in _DECOUPLED or bool(group.get("decoupled_weight_decay"))
    if not wd or not decoupled:
        return torch.full_like(w, math.nan)
    return float(group["lr"]) * wd * w.abs()


def _shadow_optimizer(opt: Any, groups: Iterable[tuple[dict[str, Any], list[torch.Tensor]]]) -> Any:
    """The same optimizer class and hyperparameters over the fp32 sample (single-tensor or foreach
    path: a fused kernel may not take the sample's device)."""
    param_groups = []
    for group, params in groups:
        settings = {k: v for k, v in group.items() if k not in ("params", "fused", "foreach", "capturable")}
        param_groups.append({**settings, "params": params})
    return type(opt)(param_groups)


class GradAccumulation:
    """Micro-batch gradients summed in fp32 on the sample, against what the low-precision `.grad` holds.

    `start()` hooks every low-precision parameter (the hook only reads the incoming gradient and
    returns None: the gradient is unchanged); `finish()` removes the hooks and reduces."""

    def __init__(self, probe: UpdateProbe) -> None:
        self.probe = probe
        self._handles: list[Any] = []
        self._sums: dict[int, torch.Tensor] = {}
        self._adds: dict[int, int] = {}
        self._sizes: dict[int, torch.Tensor] = {}  # the sum of |micro-batch gradient|: what rounding can lose

    def start(self) -> None:
        self.stop()
        self._sums, self._adds, self._sizes = {}, {}, {}
        for i, p in enumerate(self.probe.params):
            self._handles.append(p.register_hook(self._adder(i, p)))

    def _adder(self, i: int, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        idx = self.probe.index[i]

        def add(grad: torch.Tensor) -> None:
            try:
                with ours():
                    part = torch.take(grad, idx)
                    total = self._sums.get(i)
                    # what .grad already holds is where the sum starts; a .grad set to None since
                    # (zero_grad of a step the window did not see end, a skipped one) starts it afresh
                    if total is None or p.grad is None:
                        held = p.grad
                        total = part.float() if held is None else torch.take(held, idx).float().add_(part)
                        self._sums[i], self._adds[i] = total, 1
                        self._sizes[i] = total.abs()
                    else:
                        total.add_(part)
                        self._adds[i] += 1
                        self._sizes[i].add_(part.abs())
            except Exception:  # the observer never raises into backward; the window is not judged
                self._sums.pop(i, None)

        return add

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def finish(self) -> list[tuple[str, str, int, float, float]] | None:
        """(parameter, dtype, additions, |fp32 sum - low-precision sum| / |fp32 sum|, |low| / |fp32|) per
        parameter summed over more than one micro-batch; one read back. None: nothing to judge.

        What the backward handed in, summed, is compared with what .grad holds at the step: code that
        wrote .grad between them (`p.grad /= accum` after a loss already divided by accum, a scaling)
        shows as one factor on every parameter, which rounding never makes, so such a window is not
        judged (an empty list): that is no stall. So is a parameter further off than rounding its
        additions can make ((n - 1) u sum |g_i|, with room ROUNDING_ROOM)."""
        self.stop()
        rows, meta = [], []
        with ours():
            for i, total in self._sums.items():
                p = self.probe.params[i]
                if p.grad is None or self._adds.get(i, 0) < 2:
                    continue
                held = torch.take(p.grad, self.probe.index[i]).double()
                exact = total.double()
                rows.append(torch.stack([(exact - held).norm(), exact.norm(), held.norm(), self._sizes[i].norm(),
                                         (exact * held).sum()]))  # fmt: skip
                unit = torch.finfo(p.dtype).eps / 2
                meta.append((self.probe.names[i], str(p.dtype).removeprefix("torch."), self._adds[i], unit))
        self._sums, self._sizes = {}, {}
        if not rows:
            return None
        with ours():
            values = torch.stack(rows).tolist()
        # the most that rounding the additions can move a sum that does not cancel
        reach = max(ROUNDING_ROOM * (adds - 1) * unit for _, _, adds, unit in meta)
        if _scaled([(dot / norm**2 if norm else 1.0) for _, norm, _, _, dot in values], reach):
            return []
        return [
            (name, dtype, adds, err / norm if norm else 0.0, held / norm if norm else 1.0)
            for (name, dtype, adds, unit), (err, norm, held, size, _) in zip(meta, values, strict=True)
            if err <= ROUNDING_ROOM * (adds - 1) * unit * size + 1e-300
        ]


def _scaled(factors: list[float], reach: float) -> bool:
    """Whether every parameter's .grad is its summed gradients times one factor (within
    ACCUMULATED_ERROR, the sum's own rounding) further from 1 than rounding the additions can reach
    (`reach`): a write of the code's. A sum that stalls over many additions is not one: there
    rounding reaches that far."""
    if len(factors) < 2:
        return False
    mid = sorted(factors)[len(factors) // 2]
    return abs(mid - 1.0) > reach and all(abs(f - mid) <= ACCUMULATED_ERROR * abs(mid) for f in factors)
