"""Ops whose algorithm, not their format, loses the precision, and the stable form torch offers.

`torch.cdist` computes Euclidean distances as ||x||^2 + ||y||^2 - 2 x.y (a matrix product) once
either side has more than 25 rows: where the points sit far from the origin (raw sensor readings
near 1000, coordinates) the three terms are large and nearly cancel, so fp32 keeps a few digits of
a distance of a few units, and fp16 overflows the squared norms. The direct form (differences
first) has neither problem, and torch offers it by an argument. Each entry names the aten op the
own-op check reports, the Python function the user called, and the argument that selects the
stable form; compare re-runs the candidate with it (under a TorchFunctionMode that adds the
argument to every such call, for that forward only) and prints the edit where that run is checked
to take the error down.

Some losses are made by two calls, each exact enough alone: an op applied to what another made,
which torch computes in one function that never forms the lost value (`COMPOSED`). The log of a
determinant (a 200x200 covariance's det underflows fp32 long before its log would), the log of
1 + x (x under the format's spacing at 1 is rounded away), 1 - exp(-y) (exp of a small y rounds
to 1), the log of a softmax or a sigmoid (small probabilities flush to 0, their log is -inf), the
angle acos(u . v) between unit vectors (near 0 degrees the cosine rounds to 1). `Composed` runs a
forward with each such pair computed by its stable form, where the pair occurs; compare prints the
edit where that run is checked to take the error down.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fpdoctor.userframes import frame_location, user_frame


@dataclass(frozen=True)
class StableForm:
    op: str  # the aten overload the own-op check names
    function: Callable[..., Any]  # what the user's code calls
    call: str  # its name in the user's code
    # what selects the stable form (torch.cdist hands its arguments to the mode as keywords, positional or not)
    kwargs: dict[str, Any] = field(default_factory=dict)
    why: str = ""


FORMS = (
    StableForm(
        op="aten._euclidean_dist.default",
        function=torch.cdist,
        call="torch.cdist",
        kwargs={"compute_mode": "donot_use_mm_for_euclid_dist"},
        why=(
            "computes distances as ||x||^2 + ||y||^2 - 2 x.y (a matrix product) for more than 25 rows, which cancels "
            "where the points sit far from the origin"
        ),
    ),
)


def form_for(op: str | None) -> StableForm | None:
    return next((f for f in FORMS if f.op == op), None)


class Rewritten(TorchFunctionMode):
    """The calls of `form.function` made from `location` ("file:line", the line the fix names; every
    call where None) made with the stable form's arguments, while the mode is active."""

    def __init__(self, form: StableForm, location: str | None = None) -> None:
        super().__init__()
        self.form, self.location = form, location
        self.lines: list[str] = []  # the user's lines whose calls it rewrote, in the order first rewritten

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is self.form.function:
            found = frame_location(user_frame(sys._getframe(1)))
            line = f"{found[0]}:{found[1]}" if found is not None else "?"
            if self.location is None or line == self.location:
                kwargs = {**kwargs, **self.form.kwargs}
                if line not in self.lines:
                    self.lines.append(line)
        return func(*args, **kwargs)


def fix_text(form: StableForm, locations: list[str]) -> str:
    at = f" at {' and '.join(locations)}" if locations else ""
    args = ", ".join(f"{k}={v!r}" for k, v in form.kwargs.items())
    return (
        f"Pass {args} to {form.call}{at}: it {form.why}; the stable form computes the differences first (or subtract "
        "a common centre, such as the mean of the points, from both sides first: distances do not change)"
    )


@dataclass(frozen=True)
class Pair:
    """Two calls whose composition loses what one function of torch computes directly."""

    name: str  # the pair, as the finding names it
    edit: str  # the edit, the stable form in place of the pair ({dtype}: the candidate's format)
    why: str  # what the pair loses, in the format


COMPOSED = {
    "logdet": Pair(
        "the log of a determinant",
        "torch.logdet(A) in place of torch.log(torch.linalg.det(A))",
        "a large matrix's determinant is a product of its eigenvalues, which under- or overflows {dtype} long "
        "before its log would",
    ),
    "log1p": Pair(
        "the log of 1 + x",
        "torch.log1p(x) in place of torch.log(1 + x)",
        "1 + x rounds x away where it is under {dtype}'s spacing at 1",
    ),
    "expm1": Pair(
        "1 minus an exp",
        "-torch.expm1(-y) in place of 1 - torch.exp(-y) (torch.expm1(y) in place of torch.exp(y) - 1)",
        "exp of a small value rounds to 1 in {dtype}, and 1 minus it to 0 or a few steps of {dtype}'s spacing",
    ),
    "log_softmax": Pair(
        "the log of a softmax",
        "torch.log_softmax(x, dim) in place of torch.log(torch.softmax(x, dim))",
        "small probabilities flush to 0 in {dtype}, and their log is -inf",
    ),
    "logsigmoid": Pair(
        "the log of a sigmoid",
        "torch.nn.functional.logsigmoid(x) in place of torch.log(torch.sigmoid(x))",
        "a sigmoid of a large negative value flushes to 0 in {dtype}, and its log is -inf",
    ),
    "angle": Pair(
        "acos of a dot product of unit vectors",
        "2 * torch.atan2((u - v).norm(dim=d), (u + v).norm(dim=d)) in place of torch.acos((u * v).sum(d)) "
        "(u, v the unit vectors; of a cosine similarity, u and v normalised first: F.normalize(x, dim=d))",
        "near 0 (or 180) degrees the cosine rounds to 1 in {dtype}, and small angles come out 0",
    ),
}
RECENT = 64  # first calls of a pair held at once
UNIT = 1e-2  # vectors whose norms are this close to 1 are unit vectors: acos of their dot product is their angle


class Composed(TorchFunctionMode):
    """The pairs of `COMPOSED` computed by their stable forms where the forward makes them, while the
    mode is active; `lines` says which pair it rewrote at which of the user's lines."""

    def __init__(self, only: set[str] | None = None) -> None:
        super().__init__()
        # a tensor a pair's first call made (by id) -> its weak reference, its write count then, and what the stable
        # form needs of it; dropped when it dies (what it holds with it), and the latest RECENT only
        self.made: dict[int, tuple[weakref.ref[torch.Tensor], int, tuple[Any, ...]]] = {}
        self.lines: dict[str, str] = {}  # "file:line" of the second call -> the pair's key
        self.only = only  # the lines whose pairs are rewritten (None: every line)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        entry = self.made.get(id(first)) if first is not None else None
        # written in place since (a softmax then add_, p[0] = 1): no longer what the pair's first call made
        held = (
            entry[2]
            if entry is not None and first is not None and entry[0]() is first and first._version == entry[1]
            else None
        )
        if held is not None:
            found = frame_location(user_frame(sys._getframe(1)))
            line = f"{found[0]}:{found[1]}" if found is not None else "?"
            try:
                stable = _stable(name, held, args, kwargs) if self.only is None or line in self.only else None
            except Exception:  # a shape the stable form does not take: the call as written
                stable = None
            if stable is not None:
                self.lines.setdefault(line, held[0])
                return stable
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            made = _made(name, held, args, kwargs)
            if made is not None:
                key = id(out)
                self.made[key] = (weakref.ref(out, self._dropper(key)), out._version, made)
                if len(self.made) > RECENT:
                    del self.made[next(iter(self.made))]
        return out

    def _dropper(self, key: int) -> Callable[[weakref.ref[torch.Tensor]], None]:
        """What drops a tensor's entry when it dies (what the entry holds with it)."""

        def drop(_: weakref.ref[torch.Tensor]) -> None:
            self.made.pop(key, None)

        return drop


def _made(name: str, held: tuple[Any, ...] | None, args: Any, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a call's output holds for a stable form of a pair it may start (None: nothing)."""
    x = args[0] if args else None
    if name in ("det", "linalg_det"):
        return ("logdet", x)
    if name in ("add", "__add__", "__radd__") and len(args) == 2 and _one(args[1]) and not kwargs:
        return ("log1p", x)
    if name == "exp":
        return ("expm1", x)
    if name == "softmax":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        plain = len(args) <= 2 and kwargs.get("dtype") is None  # a dtype (by position too) changes the result's
        return ("log_softmax", x, dim) if isinstance(dim, int) and plain else None
    if name == "sigmoid":
        return ("logsigmoid", x)
    if name in ("mul", "__mul__") and len(args) == 2 and isinstance(args[1], torch.Tensor) and not kwargs:
        return ("product", x, args[1])
    if name == "sum" and held is not None and held[0] == "product":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        keep = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        plain = len(args) <= 3 and kwargs.get("dtype") is None
        return ("angle", held[1], held[2], dim, keep) if isinstance(dim, int) and plain else None
    if name == "cosine_similarity" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
        return ("angle", args[0], args[1], dim, False, True) if isinstance(dim, int) else None
    if name == "clamp" and held is not None and held[0] == "angle":
        bounds = (
            kwargs.get("min", args[1] if len(args) > 1 else None),
            kwargs.get("max", args[2] if len(args) > 2 else None),
        )
        return held if bounds in ((-1, 1), (-1.0, 1.0)) else None  # a cosine clamped to [-1, 1] on its way to acos
    return None


def _one(value: Any) -> bool:
    """The Python number 1 (not a tensor: its `in` would compare it elementwise)."""
    return type(value) in (int, float) and value == 1


def _stable(name: str, held: tuple[Any, ...], args: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The second call of a pair, computed by the stable form from what the first one read; None where
    this call does not complete a pair (or the stable form does not apply to these values)."""
    kind, x = held[0], held[1]
    if kind == "logdet" and name == "log" and not kwargs:
        return torch.logdet(x)
    if kind == "log1p" and name == "log" and not kwargs:
        return torch.log1p(x)
    if kind == "expm1" and name in ("__rsub__", "rsub") and len(args) == 2 and _one(args[1]) and not kwargs:
        return -torch.expm1(x)
    if kind == "expm1" and name in ("sub", "__sub__") and len(args) == 2 and _one(args[1]) and not kwargs:
        return torch.expm1(x)
    if kind == "log_softmax" and name == "log" and not kwargs:
        return torch.log_softmax(x, held[2])
    if kind == "logsigmoid" and name == "log" and not kwargs:
        return torch.nn.functional.logsigmoid(x)
    if kind == "angle" and name == "acos" and not kwargs:
        u, v, dim, keep = held[1], held[2], held[3], held[4]
        if len(held) > 5:  # a cosine similarity: of any vectors, the angle of their directions
            u, v = torch.nn.functional.normalize(u, dim=dim), torch.nn.functional.normalize(v, dim=dim)
        with torch.no_grad():
            unit = all(
                math.isfinite(off := float((t.double().norm(dim=dim) - 1).abs().max())) and off <= UNIT for t in (u, v)
            )
        if not unit:  # acos of a dot product of other vectors is no angle: left as written
            return None
        angle = 2 * torch.atan2((u - v).norm(dim=dim), (u + v).norm(dim=dim))
        return angle.unsqueeze(dim) if keep else angle
    return None


def composed_text(kinds: dict[str, str], dtype: str) -> tuple[str, str]:
    """The title's words and the fix for the pairs a run rewrote (line -> pair)."""
    by_pair: dict[str, list[str]] = {}
    for line, kind in kinds.items():
        by_pair.setdefault(kind, []).append(line)
    names = " and ".join(COMPOSED[k].name for k in by_pair)
    fix = "; ".join(
        f"at {' and '.join(lines)}, compute {COMPOSED[k].name} by its stable form: {COMPOSED[k].edit}"
        for k, lines in by_pair.items()
    )
    return names, fix[0].upper() + fix[1:]


def composed_why(kinds: dict[str, str], dtype: str) -> str:
    """What each pair a run rewrote loses in `dtype`, in one clause."""
    return "; ".join(COMPOSED[k].why.format(dtype=dtype) for k in dict.fromkeys(kinds.values()))
