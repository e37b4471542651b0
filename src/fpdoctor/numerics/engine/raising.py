"""A model run with some of its ops raised, the rest as the candidate runs them (engine/__init__.py).

`RaisedSites`: the calls of some sites (a torch function at a source line) in fp64, their outputs
kept in fp64 (a running state lives in fp64), every other call given its fp64 inputs back in the
candidate's dtype. It watches torch functions, not aten ops (a TorchFunctionMode): a per-token loop
makes thousands of small calls per forward, and a function mode costs a fraction of a dispatch
mode per call (an empty one makes such a forward 1.6x slower, an empty dispatch mode 4.2x).
`RaisedLines`: every op at some source lines in fp32 (its low-precision inputs and dtype arguments
raised), its results cast back where the rest of the model reads them: the fix "compute these
lines in fp32, cast the result back", as a user writes it.
`SaturatedCasts`: the casts to a narrow format at some source lines that turn finite values beyond
its range into Inf hold them at its largest finite value instead: the fix "write the format's own
limit" (torch.finfo(x.dtype).min for a mask fill, not float32's), as a run.
"""

from __future__ import annotations

import functools
import linecache
import math
import re
import sys
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fpdoctor.torchprivate import EagerDispatchMode
from fpdoctor.userframes import user_location


def _map(args: tuple[Any, ...], kwargs: dict[str, Any], fn: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """An op's arguments with every tensor replaced by fn(tensor). Written out for what aten ops take
    (tensors, lists of tensors, scalars): the pytree walk costs more than most ops of a long loop."""
    mapped = tuple([fn(a) if type(a) is torch.Tensor else _mapped(a, fn) for a in args])
    return mapped, {k: _mapped(v, fn) for k, v in kwargs.items()} if kwargs else kwargs


def _mapped(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors among an op's arguments or results (one level of lists, as aten ops take them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)] if value else []
    return []


class ByTensor:
    """A value per live tensor, by identity (a WeakKeyDictionary compares tensors with ==, which is
    elementwise); an entry whose tensor died is never returned, and is dropped when seen."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref[torch.Tensor], Any]] = {}

    def get(self, t: torch.Tensor) -> Any:
        entry = self._by_id.get(id(t))
        if entry is None:
            return None
        if entry[0]() is not t:
            del self._by_id[id(t)]
            return None
        return entry[1]

    def put(self, t: torch.Tensor, value: Any) -> None:
        self._by_id[id(t)] = (weakref.ref(t), value)


class RaisedSites(TorchFunctionMode):
    """Runs the calls of some sites in float64 (their inputs raised, their output kept in float64:
    the running states live in fp64) and gives every other call its float64 inputs back in
    `dtype`, so the rest of the model runs as the candidate does. A site is (torch function, line):
    what `compare`'s running-state search (precision/compare/passes.py) records. `views`: sites whose
    calls run as they are (a view of a state kept in float64 stays float64 for the site that reads it:
    cast down, the state would be rounded between two lines of its own update)."""

    def __init__(
        self, sites: list[tuple[Any, str]], dtype: torch.dtype, *, views: list[tuple[Any, str]] | None = None
    ) -> None:  # fmt: skip
        super().__init__()
        self.dtype = dtype
        # by id: a function's __hash__ may be Python code, asked per call; the list keeps them alive
        self.functions = [site[0] for site in [*sites, *(views or [])]]
        self.ids = {id(f) for f in self.functions}
        # (id, file, line number): what user_location gives, with no string made per call
        self.sites = _keys(sites)
        self.views = _keys(views or [])
        self.raised = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        site = False
        if id(func) in self.ids:
            user = user_location(sys._getframe())
            key = (id(func), user[0], user[1]) if user is not None else None
            if key is not None and key in self.views:
                return func(*args, **kwargs)
            site = key is not None and key in self.sites
        return self.call(func, args, kwargs, site=site)

    def call(self, func: Any, args: Any, kwargs: dict[str, Any], *, site: bool) -> Any:
        """One call as this mode runs it: a site's in float64, any other with its float64 inputs back
        in `dtype`. Also for a mode that picks its sites as the forward goes (compare's running-state
        search raises a line from its first counted update on)."""
        if site:
            self.raised += 1
            args, kwargs = _map(args, kwargs, self._up)
            return func(*args, **kwargs)
        if not _holds(args, torch.float64) and not (kwargs and _holds(kwargs.values(), torch.float64)):
            return func(*args, **kwargs)
        if func is GETITEM and not kwargs and basic_index(args[1]):
            # a view of a float64 value stays one (what reads it casts it): cast here, a write into the view
            # (`nb[1:] += d`) would go to a copy
            return func(*args)
        if args and type(args[0]) is torch.Tensor and args[0].dtype is torch.float64 and writes_into(func):
            # a write into a float64 value (a state made by a raised line, written by a line outside) goes into
            # it, what it writes read as the op reads it; a store (`nb[1:] = v`, copy_) stores what it is given
            # (Python's `nb[1:] += d` stores the updated float64 view back: cast down, the state would round)
            if getattr(func, "__name__", "") in _STORES:
                return func(*args, **kwargs)
            rest, kwargs = _map(args[1:], kwargs, self._down)
            return func(args[0], *rest, **kwargs)
        args, kwargs = _map(args, kwargs, self._down)
        return func(*args, **kwargs)

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.dtype is self.dtype else t

    def _down(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.dtype) if t.dtype is torch.float64 else t


GETITEM = torch.Tensor.__getitem__
# the in-place forms Python's augmented assignment and item assignment call (`nb[1:] += d`, `x[i] = v`)
_WRITES_INTO = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__imatmul__",
    "__setitem__",
})  # fmt: skip


# the writes that store a value as it is (no arithmetic of their own)
_STORES = frozenset({"__setitem__", "copy_"})
# in-place ops that change only the target's shape or strides: run on it as they are, never widened
_METADATA = frozenset({"unsqueeze_", "squeeze_", "t_", "transpose_", "resize_", "as_strided_", "swapdims_",
                       "swapaxes_", "resize_as_"})  # fmt: skip


def basic_index(index: Any) -> bool:
    """Whether `x[index]` is basic indexing (ints, slices of ints, None, ...): views alone, whatever
    the ints (advanced indexing, with a tensor or a bool, runs index ops)."""
    if type(index) is not tuple:
        index = (index,)
    for i in index:
        t = type(i)
        if t is slice:
            for b in (i.start, i.stop, i.step):
                if b is not None and type(b) is not int:
                    return False
        elif t is not int and i is not None and i is not Ellipsis:
            return False
    return True


def writes_into(func: Any) -> bool:
    """`func` writes into its first argument (`add_`, `copy_`, `+=`, `x[i] = v`): a torch function by
    its name, an aten op by its overload packet's."""
    packet = getattr(func, "overloadpacket", None)
    name = getattr(packet if packet is not None else func, "__name__", "")
    return name in _WRITES_INTO or (name.endswith("_") and not name.endswith("__"))


def _keys(sites: list[tuple[Any, str]]) -> set[tuple[int, str, int]]:
    """(id of function, file, line number) of each site, as RaisedSites looks them up."""
    return {(id(f), file, int(number)) for f, line in sites for file, _, number in [line.rpartition(":")]}


def _holds(values: Any, dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` is among an op's arguments (one level of lists: cat, stack): the
    per-op test that lets most ops of a long forward skip the walk over their arguments."""
    for value in values:
        t = type(value)
        if t is torch.Tensor:
            if value.dtype is dtype:
                return True
        elif t is list or t is tuple:
            # written out, no generator: an index (x[:, t], its tuple of slices) is walked on every call
            for v in value:
                if type(v) is torch.Tensor and v.dtype is dtype:
                    return True
    return False


# A line that writes a wide dtype itself: x.float(), torch.float32, dtype=torch.double, ...
_WRITES_WIDE = re.compile(r"\.(float|double)\(|float32|float64|torch\.(float|double)\b")


@functools.lru_cache(maxsize=512)
def _forward_span(kind: type) -> tuple[str, int, int] | None:
    """`kind`'s forward: its source file, first and last line (every module call of a check asks)."""
    code = getattr(getattr(kind, "forward", None), "__code__", None)
    if code is None:
        return None
    numbers = [n for _, _, n in code.co_lines() if n is not None]
    return (code.co_filename, min(numbers), max(numbers)) if numbers else None


def _made_in(made: Any, span: tuple[str, int, int] | None) -> bool:
    """A raised result's mark (the line that made it) lies in a module's forward `span`."""
    return span is not None and isinstance(made, tuple) and made[0] == span[0] and span[1] <= made[1] <= span[2]


def _widens(to: Any, dtype: torch.dtype) -> bool:
    """A cast to a floating dtype wider than `dtype`."""
    return isinstance(to, torch.dtype) and to.is_floating_point and torch.finfo(to).bits > torch.finfo(dtype).bits


class RaisedLines(EagerDispatchMode):
    """Ops at `lines` computed in fp32 (their `dtype` inputs and dtype arguments raised); every other
    op reads their fp32 results back in `dtype`, as the user's fix casts them back."""

    def __init__(
        self, lines: set[tuple[str, int]], dtype: torch.dtype, *, wide_inputs: bool = False, cast_back: bool = True,
        scalars_kept: bool = False, wide: torch.dtype = torch.float32, carried: set[tuple[str, int]] | None = None,
        modules: list[torch.nn.Module] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.lines, self.dtype = lines, dtype
        # lines (among `lines`) whose results pass from module to module in fp32 (a residual stream kept in
        # fp32): not cast back where a module returns them, nor where a module without weights of its own or
        # with raised lines takes them in; a layer with weights (a Linear) still takes them in `dtype`
        self.carried = carried or set()
        # modules computed in fp32 whatever line calls them (their ops raised, what they return cast back):
        # the norms that read a stream kept in fp32. With them or `carried`, the module calls in progress are
        # tracked (`calls`: each with the user line that made it), and a torch module called from a carried line
        # runs as the candidate does (its ops run at that line, but the fix keeps only the stream's own adds)
        self.modules = {id(m) for m in modules or []}
        self.calls: list[tuple[torch.nn.Module, tuple[str, int] | None]] = []
        self.passing = False  # this mode's own casts, run as they are
        # what the lines compute in: fp32, or fp64 for an fp32 candidate (a Cholesky that fails in fp32)
        self.wide = wide
        # True: a single value the lines made (a 0-dim tensor: alphas[t] of a schedule they built) is read in
        # fp32 as it is. An op that reads it with a `dtype` tensor stays in `dtype` (type promotion), and takes
        # the fp32 value's digits: the fix "build the table in fp32, read its values as they are"
        self.scalars_kept = scalars_kept
        # False: what the lines make is read as it is everywhere (type promotion; a layer that checks its
        # input's dtype fails the run): the fix "make it in fp32 and keep it so", where what reads it widens
        self.cast_back = cast_back
        self.made = ByTensor()  # the fp32 results of raised ops (and their views)
        self.raised = 0  # ops raised
        # the model's inputs fed in fp32, not rounded to `dtype` (compare's check of a computation on
        # them before the cast): an fp32 tensor the lines read is one of them, not the code widening;
        # every other op reads them in `dtype`, as a model that casts its own inputs does
        self.wide_inputs = wide_inputs
        self.fed = ByTensor()  # those inputs (and their views): `feed`, at the model's call
        # buffers held in fp32 (compare's check of a rounded buffer kept), by attribute name: a cast a line
        # makes to a held buffer's dtype (t.to(self.freqs.dtype), t.type_as(self.freqs)) reads fp32 from it,
        # which the code did not write
        self.held: set[str] = set()
        # True: every module entered reads what the lines made in `dtype`, unless its own forward holds raised
        # lines: the fix's "cast back where the rest of the model reads it", taken literally. The default lets a
        # module without weights take an fp32 value as it is (positions read by a positional module's sin); a
        # run that fails so (a `.to(x.dtype)` of that value in it widens what its Linear reads) runs again so
        self.entry_cast = False

    def again_casting_at_entry(self) -> bool:
        """Ready this mode for a second run with `entry_cast`, where the first did not have it. What was
        marked before the first run stays (buffers held in fp32 by raised_error); what the failed run made
        dies with its tensors (ByTensor drops them). False where it had it already: no other run to make."""
        if self.entry_cast or not self.cast_back:
            return False
        self.entry_cast, self.calls = True, []
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.passing:
            return func(*args, **kwargs)
        user = user_location(sys._getframe())
        at = (user[0], user[1]) if user is not None else None
        inside = self._inside(at) if self.calls else None
        # a view on a raised line is of the tensor itself (widened, it would be of a copy, and a write through it,
        # `nb[1:] += d`, lost); the ops that compute from it widen what they read
        metadata = func.is_view or func.overloadpacket.__name__ in _METADATA
        if user is not None and ((at in self.lines and inside is not False) or inside) and not metadata:
            self.raised += 1
            # a result the code makes wider than `dtype` as written (x.float().mean()) is read as it is:
            # only what raising widened is cast back where the rest reads it
            wider = self._wider(args, kwargs, user)
            target = args[0] if args and type(args[0]) is torch.Tensor else None
            args, kwargs = _map(args, kwargs, self._up)
            args = tuple(self.wide if a is self.dtype else a for a in args)
            kwargs = {k: self.wide if v is self.dtype else v for k, v in kwargs.items()}
            out = func(*args, **kwargs)
            if target is not None and args[0] is not target and writes_into(func):
                # an in-place op (`nb[1:] += d`) wrote into a widened copy: its result goes into the tensor the
                # code writes, in that tensor's dtype, as the fix's cast back puts it
                target.copy_(args[0])
                return target
            if not wider:
                for t in _tensors(out):
                    if t.dtype == self.wide:
                        self.made.put(t, (user[0], user[1]))  # the line that made it (truthy)
            return out
        if func.is_view:
            out = func(*args, **kwargs)
            for marks in (self.made, self.fed):
                mark = next((m for m in (marks.get(t) for t in _tensors(args)) if m), None)
                if mark:
                    for t in _tensors(out):
                        marks.put(t, mark)
            return out
        if not self.cast_back or (func.__name__ == "_to_copy.default" and _widens(kwargs.get("dtype"), self.dtype)):
            # code off the lines that widens what they made (t.float() in a module the caller passes
            # positions to): it reads the fp32 value as it is, as it would in the fixed code
            return func(*args, **kwargs)
        if args and type(args[0]) is torch.Tensor and writes_into(func):
            # an in-place op off the lines (`acc += x`, acc made on a raised line) writes into the tensor itself,
            # not a copy cast back (the write would be lost); it computes as the fix has it, on the target read
            # back in `dtype`, and what it writes is read as every op off the lines reads it
            target = args[0]
            rest, kwargs = _map(args[1:], kwargs, self._read)
            read = self._read(target)
            if read is target or func.overloadpacket.__name__ in _METADATA:
                return func(target, *rest, **kwargs)
            func(read, *rest, **kwargs)
            target.copy_(read)
            return target
        args, kwargs = _map(args, kwargs, self._read)
        return func(*args, **kwargs)

    def _inside(self, at: tuple[str, int] | None) -> bool | None:
        """True: the op runs inside a module kept in fp32; False: inside a torch module that a carried line
        called (x = x + self.mlp(x): the stream kept, not the layers it calls), which runs as the candidate
        does; None: neither."""
        if any(id(m) in self.modules for m, _ in self.calls):
            return True
        return False if at is not None and at in self.carried and self.calls[-1][1] == at else None

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor as an op off the lines reads it: what the lines made (or an input fed in fp32) cast back
        to `dtype`, unless it is a single value kept in fp32 (`scalars_kept`)."""
        made = self.made.get(t)
        if made and self.scalars_kept and t.dim() == 0:
            return t
        return t.to(self.dtype) if made or self.fed.get(t) else t

    def __enter__(self) -> RaisedLines:
        # a module that reads a raised result gets it in `dtype` before its forward: a conv or linear
        # checks its input's dtype against its weight's in C++ before any op reaches this mode
        entered = super().__enter__()
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self._back)  # type: ignore[arg-type]
        self._out_hook = torch.nn.modules.module.register_module_forward_hook(self._returned)
        return entered

    def __exit__(self, *exc: Any) -> None:
        self._hook.remove()
        self._out_hook.remove()
        super().__exit__(*exc)

    def _returned(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        """What a module returns that its own raised lines made, cast back as the fix says ("what the
        last line makes", .to(p.dtype)): its output in `dtype`, also where no module reads it after
        (the model's output: a value past the format's range overflows there, as in the fixed code)."""
        if self.carried or self.modules:
            if self.calls:
                self.calls.pop()
            if id(module) in self.modules and type(output) is torch.Tensor and output.is_floating_point():
                self.passing = True
                try:
                    return output.to(self.dtype)
                finally:
                    self.passing = False
        if not self.cast_back or type(output) is not torch.Tensor:
            return None
        made = self.made.get(output)
        if made in self.carried or not _made_in(made, self._span(type(module))):
            return None
        return output.to(self.dtype)

    def _back(self, module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.carried or self.modules:
            user = user_location(sys._getframe())
            self.calls.append((module, (user[0], user[1]) if user is not None else None))
            if id(module) in self.modules:  # its ops read what they are passed raised
                return None
        if not self.cast_back or not any(type(a) is torch.Tensor and self.made.get(a) for a in args):
            return None
        span = self._span(type(module))
        raises = span is not None and any(span[0] == f and span[1] <= n <= span[2] for f, n in self.lines)

        # a layer with weights of its own (a Linear, a conv, a norm) may check its input's dtype in C++
        weighted = any(
            t is not None and t.is_floating_point() and t.dtype == self.dtype
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
        )

        def back(a: torch.Tensor) -> bool:
            # one the module's own lines made (its output of an earlier call) comes back in `dtype`, as the
            # fix says ("what the last line makes", cast back); a value its caller's lines made stays fp32
            # into a forward that holds raised lines (positions read by a positional module's sin) or has no
            # weights of its own, whose ops read it as every op does: in `dtype` off the lines, as it is
            # where the code widens it (t.float())
            made = self.made.get(a)
            if not made:
                return False
            if self.entry_cast:
                return not raises
            if made in self.carried:
                return weighted and not raises
            return _made_in(made, span) or (weighted and not raises)

        if not any(type(a) is torch.Tensor and back(a) for a in args):
            return None
        return tuple(a.to(self.dtype) if type(a) is torch.Tensor and back(a) else a for a in args)

    @staticmethod
    def _span(kind: type) -> tuple[str, int, int] | None:
        return _forward_span(kind)

    def feed(self, tensors: list[torch.Tensor]) -> None:
        """The model's inputs as its call gets them (positional and keyword): with `wide_inputs`, the fp32
        ones are read in `dtype` by every op off the lines."""
        if self.wide_inputs:
            for t in tensors:
                if t.dtype == torch.float32:
                    self.fed.put(t, True)

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.wide) if t.dtype == self.dtype else t

    def _wider(self, args: Any, kwargs: dict[str, Any], user: tuple[str, int, str]) -> bool:
        """Whether the op, as the code wrote it, computes wider than `dtype`: its floating dtype
        argument says (a cast to `dtype` is not wider, whatever it reads; with buffers `held`, an
        fp32 the line does not write is the held buffer's dtype, read by the code); without one, a
        floating input of a wider dtype that no raised op made."""
        values = [*args, *kwargs.values()]
        given = [a for a in values if isinstance(a, torch.dtype) and a.is_floating_point]
        if given:
            if self.held and given[0] is torch.float32:
                code = linecache.getline(*user[:2])
                if not _WRITES_WIDE.search(code) and any(re.search(rf"\b{re.escape(n)}\b", code) for n in self.held):
                    return False
            return given[0] is not self.dtype and torch.finfo(given[0]).bits > torch.finfo(self.dtype).bits
        if self.wide_inputs:
            return False
        width = torch.finfo(self.dtype).bits
        floats = [t for a in values for t in _tensors(a) if t.is_floating_point()]
        # torch's type promotion: a 0-dim operand (a schedule's alphas[t] kept in fp32) does not widen an op on
        # tensors of `dtype` (x / a_t.sqrt() stays fp16), so only where every floating operand is 0-dim does one
        shaped = [t for t in floats if t.dim() > 0] or floats
        return any(torch.finfo(t.dtype).bits > width and not self.made.get(t) for t in shaped)


def below_range(args: Any, dtype: torch.dtype) -> list[float]:
    """The non-zero Python numbers among an op's positional `args` that `dtype` holds as 0 (an eps of
    1e-9 in fp16): held at its smallest normal value, they are what writing torch.finfo(x.dtype).tiny
    gives."""
    smallest = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2  # half the least subnormal
    return [a for a in args if type(a) is float and a != 0 and abs(a) <= smallest]


def past_range(args: Any, limit: float) -> list[float]:
    """The Python numbers among an op's positional `args` that are finite but past +-`limit`: a
    constant a narrow format holds as Inf (torch.finfo(torch.float32).min, 1e9 in fp16)."""
    return [a for a in args if type(a) is float and math.isfinite(a) and abs(a) > limit]


class SaturatedCasts(EagerDispatchMode):
    """Casts to `dtype` at `lines` (file, line number) that make Inf of finite values beyond its range
    give its largest finite value, with the sign, instead; so does a Python constant past its range
    that an op there applies to a `dtype` tensor (x * torch.finfo(torch.float32).min: what writing
    torch.finfo(x.dtype).min gives), and one it holds as 0 gets its smallest normal value
    (clamp(min=1e-9): torch.finfo(x.dtype).tiny). Every other op runs as it does."""

    def __init__(self, lines: set[tuple[str, int]], dtype: torch.dtype) -> None:
        super().__init__()
        self.lines, self.dtype = lines, dtype
        self.limit = torch.finfo(dtype).max
        self.raised = 0  # casts and constants held at the limit

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if past_range(args, self.limit) or below_range(args, self.dtype):
            args = self._held(args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        if type(out) is not torch.Tensor or out.dtype != self.dtype or func.overloadpacket.__name__ != "_to_copy":
            return out
        src = args[0] if args else None
        if not isinstance(src, torch.Tensor) or not src.is_floating_point() or torch.finfo(src.dtype).max <= self.limit:
            return out  # a source the format holds the range of cannot overflow it
        user = user_location(sys._getframe())
        if user is None or (user[0], user[1]) not in self.lines:
            return out
        made = torch.isinf(out) & torch.isfinite(src).to(out.device)
        if bool(made.any()):  # a host read: this runs once per checked run, on a few casts
            self.raised += 1
            out = torch.where(made, out.sign() * self.limit, out)
        return out

    def _held(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """`args` with their constants past the range held at it, where the op at one of the lines
        reads a tensor in `dtype` or makes one (torch.where(mask, x, -1e30) makes the constant a
        tensor of x's dtype first: aten.scalar_tensor(-1e30, dtype=...))."""
        reads = any(isinstance(a, torch.Tensor) and a.dtype == self.dtype for a in args)
        if not reads and kwargs.get("dtype") is not self.dtype:
            return args
        user = user_location(sys._getframe())
        if user is None or (user[0], user[1]) not in self.lines:
            return args
        self.raised += 1
        past, below = past_range(args, self.limit), below_range(args, self.dtype)
        tiny = torch.finfo(self.dtype).tiny
        return tuple(
            math.copysign(self.limit, a) if any(a is p for p in past)
            else math.copysign(tiny, a) if any(a is b for b in below)
            else a
            for a in args
        )  # fmt: skip
