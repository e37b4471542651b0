"""The containers' own ops judged from the torch functions the forward calls: container_ops.OwnOps
with a Python dispatch only for the calls that hold an op due for a re-run.

OwnOps judges an op on its first calls and every power-of-two-th after (metrics.due), counted per
container call by (op, input shapes). A per-token loop runs the same few ops thousands of times,
so almost every op is only counted; under a dispatch mode each of them still costs a Python call
(an empty dispatch mode makes such a forward 4.2x slower, an empty torch-function mode 1.6x, for
53k function calls instead of 86k ops: benchmarks/README.md, the per-token loop).

`OwnCalls` watches torch functions instead. A function's first call with given arguments runs under
OwnOps, which judges and counts its aten ops and says which it counted (`OwnOps.log`); a later call
with the same arguments (`_signature`: each tensor's type, shape, strides, dtype and device, every
other argument's value) runs the same ops on the same shapes, so its counts move on without them,
unless one of its ops is due: then it runs under OwnOps again, which judges it as before. A call
site whose last calls all had one signature skips making it (TRUSTED) until a call is due. What
is judged, and every figure, is what OwnOps alone gives (a trusted site's call is checked by its
tensors' shapes; one whose shapes changed is signed again). A call is never learnt when the shapes of
its ops depend on the values (an op after nonzero or item), when a module runs inside it (the
innermost container may change), or when an argument is of a kind the signature does not know.
Basic indexing (`x[:, t]`: ints, slices, None) runs views alone, never an op that is counted.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fpdoctor.numerics.engine.raising import GETITEM, basic_index
from fpdoctor.precision.compare.container_ops import Own, OwnOps
from fpdoctor.precision.metrics import REPEATS

_SCALARS = frozenset({int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device,
                      torch.layout, torch.memory_format})  # fmt: skip
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})
_UNSEEN: Any = object()
# A call site (a torch function called from one place in the code) whose last TRUSTED calls all had
# one signature is taken to keep it while its tensors' shapes stay: its calls skip the signature,
# which is most of the cost of a call counted and not judged (a per-token loop calls each site
# thousands of times with the same shapes). A call that is due, or whose shapes changed, is signed;
# a site whose signature changed is trusted again only after TRUSTED more calls.
TRUSTED = 8


class OwnCalls(TorchFunctionMode):
    """OwnOps (`ops`) with one Python call per torch function (see the module's docstring). The
    hooks call enter, leave, take and paused on it as they do on OwnOps."""

    def __init__(self, ops: OwnOps) -> None:
        super().__init__()
        self.ops = ops
        self.pause = 0
        self.moves = 0  # module calls entered or left: a function that runs a module is not learnt
        # signature -> the repeat keys its ops count, each with how many times (None: never learnt)
        self.plans: dict[tuple[Any, ...], tuple[tuple[Any, int], ...] | None] = {}
        self._functions: dict[int, Any] = {}  # the functions whose ids the signatures hold, kept alive
        # (id of function, id of the calling code, its bytecode offset) -> [code, the signature of its
        # last call, its plan, how many calls in a row had that signature, their tensors' shapes]
        self.sites: dict[tuple[int, int, int], list[Any]] = {}

    def enter(self, name: str, index: int) -> None:
        self.moves += 1
        self.ops.enter(name, index)

    def leave(self, name: str, index: int) -> None:
        self.moves += 1
        self.ops.leave(name, index)

    def settle(self) -> None:
        self.ops.settle()

    def take(self, name: str, index: int) -> Own | None:
        return self.ops.take(name, index)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """compare's own work in its hooks is no call of the model's."""
        self.pause += 1
        try:
            with self.ops.paused():
                yield
        finally:
            self.pause -= 1

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        own = self.ops.current
        if own is None or self.pause:
            return func(*args, **kwargs)
        if func is GETITEM and type(args[0]) is torch.Tensor and not kwargs and basic_index(args[1]):
            return func(*args)  # views only: no op to count (x[:, t] in a loop over tokens)
        frame = sys._getframe(1)
        code = frame.f_code
        site = (id(func), id(code), frame.f_lasti)
        entry = self.sites.get(site)
        if (
            entry is not None and entry[3] >= TRUSTED and entry[0] is code and _shapes(args, kwargs) == entry[4]
            and _counted(entry[2], own.repeats)
        ):  # fmt: skip
            return func(*args, **kwargs)  # a trusted site (TRUSTED), its shapes as before, none of its ops due
        key = _signature(func, args, kwargs)
        plan = self.plans.get(key, _UNSEEN) if key is not None else None
        if isinstance(plan, tuple) and _counted(plan, own.repeats):
            self._seen(site, code, key, plan, (args, kwargs))
            return func(*args, **kwargs)
        # its first call with these arguments, or one of its ops is due: through the judge
        log: list[Any] = []
        moves, self.ops.log = self.moves, log
        try:
            with self.ops:
                out = func(*args, **kwargs)
        finally:
            self.ops.log = None
        if key is not None and plan is _UNSEEN:
            self._functions[id(func)] = func
            plan = self.plans[key] = _plan(log) if moves == self.moves else None
        self._seen(site, code, key, plan, (args, kwargs))
        return out

    def _seen(self, site: tuple[int, int, int], code: Any, key: Any, plan: Any, call: Any) -> None:
        """A call at `site` had signature `key`: the site's run of calls of one signature grows, or
        starts again. Only a learnt plan can be trusted."""
        entry = self.sites.get(site)
        if entry is not None and entry[0] is code and entry[1] == key:
            entry[3] = entry[3] + 1 if isinstance(plan, tuple) else 0
            entry[2] = plan
            if entry[3] == TRUSTED:
                entry[4] = _shapes(*call)
        else:
            self.sites[site] = [code, key, plan, 1 if isinstance(plan, tuple) else 0, None]


def _shapes(args: Any, kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The shapes of a call's tensors (one level of lists, as cat and stack take them), and its keywords
    with their tensors' shapes or their values' types (an attn_mask given on some calls only): what a
    trusted site's call is checked against, for far less than its signature."""
    out: list[Any] = []
    for k, v in kwargs.items():
        out += (k, v.shape if type(v) is torch.Tensor else type(v))
    for a in args:
        t = type(a)
        if t is torch.Tensor:
            out.append(a.shape)
        elif t is list or t is tuple:
            out.append(len(a))
            for v in a:
                if type(v) is torch.Tensor:
                    out.append(v.shape)
    return tuple(out)


def _counted(plan: tuple[tuple[Any, int], ...], repeats: dict[Any, int]) -> bool:
    """Counts a call whose ops are `plan` in `repeats`, unless one of them is due (metrics.due): then
    nothing is counted and the call goes through the judge. Written out: this runs for every call."""
    if len(plan) == 1:  # one op counted, the common case: one lookup
        op, n = plan[0]
        k = repeats.get(op, 0)
        if k < REPEATS or not k & (k - 1) or (n > 1 and _due_within(k + 1, n - 1)):
            return False
        repeats[op] = k + n
        return True
    for op, n in plan:
        k = repeats.get(op, 0)
        if k < REPEATS or not k & (k - 1) or (n > 1 and _due_within(k + 1, n - 1)):
            return False
    for op, n in plan:
        repeats[op] = repeats.get(op, 0) + n
    return True


def _due_within(k: int, n: int) -> bool:
    """Whether any of calls k .. k + n - 1 of an op is due (metrics.due)."""
    return any(j < REPEATS or j & (j - 1) == 0 for j in range(k, k + n))


def _plan(log: list[Any]) -> tuple[tuple[Any, int], ...] | None:
    """The repeat keys a call counted, each with how many times; None when an op's shape after a
    data-dependent one (log's None) may differ on the next call."""
    if None in log[: max((i for i, k in enumerate(log) if k is not None), default=-1)]:
        return None
    counts: dict[Any, int] = {}
    for k in log:
        if k is not None:
            counts[k] = counts.get(k, 0) + 1
    return tuple(counts.items())


def _signature(func: Any, args: Any, kwargs: Any) -> tuple[Any, ...] | None:
    """What decides the aten ops a call runs and their input shapes; None when an argument is of a
    kind it does not know (such a call always runs under the judge)."""
    out: list[Any] = [id(func)]
    try:
        for a in args:
            t = type(a)
            if t is torch.Tensor:  # the common case first, written out: this runs for every call
                dtype = a.dtype
                if dtype in _COMPLEX:  # a conjugate bit the signature does not hold
                    return None
                # the device by index (a torch.device is made, and hashed, per read)
                out.append((a.shape, a.stride(), dtype, a.get_device()))
            elif t in _SCALARS:
                out += (t, a)  # 1, 1.0 and True are equal keys: the type tells them apart
            elif not _describe(a, out):
                return None
        for k, v in kwargs.items():
            out.append(k)
            if not _describe(v, out):
                return None
    except (RuntimeError, TypeError):  # strides of a sparse or nested tensor
        return None
    return tuple(out)


def _describe(value: Any, out: list[Any]) -> bool:
    t = type(value)
    if t is torch.Tensor or t is torch.nn.Parameter:
        out += (t, value.shape, value.stride(), value.dtype, value.get_device())
        return value.dtype not in _COMPLEX
    if t in _SCALARS:
        out += (t, value)
        return True
    if t is tuple or t is list or t is torch.Size:
        out += (t, len(value))
        return all(_describe(v, out) for v in value)
    if t is slice:
        out.append(t)
        return _describe(value.start, out) and _describe(value.stop, out) and _describe(value.step, out)
    return False
