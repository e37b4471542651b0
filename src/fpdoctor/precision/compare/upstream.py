"""An op whose error its inputs' precision forces: the lines that make those inputs, and the check.

Some ops amplify what their inputs already lost: cos(x) at x = 16000 moves by the whole of the
rounding of x (0.5 ulp of bf16 there is 32), so the op run exactly on its inputs rounded to the
candidate's dtype is as wrong as the candidate's own run (container_ops measures that:
`conditioned_rel`). Keeping that op in fp32 changes nothing: the values it reads must be made in
fp32. This module finds where they are made and tries it:

  `feeding_lines`   one candidate forward that records which op, at which user line, made each
                    tensor of the container's own ops (references between records, no tensors
                    kept); at the op's call, its inputs are walked back through the container's
                    own ops to where they start (parameters, inputs, integer tensors: exact), and
                    the user lines of that dataflow are the fix's lines.
  `raised_error`    one candidate forward with every op at those lines computed in fp32 (its
                    low-precision inputs and dtype arguments raised) and its results cast back to
                    the candidate's dtype where the rest of the model reads them: the fix as the
                    user writes it ("compute these lines in fp32, cast the result back"), judged
                    end to end against the fp64 output.
  `reader_lines`    one candidate forward that records the lines that read a buffer the cast rounded.
  `input_lines`     one candidate forward that records the lines that made what some modules are
                    passed: a value handed from module to module (a residual stream), which the check
                    keeps in fp32 between them (RaisedLines `carried`).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.engine.raising import ByTensor, RaisedLines
from fpdoctor.precision.candidates import map_tensors
from fpdoctor.precision.compare.noise import ReplayNoise
from fpdoctor.precision.compare.passes import error_under, hooked, stacked
from fpdoctor.preserve import RngState
from fpdoctor.torchprivate import EagerDispatchMode
from fpdoctor.userframes import user_location

# The inputs' rounding alone explains at least this share of an op's error: the op is not the cause.
FORCED = 0.5
WALK = 64  # ops of the walk upstream, at most
WHOLE_NUMEL = 1 << 20  # outputs looked at for whole numbers, at most this large (positions, counts, timesteps)


@dataclass(eq=False)
class _Made:
    """What made one tensor: the op, its user line, the module call it ran in, what it read."""

    op: str
    line: tuple[str, int] | None
    module: str
    inputs: list[_Made] = field(default_factory=list)
    buffer: str | None = None  # a buffer of the model's: no line makes it, the model's cast rounded it
    past_exact: bool = False  # whole numbers past what the dtype holds exactly (positions up to 4096 in bf16)
    whole: bool = False  # whole numbers
    readers: list[_Made] = field(default_factory=list)  # the ops that read it, in the order they ran


class _Producers(EagerDispatchMode):
    """Records the producer of every floating tensor of one forward; at the call of `op` at `line`
    in `module`, walks its inputs back (`found`)."""

    def __init__(
        self, op: str, line: str, module: str, buffers: dict[str, torch.Tensor], through_calls: bool = False
    ) -> None:
        super().__init__()
        self.op, self.line, self.module, self.through_calls = op, line, module, through_calls
        self.made = ByTensor()
        for name, t in buffers.items():  # where a walk can end besides inputs and parameters
            self.made.put(t, _Made("buffer", None, "", buffer=name))
        self.stack: list[str] = []
        self.found: list[_Made] | None = None
        # the rounded buffers the module's own ops read anywhere in its call, before and after the op's:
        # what the op's dataflow misses (a centred table `means - centre` beside `z - centre`)
        self.reads: set[str] = set()
        self.ran: set[tuple[str, int]] = set()  # the user lines whose ops ran in the module's own call

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.stack:
            return out  # outside the forward (compare casting the inputs): what it makes is an input
        module = self.stack[-1]
        read = [m for m in (self.made.get(t) for t in _tensors((args, kwargs))) if m is not None]
        if module == self.module:
            self.reads.update(m.buffer for m in read if m.buffer is not None)
        user = user_location(sys._getframe())
        line = (user[0], user[1]) if user is not None else None
        made = _Made(str(func), line, module, read)
        if module == self.module and line is not None and self.found is None:
            self.ran.add(line)
        for m in read:
            m.readers.append(made)
        if (
            self.found is None and str(func) == self.op and line is not None and f"{line[0]}:{line[1]}" == self.line
            and module == self.module
        ):  # fmt: skip
            self.found = _walk(made, self.through_calls)
            return out
        for t in _tensors(out):
            if t.is_floating_point():
                self.made.put(t, made)  # after the op too: what reads what its walk met (`_whole_readers`)
                if 0 < t.numel() <= WHOLE_NUMEL and not made.whole:
                    made.whole, made.past_exact = _whole(t)
        return out


def _whole(t: torch.Tensor) -> tuple[bool, bool]:
    """(whole numbers, some past what t's dtype holds exactly): one pass, in this one diagnostic run."""
    with torch.no_grad():
        finite = t[torch.isfinite(t)]
        if not finite.numel() or not bool((finite == finite.round()).all()):
            return False, False
        low, high = finite.amin(), finite.amax()
        if bool(((finite == low) | (finite == high)).all()):
            return True, False  # two values (an additive mask of 0 and -10000): nothing between them to round
        return True, float(finite.abs().max()) > 2.0 / torch.finfo(t.dtype).eps


def _whole_readers(walked: list[_Made], target: _Made) -> list[_Made]:
    """Past the target's module (in the callers that passed it its inputs), the whole numbers the
    dtype rounds that the walk met, and every op that reads them, then what those make of them as
    whole numbers, up to the first op that makes something else (count = positions + 1, then
    h.cumsum(1) / count): their other readers must read them in fp32 too, or the cast back rounds
    them again there."""
    start = [m for m in walked if m.module != target.module and m.past_exact]
    seen: list[_Made] = []
    frontier = list(start)
    while frontier and len(seen) < WALK:
        made = frontier.pop()
        for reader in made.readers:
            if reader is target or any(reader is s for s in seen) or any(reader is w for w in walked):
                continue
            seen.append(reader)
            if reader.whole:
                frontier.append(reader)
    return seen


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(value, found.append)
    return found


def _encloses(outer: str, inner: str) -> bool:
    """`outer` is `inner` or one of the modules that call it (the root is "")."""
    return outer in (inner, "") or inner.startswith(outer + ".")


def _walk(target: _Made, through_calls: bool = False) -> list[_Made]:
    """The ops upstream of `target` in its own module call, and in the calls of the modules that
    call it where they made what it was passed (position ids a parent's forward counts in bf16,
    read by a positional module's sin), nearest first, `target` first; a sibling module's output
    is where the walk stops. `through_calls`: that output's last op kept, its line being where the
    module is called (a Linear's ops are at the caller's line): a difference of two large outputs of
    a module needs the module's own ops in fp32 too."""
    seen: list[_Made] = [target]
    frontier = [target]
    while frontier and len(seen) < WALK:
        made = frontier.pop()
        for up in made.inputs:
            if any(up is s for s in seen):
                continue
            if _encloses(up.module, target.module) or up.buffer is not None:
                seen.append(up)
                frontier.append(up)
            elif through_calls and up.line is not None:
                seen.append(up)
    return seen


def feeding_lines(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, op: str, line: str, module: str, rng: RngState,
    device: torch.device | None, noise: ReplayNoise | None, through_calls: bool = False,
) -> tuple[list[tuple[str, int]], list[str], list[str]]:  # fmt: skip
    """The user lines of the dataflow that feeds `op` at `line` in `module`'s own call, the op's
    own line included, in file order, and the buffers it reads that the model's cast rounded to
    `dtype` (their names in the model; parameters too: a learned centring is one), and the others
    the module's own ops read elsewhere in its call; empty when the op was not seen. `through_calls`:
    see `_walk`."""
    held = [*run.named_buffers(), *run.named_parameters()]
    buffers = {name: t for name, t in held if t.dtype == dtype}
    producers = _Producers(op, line, module, buffers, through_calls)
    stacked(producers, run, inputs, dtype, rng=rng, device=device, noise=noise)
    walked = producers.found or []
    lines = {m.line for m in walked if m.line is not None}
    if walked:
        lines |= {m.line for m in _whole_readers(walked, walked[0]) if m.line is not None}
    read = {m.buffer for m in walked if m.buffer is not None}
    return _filled(sorted(lines), producers.ran), sorted(read), sorted(producers.reads - read)


# A line between two of a fix's lines, at most this many lines from both, that ran ops in the same call
# is computed with them: the fix reads "lines 20-23 in fp32", and the check must have run what a user
# then writes (a variance by hand on line 21 between its mean on 20 and their cast back on 22: left out,
# it read the mean cast back to fp16, and the check made NaN of a fix that works).
GAP_LINES = 2


class _Lines(EagerDispatchMode):
    """The user line that made each floating tensor of one forward (a view: the line that took it)."""

    def __init__(self) -> None:
        super().__init__()
        self.made = ByTensor()
        self.on = False  # inside the model's forward: compare's cast of the inputs makes inputs

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        user = user_location(sys._getframe()) if self.on else None
        if user is not None:
            for t in _tensors(out):
                if t.is_floating_point():
                    self.made.put(t, (user[0], user[1]))
        return out


def input_lines(
    run: nn.Module, inputs: Any, dtype: torch.dtype, modules: set[str], *, rng: RngState,
    device: torch.device | None, noise: ReplayNoise | None,
) -> list[tuple[str, int]]:  # fmt: skip
    """The user lines that made the floating tensors the calls of `modules` were passed, in one
    candidate forward: where a value handed from module to module is made (a residual stream,
    `x = x + block(x)` at a caller's line, read by every norm after it)."""
    mode = _Lines()
    found: set[tuple[str, int]] = set()

    def pre(name: str, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        mode.on = True
        if name in modules:
            found.update(line for line in (mode.made.get(t) for t in _tensors((args, kwargs))) if line)

    def post(name: str, index: int, args: Any, output: Any) -> None:
        mode.on = mode.on and name != ""

    with mode:
        hooked(run, inputs, dtype, pre=pre, post=post, rng=rng, device=device, noise=noise)
    return sorted(found)


class _Readers(EagerDispatchMode):
    """The user lines of the ops that read some tensors, or views of them (p = positions[:T], then |p_i - p_j|)."""

    def __init__(self, held: list[torch.Tensor]) -> None:
        super().__init__()
        self.marked = ByTensor()
        for t in held:
            self.marked.put(t, True)
        self.lines: set[tuple[str, int]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(self.marked.get(t) for t in _tensors((args, kwargs))):
            user = user_location(sys._getframe())
            if user is not None:
                self.lines.add((user[0], user[1]))
            if func.is_view:
                for t in _tensors(out):
                    self.marked.put(t, True)
        return out


def reader_lines(
    run: nn.Module, inputs: Any, dtype: torch.dtype, buffers: list[str], *, rng: RngState,
    device: torch.device | None, noise: ReplayNoise | None,
) -> list[tuple[str, int]]:  # fmt: skip
    """The user lines of the ops that read the model's `buffers` (or views of them), in one candidate
    forward: where what the model's cast rounded is computed with."""
    mode = _Readers([run.get_buffer(name) for name in buffers])
    with mode:
        hooked(run, inputs, dtype, pre=None, post=lambda *_: None, rng=rng, device=device, noise=noise)
    return sorted(mode.lines)


def _filled(lines: list[tuple[str, int]], ran: set[tuple[str, int]]) -> list[tuple[str, int]]:
    out = set(lines)
    for (file, a), (other, b) in itertools.pairwise(lines):
        if file == other and 1 < b - a <= GAP_LINES + 1:
            out |= {(file, n) for n in range(a + 1, b) if (file, n) in ran}
    return sorted(out)


def raised_error(
    run: nn.Module, inputs: Any, dtype: torch.dtype, lines: list[tuple[str, int]], *, truth: torch.Tensor,
    norm: float, rng: RngState, device: torch.device | None, noise: ReplayNoise | None,
    buffers: dict[str, torch.Tensor] | None = None, keep: list[torch.Tensor] | None = None,
    inputs_as_given: bool = False, each: Callable[[str, int, Any], None] | None = None, scalars_kept: bool = False,
    carried: list[tuple[str, int]] | None = None, modules: list[str] | None = None, cast_back: bool = True,
) -> float | None:  # fmt: skip
    """The candidate's end-to-end error against the fp64 `truth` with the ops at `lines` in fp32 and
    `buffers` (name in the model -> the user's own values) held in fp32 as the user made them, read
    as they are (as the user's code reads a buffer assigned again in fp32 after the model's cast);
    None when the run fails or nothing was raised. `keep` gets the run's output (its first floating
    tensor), for what it decides. `inputs_as_given`: the inputs in fp32, not rounded to `dtype` first
    (the lines that read them compute in fp32 and cast back; an op elsewhere that reads them fails
    the run). `each(name, index, output)` sees every module's output. `scalars_kept`: a single value
    the lines made is read in fp32 (RaisedLines). `carried`: lines among `lines` whose results pass
    from module to module in fp32; `modules`: the model's modules computed in fp32, returning `dtype`
    (RaisedLines). `cast_back=False`: what the lines make is read in fp32 everywhere (a count or a CDF the
    format would round again), the fix "keep it in fp32"."""
    raised = RaisedLines(
        set(lines), dtype, wide_inputs=inputs_as_given, scalars_kept=scalars_kept, carried=set(carried or []),
        cast_back=cast_back,
        modules=[run.get_submodule(name) for name in modules or []],
    )  # fmt: skip
    raised.held = {name.rpartition(".")[2] for name in buffers or {}}  # what a line reads them by (self.freqs)
    swapped = []
    for name, value in (buffers or {}).items():
        holder, _, attr = name.rpartition(".")
        owner = run.get_submodule(holder)
        current = getattr(owner, attr)
        kept = value.detach().to(device=current.device, dtype=torch.float32, copy=True)
        if isinstance(current, nn.Parameter):  # a parameter's slot takes a Parameter only
            kept = nn.Parameter(kept, requires_grad=False)
        swapped.append((owner, attr, current))
        setattr(owner, attr, kept)  # nn.Module puts a tensor set on a buffer's name in the buffer's slot
        raised.raised += 1  # read as it is, as the user's code reads an fp32 buffer (torch's type promotion)
        if lines:  # the lines' ops read it in fp32 and what they make of it is cast back, as the fix says
            raised.made.put(kept, True)
    try:
        fed = torch.float32 if inputs_as_given else dtype  # what the inputs are cast to before the forward
        return error_under(raised, run, inputs, fed, truth=truth, norm=norm, rng=rng, device=device,
                           noise=noise, keep=keep, each=each)  # fmt: skip
    finally:
        for owner, attr, original in swapped:
            setattr(owner, attr, original)
