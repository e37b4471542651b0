"""How close op outputs inside modules come to the candidate's format max, in compare's passes.

compare judges module outputs; an op inside a module can come near the format's max while the
module's output stays small (attention's q·kᵀ scores, written in the attention's own forward,
then squashed by the softmax). `OpRanges` is a dispatch mode that, during one `passes.hooked`
run, keeps the largest magnitude of every floating op output per (module, call, op, k-th
occurrence of that op in that call, output position). Module attribution comes from the
pass's own hook callbacks, wrapped by `pre()` and `post()`: the mode steps off the dispatch
stack while they run, so what compare computes in them (samples, errors, isolated re-runs of
module copies) is neither recorded, nor counted, nor slowed, and the occurrences of the fp64
pass and the candidate's pass line up op for op. In the fp64 pass it is no mode of its own: the
own-ops mode (container_ops.OwnOps) hands it every op (`record`), since a second Python dispatch
per op costs more than a tiny op itself (bench_compare's many-tiny-ops row). In the candidate's
pass it is pushed only inside the module calls that need it (`watched`, WATCH_SHARE below).

Cost: one `aminmax` per op output (one kernel), its two 0-d results kept on the device and read
once at the end with one stack per device and dtype: no host sync per op. Views, ops that only
move, select or cast values, and constant fills are not reduced (`headroom.judged`).

Source lines: a value is only known at the end, so the line is taken for every op output that
could cross (fp16/fp8: the formats a compare candidate computes in whose max a model reaches),
once per (module class, op, occurrence, position): a module's forward runs the same lines in
every call, so twelve encoder layers pay for one. A re-run pass only for the ops that crossed
would cost a forward to save a few hundred frame walks. The line is the innermost one of the
user's code (a torch module's ops: the line that called it); frames above the model (compare's
own) are never taken for it.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

from fpdoctor.formats import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE
from fpdoctor.numerics.observe.values import dtype_name, minmax, read_scalars
from fpdoctor.numerics.trace.headroom import MAX_OP_FINDINGS, judged, near_limit_finding
from fpdoctor.precision.metrics import due
from fpdoctor.report.model import Finding
from fpdoctor.torchprivate import (
    DisableTorchDispatch,
    EagerDispatchMode,
    TorchDispatchMode,
    mode_stack,
    pop_mode,
    push_mode,
)
from fpdoctor.userframes import CASEBOOK_DIR, OWN_DIR, is_user_file

# The formats whose max a model's values reach: a candidate computing in one of them (fp16,
# fp16-accumulate) is worth recording; bf16 has fp32's range, and the fp8 candidates compute in
# fp32 around scaled casts. Their op outputs get a source line.
AT_RISK = frozenset({torch.float16, torch.float8_e4m3fn, torch.float8_e5m2})

# The candidate's pass watches op by op only the module calls that need it, since a Python
# dispatch per op costs more than a tiny op itself: those where an fp64 op output came within
# WATCH_SHARE of the candidate format's max (or was non-finite). An op outside them reaches
# OVERFLOW_SHARE of the max in the candidate only by coming out 8x (OVERFLOW_SHARE / WATCH_SHARE)
# its fp64 value or more: an error of 700% made inside that module call, a departure compare
# already reports at module level (the module's propagated and isolated errors) rather than a
# risk of the format's range. A call whose candidate output turns non-finite is re-run op by op
# from its inputs (compare.py), so an overflow is still named by its op.
WATCH_SHARE = OVERFLOW_SHARE / 8
_FLOATING = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, *AT_RISK})


@dataclass(frozen=True)
class OpRange:
    """One op output's largest magnitude in one module call."""

    module: str
    call: int  # which call of the module, from 0
    op: str  # the aten overload, e.g. aten.bmm.default
    occurrence: int  # the k-th call of `op` in this module call, from 0
    position: int  # which of the op's outputs
    shape: tuple[int, ...]
    dtype: str
    absmax: float  # NaN when the output held NaN
    location: tuple[str, int, str] | None = None

    @property
    def key(self) -> tuple[str, int, str, int, int]:
        return self.module, self.call, self.op, self.occurrence, self.position


class OpRanges(EagerDispatchMode):
    """Records op output ranges inside modules during one pass; see the module docstring.

    Use: `with ranges: hooked(run, ..., pre=ranges.pre(pre), post=ranges.post(post))`, then
    `ranges.read()`. `dtypes`: the output dtypes whose ranges are taken (the reference pass: all
    floating ones; the candidate's: AT_RISK, the only ones judged); every op is counted anyway,
    so occurrences line up between passes."""

    def __init__(self, dtypes: Iterable[torch.dtype] = _FLOATING) -> None:
        super().__init__()
        self._dtypes = frozenset(dtypes) & _FLOATING
        self.errors: list[str] = []
        self._stack: list[tuple[str, int, dict[str, int], Any]] = []  # (name, call, op counts, code key)
        self._paused = 0
        self._keys: list[tuple[str, int, str, int, int, tuple[int, ...], str, tuple[str, int, str] | None]] = []
        self._values: list[torch.Tensor] = []  # (lo, hi) per key, 0-d, on the op's device
        # id(overload) -> (op, reduced, the overload): an OpOverload's __hash__ is Python code
        self._ops: dict[int, tuple[str, bool, Any]] = {}
        self._lines: dict[tuple[str, Any, str, int, int], tuple[str, int, str] | None] = {}
        self._read: list[OpRange] | None = None

    # -- module attribution: compare's hook callbacks, wrapped ------------------------------
    def pre(self, callback: Callable[..., None] | None = None) -> Callable[..., None]:
        """`hooked`'s pre callback (name, index, module, args, kwargs): runs `callback` unrecorded,
        then enters the module's call."""

        def on_pre(name: str, index: int, mod: Any, args: Any, kwargs: Any) -> None:
            if callback is not None:
                with self.paused():
                    callback(name, index, mod, args, kwargs)
            self.enter(name, index, mod)

        return on_pre

    def post(self, callback: Callable[..., None]) -> Callable[..., None]:
        """`hooked`'s post callback (name, index, args, output): leaves the module's call, then runs
        `callback` unrecorded."""

        def on_post(name: str, index: int, args: Any, output: Any) -> None:
            self.leave(name, index)
            with self.paused():
                callback(name, index, args, output)

        return on_post

    def enter(self, name: str, index: int, module: Any = None) -> None:
        """Ops from now on belong to call `index` of module `name` (until a child enters). With
        the `module` itself, its ops' source lines are taken once per class, else per name."""
        self._stack.append((name, index, {}, type(module) if module is not None else name))

    def leave(self, name: str, index: int) -> None:
        """Call `index` of `name` returned: pop to it (a child that raised left no post hook)."""
        while self._stack:
            top = self._stack.pop()
            if top[0] == name and top[1] == index:
                return

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run here are neither recorded nor counted (compare's own work inside its hooks).
        The mode steps off the dispatch stack meanwhile, the modes above it (noise replay) kept
        in place, so compare's many small ops and re-runs do not pay for a Python dispatch."""
        self._paused += 1
        above = self._step_off() if self._paused == 1 else None
        try:
            yield
        finally:
            if above is not None:
                self._step_on(above)
            self._paused -= 1

    def _step_off(self) -> list[TorchDispatchMode] | None:
        """Pop this mode and those above it; the others go back at once. None if not on the stack."""
        stack = mode_stack()
        if not any(mode is self for mode in stack):
            return None
        above = []
        while (mode := pop_mode()) is not self:
            above.append(mode)
        for mode in reversed(above):
            push_mode(mode)
        return above

    def _step_on(self, above: list[TorchDispatchMode]) -> None:
        """Back under the modes that were above it, as `with` put it there."""
        for _ in above:
            pop_mode()
        push_mode(self)
        for mode in reversed(above):
            push_mode(mode)

    def clear(self) -> None:
        """Forget what was recorded (a pass that runs again: compare's fp64 pass with noise replay)."""
        self._stack.clear()
        self._keys.clear()
        self._values.clear()
        self._read = None

    # -- recording ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **kwargs) if kwargs else func(*args)
        self.record(func, out)
        return out

    def record(self, func: Any, out: Any) -> None:
        """Take the range of `out`, the output of op `func`, if due. Called straight from a dispatch
        mode's __torch_dispatch__ (this one's, or compare's own-ops mode's in the fp64 pass: one
        Python dispatch per op for both), so the frame two up is the op's caller."""
        if self._paused or not self._stack:
            return  # compare's own work, or outside the model (the inputs' cast)
        try:
            info = self._ops.get(id(func))
            if info is None:
                name = func.overloadpacket.__name__
                # casts are compare's own (the fp8 quantization, whose scaled values sit at the
                # max by design: fp8-saturation judges them) or no-ops in the candidate's dtype
                reduced = not func.is_view and not name.startswith("empty") and judged(name, cast=False)
                info = self._ops[id(func)] = (str(func), reduced, func)
            if not info[1]:
                return
            op = info[0]
            module, call, counts, code = self._stack[-1]
            k = counts.get(op, 0)
            counts[op] = k + 1
            if not due(k):  # an op repeated in a loop: its first calls and every power-of-two-th
                return
            outputs = (out,) if type(out) is torch.Tensor else out if isinstance(out, (tuple, list)) else ()
            for position, t in enumerate(outputs):
                if not isinstance(t, torch.Tensor) or t.dtype not in self._dtypes or t.layout is not torch.strided:
                    continue
                if not t.numel():
                    continue
                location = None
                if t.dtype in AT_RISK:
                    # per module too: torch's modules share their forward's code (every Linear's mm),
                    # and the line that matters is the one that called this module
                    line_key = (module, code, op, k, position)
                    if line_key not in self._lines:
                        self._lines[line_key] = _model_location(sys._getframe(2))
                    location = self._lines[line_key]
                with DisableTorchDispatch():  # a mode below must not see the reduction
                    self._values.extend(minmax(t))
                self._keys.append((module, call, op, k, position, tuple(t.shape), dtype_name(t.dtype), location))
        except Exception as exc:  # the observer never fails compare
            if len(self.errors) < 20:
                self.errors.append(f"{func}: {type(exc).__name__}: {exc}")

    def read(self) -> list[OpRange]:
        """Every recorded op output's range, read from the device once."""
        if self._read is None:
            values = read_scalars(self._values)
            self._values.clear()
            found = []
            for n, (module, call, op, k, position, shape, dtype, location) in enumerate(self._keys):
                lo, hi = values[2 * n], values[2 * n + 1]
                absmax = math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)
                found.append(OpRange(module, call, op, k, position, shape, dtype, absmax, location))
            self._read = found
        return self._read


def watched(reference: Iterable[OpRange], dtype: torch.dtype) -> set[tuple[str, int]]:
    """The (module, call)s whose ops the candidate's pass (in `dtype`) records: those with an op
    output of the fp64 pass (`reference`) at or above WATCH_SHARE of the format's max, or NaN."""
    fmt = DTYPE_FORMAT.get(str(dtype))
    if fmt is None or fmt == "fp32":
        return set()
    at = FORMATS[fmt].max * WATCH_SHARE
    return {(r.module, r.call) for r in reference if not r.absmax < at}


def _model_location(frame: FrameType | None) -> tuple[str, int, str] | None:
    """The innermost user frame below fpdoctor's own: the model's line (for a torch module's
    ops, the user's line that called it), never the line that called compare."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(OWN_DIR) and not filename.startswith(CASEBOOK_DIR):
            return None  # out of the model, into compare
        if is_user_file(filename):
            return filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back
    return None


def near_limit(
    candidate: Iterable[OpRange],
    reference: Iterable[OpRange] = (),
    *,
    exclude: Iterable[tuple[str, str]] = (),
    prefix: str | None = None,
    limit: int = MAX_OP_FINDINGS,
) -> list[dict[str, Any]]:
    """The candidate pass's op outputs at or above OVERFLOW_SHARE of their format's max (fp16,
    bf16, fp8), worst per (module, op, format), largest share first, at most `limit`; each with
    the reference (fp64) pass's absmax of the same output (same module, call, op, occurrence,
    position and shape). Outputs that are non-finite in the candidate (an overflow:
    `first_overflow` names it) are not a risk, nor are (module, op) pairs in `exclude`: ops
    already named as overflowing in another call. `prefix`: the submodule compare ran alone."""
    truth = {r.key: r for r in reference}
    skip = set(exclude)
    worst: dict[tuple[str, str, str], tuple[float, OpRange]] = {}
    for r in candidate:
        fmt = DTYPE_FORMAT.get(r.dtype)
        if fmt in (None, "fp32") or not math.isfinite(r.absmax):
            continue
        share = r.absmax / FORMATS[fmt].max
        key = (r.module, r.op, fmt)
        if share >= OVERFLOW_SHARE and share > worst.get(key, (0.0,))[0] and (r.module, r.op) not in skip:
            worst[key] = (share, r)
    rows = []
    for (module, op, fmt), (share, r) in sorted(worst.items(), key=lambda item: -item[1][0])[:limit]:
        ref = truth.get(r.key)
        row: dict[str, Any] = {
            "module": (f"{prefix}.{module}" if module else prefix) if prefix else module,
            "call": r.call,
            "op": op,
            "occurrence": r.occurrence,
            "target": fmt,
            "dtype": r.dtype,
            "shape": list(r.shape),
            "absmax": r.absmax,
            "share": share,
        }
        if ref is not None and ref.shape == r.shape:
            row["reference_absmax"] = ref.absmax
            row["reference_share"] = ref.absmax / FORMATS[fmt].max
        if r.location is not None:
            row["location"] = r.location
        rows.append(row)
    return rows


def findings(rows: list[dict[str, Any]], *, label: str, reference: str = "fp64") -> list[Finding]:
    """overflow-risk findings for `near_limit`'s rows; `label`: the candidate (e.g. "fp16")."""
    found = []
    for row in rows:
        extra: dict[str, Any] = {"candidate": label, "occurrence": row["occurrence"] + 1, "shape": row["shape"]}
        also = None
        if "reference_absmax" in row:
            extra |= {"reference": reference, "reference_absmax": row["reference_absmax"]}
            extra["reference_share"] = row["reference_share"]
            also = f"{row['reference_absmax']:.4g} in the {reference} run"
        finding = near_limit_finding(
            op=row["op"],
            module=row["module"],
            phase="forward",
            call=row["call"],
            target=row["target"],
            share=row["share"],
            absmax=row["absmax"],
            dtype=row["dtype"],
            numel=math.prod(row["shape"]),
            location=row.get("location"),
            what_if=True,
            ran_in=label,
            also=also,
            evidence=extra,
        )
        found.append(finding)
    return found


__all__ = ["AT_RISK", "WATCH_SHARE", "OpRange", "OpRanges", "findings", "near_limit", "watched"]
