"""The recurrence a line belongs to: the source lines that carry a value from one step of a loop to
the next, through that line.

A filter's covariance is made at one line (P = F P F^T + Q), read by the lines that make the gain
(S = H P H^T + R, K = P H^T S^-1) and updated at another (P = (I - K H) P), which the first reads on
the next step. An fp32 error that shows at the gain is made by the whole cycle over the steps: no
line of it alone in fp64 takes it away, and keeping the state alone in fp64 does not either, as the
lines that read it round it again. The cycle is found from one candidate forward that records which
line made each value a call reads (`_Flow`): the lines reachable from the line that shows the error
and from which it is reached again. Kept in fp64 together from the first step, what they carry
stays fp64; every line outside reads it cast back (engine.raising.RaisedSites), as the user's fix
would cast it back (`Recurrence.readers`: where)."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fpdoctor.numerics.engine.raising import GETITEM, basic_index
from fpdoctor.precision.compare.noise import ReplayNoise
from fpdoctor.precision.compare.passes import AtenOps, stacked
from fpdoctor.preserve import RngState
from fpdoctor.pytrees import tensors_in
from fpdoctor.userframes import user_frame

# A cycle of more lines than this is most of a forward, not a state's update: no fix of a few lines.
MOST_LINES = 12


@dataclass(frozen=True)
class Recurrence:
    """The lines of the cycles a line is on or reads from (file:line, in source order), grouped by
    cycle (`groups`: the line's own first, where it is on one), the torch functions each line calls
    (`calls`: (function, line, it runs views only)) and the edges between lines seen, from which
    `sites`, `views` and `readers` are read for any subset of the groups (`without`)."""

    groups: list[list[str]]
    calls: list[tuple[Any, str, bool]]
    edges: frozenset[tuple[str, str]]
    # lines outside the cycles that make what they read, kept in fp64 with them where the cycles alone are not
    # enough (compare's check fills it)
    fed: list[tuple[str, int]] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return sorted((at for group in self.groups for at in group), key=_order)

    @property
    def sites(self) -> list[tuple[Any, str]]:
        """What RaisedSites raises: the lines' calls that compute."""
        inside = set(self.lines)
        return [(f, at) for f, at, view in self.calls if at in inside and not view]

    @property
    def views(self) -> list[tuple[Any, str]]:
        """The lines' calls that only view (run as they are: of an fp64 value, fp64)."""
        inside = set(self.lines)
        return [(f, at) for f, at, view in self.calls if at in inside and view]

    @property
    def readers(self) -> list[str]:
        """The lines outside that read what the lines make: given it cast back to fp32."""
        inside = set(self.lines)
        return sorted({b for a, b in self.edges if a in inside and b not in inside}, key=_order)

    @property
    def feeders(self) -> list[tuple[str, int]]:
        """The lines outside that make what the lines read, and the lines that make what those read, back
        to the inputs: a filter's coefficients made once before its loop."""
        inside = set(self.lines)
        back = _adjacency((b, a) for a, b in self.edges)
        found: set[str] = set()
        for at in inside:
            found |= _reach(at, back)
        return sorted((_order(at) for at in found - inside), key=lambda x: x)

    def without(self, group: list[str]) -> Recurrence:
        return Recurrence([g for g in self.groups if g is not group], self.calls, self.edges, self.fed)


class _Flow(TorchFunctionMode):
    """Which user line made what each call reads: an edge (maker, reader) per pair seen, where a
    line's read of its own output counts only across visits (s = s + x), not within one (a @ b @ c
    reads its own first product)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []  # module calls in progress (passes.stacked)
        self.maker: dict[int, tuple[weakref.ref[torch.Tensor], str, int]] = {}  # id -> (ref, line, visit)
        self.edges: set[tuple[str, str]] = set()
        self.calls: dict[str, dict[int, Any]] = {}  # line -> its functions (by id)
        self.views: dict[tuple[int, str], bool] = {}  # (id of function, line) -> it runs views only
        self.line: str | None = None
        self.visit = 0
        # the call sites (function, line, bytecode offset) of the current visit: one called again is the line's
        # next visit (a loop whose body is one line, s = s + x[:, t], never leaves it)
        self.seen: set[tuple[int, str, int]] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        # outside the model's call (compare casting its inputs, at the line that called compare): not the model's
        frame = user_frame(sys._getframe(1)) if self.stack else None
        if frame is None:
            return func(*args, **kwargs)
        line = f"{frame.f_code.co_filename}:{frame.f_lineno}"
        site = (id(func), line, frame.f_lasti)
        if line != self.line or site in self.seen:
            self.line, self.visit = line, self.visit + 1
            self.seen.clear()
        self.seen.add(site)
        key = (id(func), line)
        self.calls.setdefault(line, {})[id(func)] = func
        if func is GETITEM and type(args[0]) is torch.Tensor and not kwargs and basic_index(args[1]):
            self.views[key] = True  # a view (x[:, t]): what it reads is its base's, made where the base was
            return func(*args)
        if key not in self.views:
            with AtenOps() as ops:
                out = func(*args, **kwargs)
            self.views[key] = all(op.is_view for op in ops.seen)
        else:
            out = func(*args, **kwargs)
        if self.views[key]:  # a view, or a no-op (.to its own dtype): what reads it reads its base; x.shape reads none
            return out
        for t in _tensors((*args, *kwargs.values())):
            made = self.maker.get(id(t))
            if made is None and t._base is not None:
                made = self.maker.get(id(t._base))
            if made is not None and made[0]() is not None and (made[1] != line or made[2] != self.visit):
                self.edges.add((made[1], line))
        for t in _tensors(out if isinstance(out, (tuple, list)) else (out,)):
            if t.is_floating_point():
                self.maker[id(t)] = (weakref.ref(t, self._drop(id(t))), line, self.visit)
        return out

    def _drop(self, key: int) -> Any:
        def drop(ref: weakref.ref[torch.Tensor]) -> None:
            made = self.maker.get(key)
            if made is not None and made[0] is ref:
                del self.maker[key]

        return drop

    def cycle(self, line: str) -> Recurrence | None:
        """The cycles that `line` is on or reads from: each line it is reached from (or itself) that is
        reached from itself again, grouped by cycle. A gain read from a covariance's recurrence, itself
        on the estimate's: both recurrences, for the estimate's error is made in the covariance's."""
        back, forward = _adjacency((b, a) for a, b in self.edges), _adjacency(self.edges)
        feeds = _reach(line, back) | {line}
        on = {at: _reach(at, forward) for at in feeds}
        lines = [at for at in feeds if at in on[at]]
        if not lines or len(lines) > MOST_LINES:
            return None
        groups: list[list[str]] = []
        for at in sorted(lines, key=_order):  # two lines are on one cycle where each reaches the other
            group = next((g for g in groups if at in on[g[0]] and g[0] in on[at]), None)
            if group is None:
                groups.append([at])
            else:
                group.append(at)
        groups.sort(key=lambda g: line not in g)  # the line's own cycle first
        calls = [(f, at, self.views[(i, at)]) for at in lines for i, f in self.calls.get(at, {}).items()]
        return Recurrence(groups, calls, frozenset(self.edges))

    def carried(self, line: str) -> list[str]:
        """The lines among those `line` is reached from (itself too) that read what they made on their
        previous visit (x = x + dt * v, t = t + dt): a loop's state updates, in source order."""
        feeds = _reach(line, _adjacency((b, a) for a, b in self.edges)) | {line}
        return sorted((at for at in feeds if (at, at) in self.edges), key=_order)


def _tensors(values: Iterable[Any]) -> Iterable[torch.Tensor]:
    for value in values:
        if type(value) is torch.Tensor:
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if type(v) is torch.Tensor)


def _adjacency(edges: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Each line's successors, built once for every _reach from it."""
    nexts: dict[str, list[str]] = {}
    for a, b in edges:
        nexts.setdefault(a, []).append(b)
    return nexts


def _reach(start: str, nexts: dict[str, list[str]]) -> set[str]:
    """The lines reached from `start` by one edge or more (`start` itself only on a cycle)."""
    seen: set[str] = set()
    todo = list(nexts.get(start, []))
    while todo:
        at = todo.pop()
        if at not in seen:
            seen.add(at)
            todo.extend(nexts.get(at, []))
    return seen


def _order(line: str) -> tuple[str, int]:
    file, _, number = line.rpartition(":")
    return file, int(number) if number.isdigit() else 0


def recurrence(
    run: nn.Module, inputs: Any, dtype: torch.dtype, line: str | None, *, rng: RngState,
    device: torch.device | None, noise: ReplayNoise | None,
) -> Recurrence | None:  # fmt: skip
    """The recurrences `line` (file:line; None: the line that makes the model's output) is on or reads
    from, in one candidate forward; None where there are none or they hold more than MOST_LINES lines."""
    flow, made = _flowed(run, inputs, dtype, rng=rng, device=device, noise=noise)
    line = line if line is not None else made
    return flow.cycle(line) if line is not None else None


def loop_state_lines(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None,
) -> list[str]:  # fmt: skip
    """The state updates (_Flow.carried) that the line making the model's output is reached from, in
    one candidate forward: where a loop's cycle holds more than MOST_LINES lines (an RK4 step), its
    state is still those few lines."""
    flow, made = _flowed(run, inputs, dtype, rng=rng, device=device, noise=noise)
    return flow.carried(made) if made is not None else []


def _flowed(
    run: nn.Module, inputs: Any, dtype: torch.dtype, *, rng: RngState, device: torch.device | None,
    noise: ReplayNoise | None,
) -> tuple[_Flow, str | None]:  # fmt: skip
    """One candidate forward under _Flow, and the user line that made the output's first floating tensor."""
    flow = _Flow()
    made: list[str] = []

    def output(value: Any) -> None:
        for t in tensors_in(value):
            maker = flow.maker.get(id(t)) if t.is_floating_point() else None
            if maker is not None:
                made.append(maker[1])
                return

    stacked(flow, run, inputs, dtype, rng=rng, device=device, noise=noise, root=output)
    return flow, made[0] if made else None
