"""Running compare's copies of the model: a whole pass with hooks on every module, one module
re-run on the fp64 run's inputs, the input rounding floor, the noise a forward draws itself, and
the running states a forward updates in a loop (found, then tried in float64)."""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fpdoctor.numerics.engine.raising import GETITEM, ByTensor, RaisedLines, RaisedSites, SaturatedCasts, basic_index
from fpdoctor.precision.candidates import cast_inputs, map_tensors, split_inputs
from fpdoctor.precision.compare.noise import RecordNoise, ReplayNoise
from fpdoctor.precision.metrics import (
    Later,
    cosine_of,
    device_sample,
    diff_later,
    dot_later,
    flat_sample,
    floating,
    largest,
    norm_later,
    rel_error,
    relative,
)
from fpdoctor.preserve import RngState
from fpdoctor.torchprivate import EagerDispatchMode
from fpdoctor.userframes import user_frame


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
    fed: Callable[[Any], None] | None = None,
) -> None:
    """Run `run` on `inputs` (cast to `dtype`) with hooks that get (name, call index, ...), from
    RNG state `rng`, and with `noise` replaying the draws the fp64 run made (see noise.py).
    `unwind` runs when the forward ends, raised or not, before `noise` leaves the dispatch stack:
    a mode a pre hook pushed (and a post hook that never ran did not pop) goes first. `fed` gets
    the inputs as cast, before the forward."""
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
    cast = cast_inputs(inputs, dtype, device, copy=True)
    if fed is not None:
        fed(cast)
    args, kwargs = split_inputs(cast)
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
    rounded: Any = None,
    keep: list[torch.Tensor] | None = None,
) -> float | None:
    """The end-to-end error of `run` (the reference, in `dtype`) fed the inputs rounded to the
    candidate's dtype: what rounding the inputs alone costs, which no part kept in fp32 undoes.
    `rounded`: the inputs rounded otherwise (some values kept, input_cause.rounded_but); `keep` gets
    the run's output (its first floating tensor), for what it decides."""
    if rounded is None:
        rounded = cast_inputs(inputs, cand_dtype)
    args, kwargs = split_inputs(cast_inputs(rounded, dtype, copy=True))
    rng.restore()
    if noise is not None:
        noise.position = 0
    try:
        with torch.no_grad(), noise if noise is not None else contextlib.nullcontext():
            output = run(*args, **kwargs)
    except Exception:  # the rounded inputs take another path that fails: no floor to speak of
        return None
    out = flat_sample(output)
    first = next(floating(output), None) if keep is not None else None
    if keep is not None and first is not None:
        keep.append(first.detach())
    if out is None or out.numel() != truth.numel():
        return None
    return rel_error(unmasked(out, truth), truth, norm)


# A model whose output masks entries with -inf (logits a filter set to -inf outside the allowed tokens):
# the fp64 output's sample is kept with 0 at those entries, its mask registered here by the sample, and
# every run's sample is read against it as `unmasked` gives it: the masked entries agree, and an entry
# one run masks and the other keeps adds nothing (the kept sets are judged on their own, decide.kept).
MASKS = ByTensor()


def masked_truth(sample: torch.Tensor) -> torch.Tensor:
    """The fp64 output's sample with its -inf entries 0, the mask registered (MASKS)."""
    mask = torch.isneginf(sample)
    truth = torch.where(mask, 0.0, sample)
    MASKS.put(truth, mask)
    return truth


def unmasked(sample: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """A run's output sample as it is read against `truth`: where the truth's is a masked output's,
    its masked entries and the run's own -inf entries take the truth's values; else as it is."""
    mask = MASKS.get(truth)
    if mask is None or sample.shape != truth.shape:
        return sample
    sample = sample.to(truth.device)
    return torch.where(mask | torch.isneginf(sample), truth, sample)


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
    given: dict[int, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`module` in `dtype` on the fp64 inputs (or just their `rows`): its output's sample (float64, on
    the truth's device) and its largest magnitude (metrics.largest: non-finite when a value is),
    neither read; None when the sample does not match the truth's. `given`: the model's inputs (by
    id of their fp64 copies) fed as given, in their own dtype, as the candidate's forward gets them."""
    if rows is not None:
        first = given.get(id(args[0])) if given and args else None
        out = module(cast_inputs(rows, first or dtype, device), **cast_inputs(kwargs, dtype, device, given=given))
        sample: torch.Tensor | None = out.detach().reshape(-1).double()
    else:
        out = module(*cast_inputs(args, dtype, device, given=given), **cast_inputs(kwargs, dtype, device, given=given))
        sample = device_sample(out)
    if sample is None or sample.numel() != truth.numel():
        return None
    return sample.to(truth.device), largest(out)


def rerun_figures(
    got: tuple[torch.Tensor, torch.Tensor | None], truth: torch.Tensor, norm: Later | float
) -> list[torch.Tensor | Later | float | None]:
    """What `read_rerun` reads of a re-run's sample against the truth's, as device values."""
    sample, biggest = got
    return [biggest, diff_later(sample, truth), norm_later(sample), dot_later(sample, truth), norm]


def read_rerun(
    biggest: float | None, diff: float, a_norm: float, dot: float, norm: float
) -> tuple[float, float | None]:
    """(relative error, cosine) of a re-run from rerun_figures' values, read; inf when it was not finite."""
    if biggest is not None and not math.isfinite(biggest):
        return math.inf, None
    return relative(diff, norm), cosine_of(dot, a_norm, norm)


# A running state (a sum over tokens, a recurrent cell) is the output of an op that the same op,
# at the same source line, reads again on its next call. It is searched for where the end-to-end
# error is far above every module's and op's isolated error (compare's `accumulation`): each
# update alone rounds once, so no isolated re-run sees what thousands of them lose together.
CARRIED_STEPS = 16  # updates in one forward before a chain is called a running state
CARRIED_TRIED = 3  # the longest chains, each tried by a run with that state raised
# Visits of a line in a row that were all updates of a state, after which the line is taken to go on
# so: its later visits are counted without the reads being tested. A loop over 2048 tokens then tests
# its first few dozen steps, and each later call costs the raising alone (benchmarks/README.md, the
# per-token loop).
CARRIED_SETTLED = 32
# ... and a line's visits in a row that updated nothing: far more, for a state that starts later in the loop
# (an average carried from token 40 on) must still be found; one that starts after this many visits is not.
CARRIED_SETTLED_NOT = 256
# Ops whose result is one of their inputs' values (or its sign flipped): a state updated only by
# them (a running max, a mask carried along) holds its values exactly in any format, so raising it
# cannot take an error away and is not tried.
EXACT_OPS = frozenset({"maximum", "minimum", "fmax", "fmin", "max", "min", "clamp", "clamp_min", "clamp_max",
                       "where", "cat", "stack", "clone", "neg", "abs", "relu", "masked_fill", "index_select",
                       "gather"})  # fmt: skip


class _Chains(TorchFunctionMode):
    """Counts, per user source line, the updates of a loop-carried tensor: a call that reads its own
    previous output (s = s + x, one call), or a visit of the line whose calls read what its previous
    visit made last (s = s * decay + x, several on one line). Each line's torch functions are kept:
    raising the state raises them all (engine.raising.RaisedSites). Watched at the level of torch
    functions, as RaisedSites runs them: the search is one forward of a long loop (`carried_states`);
    `states()` reads what it found.

    With `raising` (a RaisedSites of no sites of its own), the same forward is also the check: a
    line is kept in float64 from its first counted update on (its calls before that ran once or twice
    in the candidate's dtype, from a start that is usually exact: zeros plus the first term), unless
    its ops write in place or never round, and every other call reads float64 values back in the
    candidate's dtype. `raised_lines` says which lines were kept so; the run is the check of exactly
    those states where they are the ones `states()` tries (`carried_and_raised`)."""

    def __init__(self, raising: RaisedSites | None = None) -> None:
        super().__init__()
        self.steps: dict[str, int] = {}
        self.module: dict[str, str] = {}
        self.calls: dict[str, dict[int, Any]] = {}  # line -> its functions, in order (by id)
        self.aten: dict[tuple[int, str], list[Any]] = {}  # (id of function, line) -> the aten ops it ran
        self.stack: list[str] = []
        self.last: dict[tuple[int, str], Any] = {}  # (id of function, line) -> weak reference to its last output
        self.last_in: dict[tuple[int, str], str] = {}  # ... and the module call it was made in
        self.at: tuple[int, int] | None = None  # (id of the user's frame, its bytecode offset) of that call
        self.line: str | None = None  # the line of the call seen last, and that call's output
        self.out: Any = None
        self.counted = False  # the current visit of `line` was counted as an update
        self.previous: dict[str, Any] = {}  # line -> weak reference to its last visit's last output
        self._lines: dict[tuple[str, int], str] = {}  # the user's file and line number -> the line's name
        # (id of the calling code, its bytecode offset) -> (the code, the line's name): where the call is the user's
        # own, its line without a walk over the frames (a loop calls from the same few offsets thousands of times)
        self._at: dict[tuple[int, int], tuple[Any, str]] = {}
        self.raising = raising
        self.raised_lines: set[str] = set()  # lines kept in float64 (with `raising`)
        self._kept: set[str] = set()  # lines looked at for raising: raised, or written in place / exact
        self._views: dict[tuple[int, str], bool] = {}  # (id of function, line) -> it runs views only
        # a state carried through two lines: each line's latest output by id (validated by its weak
        # reference), and the line whose output each line read last
        self.owner: dict[int, tuple[Any, str]] = {}
        self.owned: dict[str, int] = {}
        self.fed: dict[str, str] = {}
        # lines that read their own previous output (s = s + f(s)): a line that reads what such a line made
        # reads a state, it does not carry one (f's own line in an Euler step)
        self.direct: set[str] = set()
        self.visits = 0  # visits of lines so far; each function's last output's visit (`made_in`): a read of
        # what the same visit made (a @ b @ c: the second matmul reads the first's) is no state's read
        self.made_in: dict[tuple[int, str], int] = {}
        # the lines whose outputs each line read in its current visit and in its previous one: a carry through
        # two lines reads the same partner in visit after visit (a beam's sum and its topk; a covariance and
        # its update); a stage of an RK4 step reads another each visit (x + dt/2 k1, x + dt/2 k2, ..., then
        # the state): no state of its own is carried
        self.partners: dict[str, set[str]] = {}
        self.partners_before: dict[str, set[str]] = {}
        # a line's visits in a row that were updates (True) or not, and how many; once CARRIED_SETTLED,
        # the line is settled so (`settled`: line -> whether its visits are updates)
        self.streak: dict[str, tuple[bool, int]] = {}
        self.settled: dict[str, bool] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # written out, without helper calls or generators: this runs for every call of a long loop
        raising = self.raising
        if func is GETITEM and type(args[0]) is torch.Tensor and not kwargs and basic_index(args[1]):
            # a view (x[:, t] in a loop over tokens): never a state's update; of an fp64 state, it stays
            # fp64 (ranked[:4] of a sort kept in fp64), as every view here (the op that computes from it
            # rounds it where it is not raised)
            return func(*args)
        caller = sys._getframe(1)  # the user's frame where the call is made in their code, as in a loop
        code = caller.f_code
        at = self._at.get((id(code), caller.f_lasti))
        where: Any = caller  # the user's frame: its bytecode offset tells a new visit of a one-line loop body
        if at is not None and at[0] is code:
            line = at[1]
        else:
            frame = where = user_frame(caller)
            if frame is None:
                if raising is not None:
                    return raising.call(func, args, kwargs or {}, site=False)
                return func(*args, **(kwargs or {}))
            user = (frame.f_code.co_filename, frame.f_lineno)
            named = self._lines.get(user)
            if named is None:
                named = self._lines[user] = f"{user[0]}:{user[1]}"
            line = named
            if frame is caller:  # called from torch's own Python (F.softmax), the user's line is not the caller's
                self._at[(id(code), caller.f_lasti)] = (code, line)
        key = (id(func), line)
        settled = self.settled.get(line)
        if settled is not None and key in self.aten:  # a line settled (CARRIED_SETTLED): no reads tested
            if raising is None or self._views.get(key, False):
                out = func(*args, **(kwargs or {}))
            else:
                out = raising.call(func, args, kwargs or {}, site=line in self.raised_lines)
            kind = type(out)
            if kind is torch.Tensor:
                floating = out.is_floating_point()
            else:
                floating = kind is tuple and any(type(t) is torch.Tensor and t.is_floating_point() for t in out)
            if floating:
                again = self._again(where)
                if line != self.line or again:
                    self._visit(line)
                if settled and not self.counted:
                    self.steps[line] += 1
                    self.counted = True
            return out
        if key in self.aten:
            if raising is None:
                out = func(*args, **(kwargs or {}))
            elif self._views.get(key, False):
                # a view (x.view(-1), ranked[:4] of an fp64 state) is of the value as it is: the op that
                # computes from it rounds it where it is not raised; cast down here, a state kept in
                # fp64 would be rounded before the next line reads it
                out = func(*args, **(kwargs or {}))
            else:
                out = raising.call(func, args, kwargs or {}, site=line in self.raised_lines)
        else:  # a function's first call at a line: the aten ops it runs name it in the finding
            with AtenOps() as ops:
                if raising is None:
                    out = func(*args, **(kwargs or {}))
                else:
                    out = raising.call(func, args, kwargs or {}, site=False)
            self.aten[key] = ops.seen
            self._views[key] = all(op.is_view for op in ops.seen)
        result = out
        if type(out) is not torch.Tensor:  # (values, indices) of a topk or sort: the values carry a state
            out = next((t for t in out if type(t) is torch.Tensor), None) if isinstance(out, tuple) else None
        if out is None or not out.is_floating_point():
            return result
        again = self._again(where)
        if line != self.line or again:
            self._visit(line)
        ref = self.last.get(key)
        held = ref() if ref is not None else None
        # in the same module call: the layers of an nn.Sequential a line calls (each Linear reading the one before's
        # output, one function at one line) carry nothing; a cell called in a loop is the same module each time
        module = self.stack[-1] if self.stack else ""
        reads = held is not None and self.last_in.get(key) == module and _holds(args, held)
        across = reads and self.made_in.get(key) != self.visits  # made by an earlier visit of the line
        if not reads and not self.counted:
            ref = self.previous.get(line)
            held = ref() if ref is not None else None
            reads = across = held is not None and _holds(args, held)
        if line not in self.direct:
            if not across:  # what the line's previous visit made, read by any call of this one (x + dt * k)
                ref = self.previous.get(line)
                before = ref() if ref is not None else None
                across = before is not None and _holds(args, before)
            if across:
                self.direct.add(line)
        if not reads and not self.counted:
            # a state carried through two lines (a beam search's scores: their sum with the step's
            # log-probabilities at one line, its topk at the next): this line reads what another line
            # made last, from what this line made before it
            for a in args:
                if type(a) is torch.Tensor:
                    held = a._base if a._base is not None else a  # a view (scores[:, None]) reads its base
                    made = self.owner.get(id(held))
                    if made is not None and made[1] != line and made[0]() is held:
                        now = self.partners.get(line)
                        if now is None:
                            now = self.partners[line] = set()
                        now.add(made[1])
                        if made[1] in self.direct:  # a state's value read, not a state carried
                            break
                        again = made[1] in self.partners_before.get(line, ())  # read in its previous visit too
                        reads = self.fed.get(made[1]) == line and again
                        self.fed[line] = made[1]
                        break
        calls = self.calls.get(line)  # not setdefault: its default dict would be made on every call
        if calls is None:
            calls = self.calls[line] = {}
        calls[id(func)] = func
        if reads:
            self.steps[line] = self.steps.get(line, 0) + 1
            if line not in self.module:
                self.module[line] = self.stack[-1] if self.stack else ""
            self.counted = True
            if raising is not None and line not in self._kept and self.stack:  # in the model's forward
                self._kept.add(line)
                ops = self.ops(line)
                if not any(op._schema.is_mutable for op in ops) and not _exact(ops):
                    self.raised_lines.add(line)
        self.last[key] = self.out = weakref.ref(out)
        self.last_in[key] = module
        self.made_in[key] = self.visits
        # the line's latest output, by id: what the next line that reads it finds (one entry per line;
        # a view is its base's)
        if out._base is None:
            old = self.owned.get(line)
            if old is not None:
                self.owner.pop(old, None)
            self.owner[id(out)] = (self.out, line)
            self.owned[line] = id(out)
        return result

    def _again(self, frame: Any) -> bool:
        """The same line's frame called again from an offset before its last call's: a loop whose body is
        this one line (h = a[:, t] * h + b[:, t]) started it over, a visit of its own. The frame by id and
        offset: a reference would keep its tensors alive."""
        last, self.at = self.at, (id(frame), frame.f_lasti)
        # strictly before: the layers of an nn.Sequential the line calls all report the line's one offset
        return last is not None and last[0] == self.at[0] and self.at[1] < last[1]

    def _visit(self, line: str) -> None:
        """A visit of `line` begins, so the visit of the line before ends: what it made last is its
        state, and whether that visit was an update moves its streak on."""
        self.visits += 1
        left = self.line
        if left is not None:
            self.partners_before[left] = self.partners.pop(left, set())
        if left is not None and left not in self.settled:
            self.previous[left] = self.out
            counted = self.counted
            streak = self.streak.get(left)
            n = streak[1] + 1 if streak is not None and streak[0] is counted else 1
            if n >= (CARRIED_SETTLED if counted else CARRIED_SETTLED_NOT):
                self.settled[left] = counted
                del self.streak[left]
            else:
                self.streak[left] = (counted, n)
        self.line, self.counted = line, False

    def ops(self, line: str) -> list[Any]:
        """The aten ops the line's calls ran that compute (views left out), each once, in order."""
        seen: dict[int, Any] = {}
        for f in self.calls[line]:
            for op in self.aten[(f, line)]:
                if not op.is_view:
                    seen.setdefault(id(op), op)
        return list(seen.values())

    def states(self) -> list[dict[str, Any]]:
        """The running states found, longest first: their sites (what RaisedSites raises), aten ops,
        source line, the module whose forward updates them, and how many updates one forward makes."""
        found = [(steps, line) for line, steps in self.steps.items() if steps >= CARRIED_STEPS]
        found.sort(key=lambda x: -x[0])
        return [
            {
                # views (k[:, t]) stay as they ran: raising one would raise the whole tensor it views
                "sites": [
                    (f, line) for i, f in self.calls[line].items() if not all(op.is_view for op in self.aten[(i, line)])
                ],
                "op": " then ".join(str(op) for op in self.ops(line)),
                "location": line,
                "module": self.module[line],
                "steps": steps,
                # an in-place update (state += x) writes into the state's own storage, in its dtype
                "in_place": any(op._schema.is_mutable for op in self.ops(line)),
                "exact": _exact(self.ops(line)),
            }
            for steps, line in found[:CARRIED_TRIED]
        ]


class AtenOps(EagerDispatchMode):
    """The aten ops one call runs (entered once per function and line: names for the finding)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _holds(args: Any, held: torch.Tensor) -> bool:
    """Whether `held` is one of the call's arguments (a loop: any() over a generator costs more per call)."""
    for a in args:  # noqa: SIM110
        if a is held:
            return True
    return False


def carried_states(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None,
) -> list[dict[str, Any]]:  # fmt: skip
    """The running states of the candidate's forward, from a forward of its own (_Chains.states)."""
    chains = _Chains()
    stacked(chains, run, inputs, dtype, rng=rng, device=device, noise=noise)
    return chains.states()


def carried_and_raised(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, truth: torch.Tensor, norm: float, rng: RngState,
    device: torch.device | None, noise: ReplayNoise | None, keep: list[torch.Tensor],
) -> tuple[list[dict[str, Any]], set[str], float | None]:  # fmt: skip
    """The running states, from one candidate forward that also keeps each in float64 from its first
    counted update on (_Chains with `raising`): the states, the lines it kept so, and that run's
    end-to-end error against the fp64 `truth` (None where it kept none; `keep` gets its output).
    Where the lines kept are the states `states()` tries, the run is their check, and the search
    and the check are one forward instead of two (a per-token loop's forward is compare's cost)."""
    raising = RaisedSites([], dtype)
    chains = _Chains(raising)
    outputs: list[Any] = []  # the model's output, read after the forward: no call of ours under the mode
    stacked(chains, run, inputs, dtype, rng=rng, device=device, noise=noise, root=outputs.append)
    got: list[torch.Tensor | None] = []
    for output in outputs:
        _root_output(got, keep)(output)
    return chains.states(), chains.raised_lines, _root_error(got, truth, norm, raising.raised)


def _exact(ops: list[Any]) -> bool:
    """Whether a state's update ops all select among their inputs' values (EXACT_OPS): it never rounds."""
    return bool(ops) and all(op.overloadpacket.__name__ in EXACT_OPS for op in ops)


def raised_error(
    run: nn.Module, inputs: Any, dtype: torch.dtype, sites: list[tuple[Any, str]], *, truth: torch.Tensor,
    norm: float, rng: RngState, device: torch.device | None, noise: ReplayNoise | None,
    keep: list[torch.Tensor] | None = None,
) -> float | None:  # fmt: skip
    """The candidate's end-to-end error against the fp64 `truth` with the running states at `sites`
    kept in float64 together (everything else as the candidate runs it); None when that run fails.
    `keep` gets the run's output (its first floating tensor), for what it decides."""
    return error_under(RaisedSites(sites, dtype), run, inputs, dtype, truth=truth, norm=norm, rng=rng,
                       device=device, noise=noise, keep=keep)  # fmt: skip


def error_under(
    raised: RaisedSites | RaisedLines | SaturatedCasts, run: nn.Module, inputs: Any, dtype: torch.dtype, *,
    truth: torch.Tensor,
    norm: float, rng: RngState, device: torch.device | None, noise: ReplayNoise | None,
    keep: list[torch.Tensor] | None = None, watch: Any = None, each: Callable[[str, int, Any], None] | None = None,
    restart: Callable[[], None] | None = None,
) -> float | None:  # fmt: skip
    """The candidate's end-to-end error against the fp64 `truth` with some of its ops raised (an
    engine.raising mode); None when the run fails or the mode raised no op. `keep` gets the run's
    output (its first floating tensor); `watch`, a mode entered inside the raising one, sees the ops
    as the code calls them (selections.Picks); `each(name, index, output)` sees every module's output;
    `restart()` is called before a failed run is run again, so that what `each` gathered of it goes."""
    got: list[torch.Tensor | None] = []
    root = _root_output(got, keep)

    def pre(name: str, index: int, module: nn.Module, args: Any, kwargs: Any) -> None:
        if name == "" and isinstance(raised, RaisedLines):  # the inputs as the model's call gets them
            found: list[torch.Tensor] = []
            map_tensors((args, kwargs), found.append)
            raised.feed(found)

    def post(name: str, index: int, args: Any, output: Any) -> None:
        if each is not None:
            each(name, index, output)
        if name == "":
            root(output)

    kept = len(keep) if keep is not None else 0
    for _ in range(2):
        try:
            with raised, watch if watch is not None else contextlib.nullcontext():
                hooked(run, inputs, dtype, pre=pre, post=post, rng=rng, device=device, noise=noise)
            break
        except Exception:  # e.g. an in-place update that cannot hold float64: not tried
            # or a module fed an fp32 value it widens its own inputs to: again, cast back wherever a module reads it
            # (not under a `watch`, whose record of the failed run's ops would count twice)
            if watch is not None or not isinstance(raised, RaisedLines) or not raised.again_casting_at_entry():
                return None
            got.clear()
            if keep is not None:
                del keep[kept:]
            if restart is not None:
                restart()
    return _root_error(got, truth, norm, raised.raised)


def _root_output(got: list[torch.Tensor | None], keep: list[torch.Tensor] | None) -> Callable[[Any], None]:
    """What a checked run keeps of the model's output: its sample in `got`, its first floating
    tensor in `keep` (for what it decides)."""

    def take(output: Any) -> None:
        got.append(flat_sample(output))
        first = next(floating(output), None) if keep is not None else None
        if keep is not None and first is not None:
            keep.append(first.detach())

    return take


def _root_error(got: list[torch.Tensor | None], truth: torch.Tensor, norm: float, raised: int) -> float | None:
    """A checked run's end-to-end error from its output's sample; None where it raised no op or its
    output is not the truth's size, inf where the output is not finite."""
    out = got[-1] if got else None
    if not raised or out is None or out.numel() != truth.numel():
        return None
    out = unmasked(out, truth)
    return rel_error(out, truth, norm) if bool(torch.isfinite(out).all()) else math.inf


def stacked(
    mode: Any, run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None, root: Callable[[Any], None] | None = None,
) -> None:  # fmt: skip
    """One candidate forward under `mode`, with `mode.stack` holding the names of the module calls in
    progress (innermost last); `root` gets the model's output."""

    def pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        mode.stack.append(name)

    def post(name: str, index: int, args: Any, output: Any) -> None:
        if mode.stack:
            mode.stack.pop()
        if name == "" and root is not None:
            root(output)

    with mode:
        hooked(run, inputs, dtype, pre=pre, post=post, rng=rng, device=device, noise=noise)
