"""Running compare's copies of the model: a whole pass with hooks on every module, one module
re-run on the fp64 run's inputs, the input rounding floor, the noise a forward draws itself, and
the running states a forward updates in a loop (found, then each tried in float64)."""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.engine.raising import RaisedLines, RaisedSites
from fpdoctor.precision.candidates import cast_inputs, split_inputs
from fpdoctor.precision.compare.noise import RecordNoise, ReplayNoise
from fpdoctor.precision.metrics import all_finite, cosine, flat_sample, rel_error
from fpdoctor.preserve import RngState
from fpdoctor.torchprivate import EagerDispatchMode
from fpdoctor.userframes import user_location


def hooked(
    run: nn.Module,
    inputs: Any,
    dtype: torch.dtype,
    *,
    pre: Callable[..., None] | None,
    post: Callable[..., None],
    rng: RngState,
    device: torch.device | None = None,
    noise: ReplayNoise | None = None,
    unwind: Callable[[], None] | None = None,
) -> None:
    """Run `run` on `inputs` (cast to `dtype`) with hooks that get (name, call index, ...), from
    RNG state `rng`, and with `noise` replaying the draws the fp64 run made (see noise.py).
    `unwind` runs when the forward ends, raised or not, before `noise` leaves the dispatch stack:
    a mode a pre hook pushed (and a post hook that never ran did not pop) goes first."""
    calls: dict[str, int] = {}
    handles = []
    for name, module in run.named_modules():
        if pre is not None:

            def on_pre(mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                pre(name, calls.get(name, 0), mod, args, kwargs)

            handles.append(module.register_forward_pre_hook(on_pre, with_kwargs=True))

        def on_post(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
            index = calls.get(name, 0)
            calls[name] = index + 1
            post(name, index, args, output)

        handles.append(module.register_forward_hook(on_post))
    args, kwargs = split_inputs(cast_inputs(inputs, dtype, device, copy=True))
    rng.restore()
    if noise is not None:
        noise.position = 0
    try:
        with torch.no_grad(), noise if noise is not None else contextlib.nullcontext():
            try:
                run(*args, **kwargs)
            finally:
                if unwind is not None:
                    unwind()
    finally:
        for h in handles:
            h.remove()


def input_rounding_error(
    run: nn.Module,
    inputs: Any,
    *,
    cand_dtype: torch.dtype,
    dtype: torch.dtype,
    truth: torch.Tensor,
    norm: float,
    rng: RngState,
    noise: ReplayNoise | None,
) -> float | None:
    """The end-to-end error of `run` (the reference, in `dtype`) fed the inputs rounded to the
    candidate's dtype: what rounding the inputs alone costs, which no part kept in fp32 undoes."""
    args, kwargs = split_inputs(cast_inputs(cast_inputs(inputs, cand_dtype), dtype, copy=True))
    rng.restore()
    if noise is not None:
        noise.position = 0
    try:
        with torch.no_grad(), noise if noise is not None else contextlib.nullcontext():
            out = flat_sample(run(*args, **kwargs))
    except Exception:  # the rounded inputs take another path that fails: no floor to speak of
        return None
    if out is None or out.numel() != truth.numel():
        return None
    return rel_error(out, truth, norm)


def record_noise(run: nn.Module, inputs: Any, rng: RngState) -> list[torch.Tensor]:
    """The random draws a plain fp64 forward makes from RNG state `rng`, in order."""
    recorder = RecordNoise()
    args, kwargs = split_inputs(cast_inputs(inputs, torch.float64, copy=True))
    rng.restore()
    with torch.no_grad(), recorder:
        run(*args, **kwargs)
    return recorder.draws


def rerun(
    module: nn.Module,
    rows: torch.Tensor | None,
    args: Any,
    kwargs: Any,
    *,
    dtype: torch.dtype,
    device: torch.device | None,
    truth: torch.Tensor,
    norm: float,
) -> tuple[float | None, float | None]:
    """`module` in `dtype` on the fp64 inputs (or just their `rows`): (relative error, cosine)."""
    if rows is not None:
        out = module(cast_inputs(rows, dtype, device), **cast_inputs(kwargs, dtype, device))
        sample: torch.Tensor | None = out.detach().reshape(-1).double()
    else:
        out = module(*cast_inputs(args, dtype, device), **cast_inputs(kwargs, dtype, device))
        sample = flat_sample(out)
    if sample is None or sample.numel() != truth.numel():
        return None, None
    if not all_finite(out):
        return math.inf, None
    return rel_error(sample, truth, norm), cosine(sample, truth, norm)


# A running state (a sum over tokens, a recurrent cell) is the output of an op that the same op,
# at the same source line, reads again on its next call. It is searched for where the end-to-end
# error is far above every module's and op's isolated error (compare's `accumulation`): each
# update alone rounds once, so no isolated re-run sees what thousands of them lose together.
CARRIED_STEPS = 16  # updates in one forward before a chain is called a running state
CARRIED_TRIED = 3  # the longest chains, each tried by a run with that state raised


class _Chains(EagerDispatchMode):
    """Counts, per user source line, the updates of a loop-carried tensor: an op that reads its own
    previous output (s = s + x, one op), or a visit of the line whose ops read what its previous
    visit made last (s = s * decay + x, several ops on one line). Each line's ops are kept: raising
    the state raises them all."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: dict[str, int] = {}
        self.module: dict[str, str] = {}
        self.ops: dict[str, dict[int, Any]] = {}  # line -> its ops, in order (by id: an op's __hash__ is Python)
        self.stack: list[str] = []
        self.last: dict[tuple[int, str], Any] = {}  # (id of op, line) -> weak reference to its last output
        self.line: str | None = None  # the line of the op seen last, and that op's output
        self.out: Any = None
        self.counted = False  # the current visit of `line` was counted as an update
        self.previous: dict[str, Any] = {}  # line -> weak reference to its last visit's last output

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.is_view or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        user = user_location(sys._getframe())
        if user is None:
            return out
        line = f"{user[0]}:{user[1]}"
        if line != self.line:  # a visit of the line before ends: what it made last is its state
            if self.line is not None:
                self.previous[self.line] = self.out
            self.line, self.counted = line, False
        read = [a for a in args if isinstance(a, torch.Tensor)]
        own = self.last.get((id(func), line))
        earlier = self.previous.get(line)
        if _reads(read, own) or (not self.counted and _reads(read, earlier)):
            self.steps[line] = self.steps.get(line, 0) + 1
            self.module.setdefault(line, self.stack[-1] if self.stack else "")
            self.counted = True
        self.ops.setdefault(line, {})[id(func)] = func
        self.last[(id(func), line)] = self.out = weakref.ref(out)
        return out


def _reads(args: list[torch.Tensor], ref: Any) -> bool:
    held = ref() if ref is not None else None
    return held is not None and any(a is held for a in args)


def carried_states(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The running states of the candidate's forward, longest first: op, source line, the module
    whose forward updates it, and how many updates one forward makes."""
    chains = _Chains()
    stacked(chains, run, inputs, dtype, rng=rng, device=device, noise=noise)
    found = [(steps, line) for line, steps in chains.steps.items() if steps >= CARRIED_STEPS]
    found.sort(key=lambda x: -x[0])
    return [
        {
            "sites": [(op, line) for op in chains.ops[line].values()],
            "op": " then ".join(str(op) for op in chains.ops[line].values()),
            "location": line,
            "module": chains.module[line],
            "steps": steps,
            # an in-place update (state += x) writes into the state's own storage, in its dtype
            "in_place": any(op._schema.is_mutable for op in chains.ops[line].values()),
        }
        for steps, line in found[:CARRIED_TRIED]
    ]


def raised_error(
    run: nn.Module, inputs: Any, dtype: torch.dtype, sites: list[tuple[Any, str]], *, truth: torch.Tensor,
    norm: float, rng: RngState, device: torch.device | None, noise: ReplayNoise | None,
) -> float | None:  # fmt: skip
    """The candidate's end-to-end error against the fp64 `truth` with the running states at `sites`
    kept in float64 together (everything else as the candidate runs it); None when that run fails."""
    if any(site[0]._schema.is_mutable for site in sites):
        return None  # an in-place update keeps its tensor's dtype: raising it needs the user's code changed
    return error_under(RaisedSites(sites, dtype), run, inputs, dtype, truth=truth, norm=norm, rng=rng,
                       device=device, noise=noise)  # fmt: skip


def error_under(
    raised: RaisedSites | RaisedLines, run: nn.Module, inputs: Any, dtype: torch.dtype, *, truth: torch.Tensor,
    norm: float, rng: RngState, device: torch.device | None, noise: ReplayNoise | None,
) -> float | None:  # fmt: skip
    """The candidate's end-to-end error against the fp64 `truth` with some of its ops raised (an
    engine.raising mode); None when the run fails or the mode raised no op."""
    got: list[torch.Tensor | None] = []

    def post(name: str, index: int, args: Any, output: Any) -> None:
        if name == "":
            got.append(flat_sample(output))

    try:
        with raised:
            hooked(run, inputs, dtype, pre=None, post=post, rng=rng, device=device, noise=noise)
    except Exception:  # e.g. an in-place update that cannot hold float64: not tried
        return None
    out = got[-1] if got else None
    if not raised.raised or out is None or out.numel() != truth.numel():
        return None
    return rel_error(out, truth, norm) if bool(torch.isfinite(out).all()) else math.inf


def stacked(
    mode: Any, run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None,
) -> None:  # fmt: skip
    """One candidate forward under `mode`, with `mode.stack` holding the names of the module calls in
    progress (innermost last)."""

    def pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        mode.stack.append(name)

    def post(name: str, index: int, args: Any, output: Any) -> None:
        if mode.stack:
            mode.stack.pop()

    with mode:
        hooked(run, inputs, dtype, pre=pre, post=post, rng=rng, device=device, noise=noise)
