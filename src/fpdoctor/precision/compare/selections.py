"""Selections inside the model that the candidate's format changes, and the fix checked: a router's
top-k of experts, an argmax that picks a codebook entry, a k-th value that sets a threshold.

A selection rounds nothing itself: it picks. Where the scores it ranks lie closer together than
the format's spacing (a router's softmax over 8 experts near 1/8 in bf16: spacing 0.001), it picks
other elements than the fp64 run in some rows, and the code after it computes other things for
them (another expert's output, another codebook vector). No module or op is then far above its
floor, the module calls after it get other rows than in fp64 (their outputs cannot be compared),
and the end-to-end error looks made by accumulation. So where no part adds near the end-to-end error
by itself, compare runs the forward in fp64 and in the candidate under `Picks`, keys each selection
by its source line and call, and counts the rows where the candidate's indices differ from fp64's
(a top-k as a set: its order among near ties decides nothing; a comparison, each value). Where one
changed, the floor model's picks and the candidate's again, with the lines that made what each
ranks: the first selection that changes DECISION_SHARE of its rows or more, and CHANGED_RATIO times
the floor model's share, is tried: its line, then with those lines (nearest first), in fp32 with
their results cast back (engine.raising.RaisedLines), until a run leaves RAISED_FALLS fewer rows
changed and an end-to-end error ERROR_FALLS lower: the fix, and the evidence that the selection is
the cause. Without it, the finding says what changed and claims no cause.
"""

from __future__ import annotations

import linecache
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.engine.raising import ByTensor
from fpdoctor.precision.compare.nonfinite import line_of, source_text
from fpdoctor.precision.decide import DECISION_SHARE, pct
from fpdoctor.precision.profile import RAISED_FALLS, line_spans
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import EagerDispatchMode
from fpdoctor.userframes import user_location

aten = torch.ops.aten
# The ops that select, by overload: (position of the indices in the output, None where the output is
# them; position of the dim argument, None for a comparison, each of whose elements is a decision;
# whether the picks form a set, their order deciding nothing). A full sort is left out: its order
# among near ties flips in any format and decides nothing alone.
SELECTING: dict[Any, tuple[int | None, int | None, bool]] = {
    aten.topk.default: (1, 2, True),
    aten.argmax.default: (None, 1, False),
    aten.argmin.default: (None, 1, False),
    aten.max.dim: (1, 1, False),
    aten.min.dim: (1, 1, False),
    aten.kthvalue.default: (1, 2, False),
    # a threshold (a detector's score > 0.5, a gate's mask): each element a yes or no
    **{getattr(aten, op).Scalar: (None, None, False) for op in ("gt", "lt", "ge", "le")},
    **{getattr(aten, op).Tensor: (None, None, False) for op in ("gt", "lt", "ge", "le")},
}
COMPARING = frozenset({"gt", "lt", "ge", "le"})
# Ops that round a float to an integer, each element a decision of which integer: a bucket index
# (T5's relative positions, a value tokenizer's floor(x * 100), bucketize), fake quantization's round.
# A cast counts where it makes integers from floats; the others where they read floats.
ROUNDING = {
    aten._to_copy.default: "the cast to integers",
    aten.floor.default: "floor",
    aten.ceil.default: "ceil",
    aten.round.default: "round",
    aten.trunc.default: "trunc",
    aten.floor_divide.default: "floor_divide",
    aten.div.Tensor_mode: "div",  # rounding_mode="floor" or "trunc"
    aten.div.Scalar_mode: "div",
    aten.bucketize.Tensor: "bucketize",
    aten.searchsorted.Tensor: "searchsorted",
}
ROUNDS = frozenset(op.overloadpacket.__name__ for op in ROUNDING)
# The candidate changes a selection when it changes this many times the rows the floor model does
CHANGED_RATIO = 4.0
Key = tuple[str, str, int]  # a selection: its line, its op, its call at that line
UPSTREAM = 4  # lines kept per tensor of what made it, nearest first: the line sets tried
PAIRS = 1 << 24  # a top-k's picks are compared one by one up to this many pairs
KEPT = 1 << 22  # a comparison's decisions are kept up to this many (a mask over attention scores is not)
# A line set is the fix where the rows it gives back take the end-to-end error down this much at least
# (the rest may be the candidate's own rounding elsewhere, which a selection does not make)
ERROR_FALLS = 2.0
# Where no line set gives the picks back, one that gives back half of the rows at least (and lowers the
# error), and that no longer set betters, is the fix as far as the lines go (a router in fp32 whose
# remaining flips come from a norm's rounded output before it)
PARTIAL_FALLS = 2.0
PARTIAL_ERROR = 1.25  # and takes the end-to-end error down this much at least


@dataclass
class Pick:
    """One call of a selecting op: its indices, a row each (the selected dim last, a set sorted)."""

    op: str
    location: str  # file:line
    rows: torch.Tensor  # int64 [rows, picks]
    upstream: tuple[str, ...]  # the lines that made what it ranks, nearest first
    width: int = 1  # a comparison's: its output's last dim, its values a row each in `rows`
    module: str = ""  # the module call it ran in (a line several blocks share: the first that changed)


class Picks(EagerDispatchMode):
    """Records every selecting op's picks, keyed (line, op, its call at that line); with `upstream`,
    also each tensor's lines of origin (its own op's line, then its inputs', nearest first)."""

    def __init__(self, *, upstream: bool = False) -> None:
        super().__init__()
        self.picks: dict[Key, Pick] = {}
        self._calls: dict[tuple[str, str], int] = {}
        self._made: ByTensor | None = ByTensor() if upstream else None
        self.on = not upstream  # lines of origin are the model's: from its forward's start (`start`)
        self.modules: dict[str, list[tuple[str, torch.nn.Module]]] = {}  # line -> the modules it calls
        self.on_indices: set[str] = set()  # those called on integers (token ids)
        self.stack: list[str] = []  # the module calls in progress, innermost last (compare's hooks)

    def called(self, name: str, module: torch.nn.Module, *, indices: bool = False) -> None:
        """A module's call starts (a pre hook): which module the calling line runs (`indices`: on integers,
        token ids it embeds, which stay as they are)."""
        user = user_location(sys._getframe())
        if user is None:
            return
        called = self.modules.setdefault(f"{user[0]}:{user[1]}", [])
        if not any(name.startswith(f"{outer}.") for outer, _ in called) and all(n != name for n, _ in called):
            called.append((name, module))  # the outermost only: a Sequential's layers run from torch's code
            if indices:
                self.on_indices.add(name)

    def start(self) -> None:
        """The model's forward starts: what ran before (the inputs' cast to the run's dtype) made
        nothing the model's lines did."""
        self.on = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        spec = SELECTING.get(func)
        if func in ROUNDING and (func is not aten._to_copy.default or _integral(out)):
            spec = (None, None, False)  # each element a decision, as a comparison's
        if (spec is None and self._made is None) or not self.on:
            return out
        user = user_location(sys._getframe())
        if user is None:
            return out
        line = f"{user[0]}:{user[1]}"
        ups = self._lines(line, args) if self._made is not None else ()
        if self._made is not None:
            for t in _tensors(out):
                self._made.put(t, ups)
        source = args[0] if args else None
        if (
            spec is not None and isinstance(source, torch.Tensor) and source.is_floating_point()
            and (spec[1] is not None or source.numel() <= KEPT)
        ):  # fmt: skip
            key = (line, func.overloadpacket.__name__)
            n = self._calls.get(key, 0)
            self._calls[key] = n + 1
            made = self._made.get(source) if self._made is not None else None
            width = out.shape[-1] if spec[1] is None and isinstance(out, torch.Tensor) and out.dim() >= 2 else 1
            self.picks[(key[0], key[1], n)] = Pick(
                key[1], line, _rows(out, args, kwargs, spec), tuple(made or ()), width,
                self.stack[-1] if self.stack else "",
            )  # fmt: skip
        return out

    def _lines(self, line: str, args: Any) -> tuple[str, ...]:
        assert self._made is not None
        ups = [line]
        inputs = [self._made.get(t) or () for t in _tensors(args)]
        for i in range(UPSTREAM):
            for got in inputs:
                if i < len(got) and got[i] not in ups:
                    ups.append(got[i])
        return tuple(ups[:UPSTREAM])


def named(op: str) -> str:
    """An op as the finding names it: `topk`, or the cast to integers."""
    return "the cast to integers" if op == "_to_copy" else f"`{op}`"


def _integral(out: Any) -> bool:
    """A cast's output holds integers (not bool: a cast to bool is a != 0, which no rounding moves)."""
    return (
        isinstance(out, torch.Tensor)
        and not out.is_floating_point()
        and not out.is_complex()
        and (out.dtype is not torch.bool)
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _rows(out: Any, args: Any, kwargs: dict[str, Any], spec: tuple[int | None, int | None, bool]) -> torch.Tensor:
    at, dim_at, as_set = spec
    indices = out if at is None else out[at]
    if dim_at is None:  # a comparison: every element a row
        return indices.detach().reshape(-1, 1).clone()
    dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim", -1 if at is not None else None)
    if dim is None or indices.dim() == 0:  # argmax over everything: one pick
        return indices.detach().reshape(1, -1).clone()
    if indices.dim() < (args[0].dim() if isinstance(args[0], torch.Tensor) else 0):  # keepdim=False
        indices = indices.unsqueeze(dim)
    rows = indices.detach().movedim(dim, -1)
    rows = rows.reshape(-1, rows.shape[-1]) if rows.dim() else rows.reshape(1, 1)
    return rows.sort(-1).values if as_set else rows.clone()


def share_changed(
    picks: dict[Key, Pick], truth: dict[Key, Pick], key: Any, *, by_rows: int = 0
) -> tuple[int, int] | None:
    """(rows changed, rows) of the selection `key` against the fp64 run's; None where it has no
    counterpart of the same shape. `by_rows`: the output's classes; a comparison whose output's last dim
    is that many (a sampler's mask over the vocabulary) is counted as (values decided otherwise, rows): a
    few of each row's thousands of values move the row's set."""
    got, ref = picks.get(key), truth.get(key)
    if got is None or ref is None or got.rows.shape != ref.rows.shape:
        return None
    mine, theirs = got.rows.to(ref.rows.device), ref.rows
    if got.op in COMPARING and got.width > 1 and got.width == by_rows:
        return int((mine != theirs).sum()), theirs.numel() // got.width
    changed = int((mine != theirs).any(-1).sum())
    return changed, theirs.shape[0]


def picks_changed(got: Pick, ref: Pick) -> int | None:
    """How many of a top-k's picks are not among the fp64 run's in their row (None where the
    comparison would be large: rows x k x k past PAIRS)."""
    rows, k = ref.rows.shape
    if got.rows.shape != ref.rows.shape or rows * k * k > PAIRS:
        return None
    same = (got.rows.to(ref.rows.device)[:, :, None] == ref.rows[:, None, :]).any(-1)
    return int((~same).sum())


@dataclass
class Changed:
    """A selection the candidate changes, and its fix's check."""

    pick: Pick
    changed: int
    rows: int
    floor: float  # the floor model's share
    picks: int | None = None  # a top-k's picks that are not fp64's, where counted
    of: int = 0  # picks in all
    lines: list[tuple[str, int]] | None = None  # the lines whose fp32 run gives the picks back
    changed_after: int | None = None
    error_before: float = math.nan
    error_after: float | None = None
    tried: list[tuple[int, int | None]] | None = None  # (lines raised, rows changed then)
    given: bool = False  # the lines were checked on the inputs as given, not rounded by the cast first
    partial: bool = False  # the lines give back most of the rows (PARTIAL_FALLS), not all
    modules: dict[str, list[tuple[str, torch.nn.Module]]] | None = None  # line -> the modules it calls (Picks)
    by_rows: bool = False  # a comparison counted as values per row of its last dim (share_changed): `changed`
    # is then the values decided otherwise, `share` and `floor` per row
    on_indices: set[str] = field(default_factory=set)  # the modules its lines call on integers (Picks)

    @property
    def share(self) -> float:
        return self.changed / max(self.rows, 1)


def first_changed(
    cand: dict[Key, Pick], truth: dict[Key, Pick],
    floor: dict[Key, Pick] | None, *, by_rows: int = 0,
) -> tuple[Key, Changed] | None:  # fmt: skip
    """The candidate's first selection (in its forward's order) that changes DECISION_SHARE of its
    rows, two at least, and CHANGED_RATIO times the floor model's share (`by_rows`: share_changed's)."""
    for key, pick in cand.items():
        got = share_changed(cand, truth, key, by_rows=by_rows)
        if got is None:
            continue
        changed, rows = got
        base = share_changed(floor, truth, key, by_rows=by_rows) if floor is not None else (0, rows)
        floor_share = (base[0] / max(base[1], 1)) if base is not None else 0.0
        share = changed / max(rows, 1)
        if changed >= 2 and share >= DECISION_SHARE and share >= CHANGED_RATIO * max(floor_share, 1.0 / rows):
            ref = truth[key]
            picks = picks_changed(pick, ref) if pick.op == "topk" else None
            rowwise = pick.op in COMPARING and pick.width > 1 and pick.width == by_rows
            return key, Changed(pick, changed, rows, floor_share, picks, ref.rows.numel(), by_rows=rowwise)
    return None


# a run of the candidate with some lines in fp32 (on the inputs as given: True) and the picks recorded:
# (end-to-end error, its picks)
Check = Callable[[set[tuple[str, int]], bool], tuple[float | None, dict[Key, Pick]]]


def checked(key: Key, found: Changed, truth: dict[Key, Pick], check: Check, *, rounded_inputs: bool) -> None:
    """The selection's line, then with the lines that made what it ranks (nearest first), in fp32:
    the first set whose run leaves RAISED_FALLS fewer rows changed and an end-to-end error ERROR_FALLS
    lower is the fix (`found.lines`, its figures); every try is in `found.tried`. Where none does and
    the cast rounded the model's inputs (`rounded_inputs`: a raw reading standardised inside the
    model), the same sets on the inputs as given."""
    order = [found.pick.location, *(u for u in found.pick.upstream if u != found.pick.location)]
    places = [p for p in (line_of(u) for u in order) if p is not None]
    found.tried = []
    partial: tuple[list[tuple[str, int]], int, float] | None = None
    for given in (False, True) if rounded_inputs else (False,):
        for n in range(1, len(places) + 1):
            lines = places[:n]
            error, picks = check(set(lines), given)
            got = share_changed(picks, truth, key, by_rows=found.pick.width if found.by_rows else 0)
            if not given:
                found.tried.append((n, None if got is None else got[0]))
            if got is None or error is None or not math.isfinite(error):
                continue
            # a masked output's kept sets (by_rows) are what is judged, not the end-to-end error: the rest of a
            # bf16 LM before its sampler's filter keeps its own
            if got[0] * RAISED_FALLS <= found.changed and (found.by_rows or error * ERROR_FALLS <= found.error_before):
                found.lines, found.changed_after, found.error_after, found.given = lines, got[0], error, given
                return
            # some rows left: all given back without the error falling is a selection that does not make it
            halved = got[0] > 0 and got[0] * PARTIAL_FALLS <= found.changed
            fell = error * PARTIAL_ERROR <= found.error_before
            if not given and halved and fell and (partial is None or got[0] < partial[1]):
                partial = (lines, got[0], error)
    # none gave the picks back: the set that leaves the fewest rows changed (the first, of the fewest lines,
    # among equals; the rest changes further up: the model's inputs, a norm before it) is the fix as far as
    # it goes, with its figures
    if partial is not None:
        found.lines, found.changed_after, found.error_after = partial
        found.partial = True


def _in_fp32(name: str, module: torch.nn.Module, code: str, *, on_indices: bool = False) -> str:
    """How the code runs a module it calls in fp32 from the model's dtype: its function on fp32
    weights (a Linear), or the module kept in fp32; as the line `code` calls it where it can be read
    there (self.moe.router(h)), else by its name in the model."""
    parts = name.split(".")
    last = f"{parts[-2]}[{parts[-1]}]" if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
    call = _call_in(code, last)
    attr, arg = call if call is not None else (f"`{name}`", "its input")
    if isinstance(module, torch.nn.Linear):
        bias = f", {attr}.bias.float()" if module.bias is not None else ""
        held = (
            f"F.linear({arg}.float(), {attr}.weight.float(){bias})"
            if call
            else f"F.linear on fp32 copies of {attr}'s weights"
        )
        return held + (f" instead of {attr}({arg})" if call else "")
    if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) or on_indices:
        # its input is indices (token ids an LM embeds first): never cast
        return f"keep it in fp32 ({attr}.float() after the cast to the model's dtype), called on {arg} as it is"
    return f"keep it in fp32 ({attr}.float() after the cast to the model's dtype) and call it on {arg}.float()"


def _call_in(code: str, last: str) -> tuple[str, str] | None:
    """(the module as the line names it, its argument's text) where `code` calls `...{last}(arg)`
    with one argument; None where it cannot be read so."""
    found = re.search(r"([A-Za-z_][\w.]*\.)?" + re.escape(last) + r"\(", code)
    if found is None:
        return None
    depth, start = 0, found.end()
    for i in range(start, len(code)):
        if code[i] in "([{":
            depth += 1
        elif code[i] in ")]}":
            if depth == 0:
                arg = code[start:i].strip()
                return (found.group(0)[:-1], arg) if arg and "," not in arg else None
            depth -= 1
    return None


def _lines_text(lines: list[tuple[str, int]]) -> str:
    return line_spans([n for _, n in lines])


def finding(found: Changed, *, label: str, dtype: torch.dtype, reference: str) -> Finding:
    """NUM022 for a selection the candidate changes: its line, its rows, and the lines in fp32 that
    give its picks back, checked (or why none was found)."""
    pick = found.pick
    file, number = line_of(pick.location) or ("", 0)
    name = str(dtype).removeprefix("torch.")
    code = source_text(pick.location)
    code = code[: code.index("  #")].rstrip() if "  #" in code else code
    # the module call it ran in: a line of a block's code runs in every block, and the first that changed is named
    written = (f" (`{code}`)" if code else "") + (f" in `{pick.module}`" if pick.module else "")
    picked = f", {found.picks} of its {found.of} picks" if found.picks is not None and found.of > found.rows else ""
    share = (
        f"({found.share:.3g} a row; {reference}: {found.floor:.3g})"
        if found.by_rows
        else f"({pct(found.share)}{picked}; {reference}: {pct(found.floor)})"
    )
    fixed = found.lines is not None and found.error_after is not None
    unit_of = "values" if found.by_rows else "rows"
    cause = (
        f"Computed as the fix below says, {found.changed_after} of them are decided otherwise (the rest is rounded "
        f"further up); the end-to-end error goes from {found.error_before:.3g} to {found.error_after:.3g} (the values "
        "that move are small: what is drawn or decided from the set is what changes)."
        if fixed and found.by_rows else
        f"With the picks given back in {found.changed - (found.changed_after or 0)} of those {found.changed} {unit_of} "
        f"(the fix below), the end-to-end error goes from {found.error_before:.3g} to {found.error_after:.3g}: the "
        "rows it picks otherwise make part of it."
        if fixed and found.partial else
        f"With the picks given back (the fix below), the end-to-end error goes from {found.error_before:.3g} to "
        f"{found.error_after:.3g}: the rows it picks otherwise make it, not any op's rounding, so no module or op "
        "stands out."
        if fixed else
        f"Whether they make the end-to-end error ({found.error_before:.3g}) is not known: no change tried gave the "
        "picks back."
    )  # fmt: skip
    if pick.op in ROUNDS:
        message = (
            f"In {label}, {named(pick.op)} at line {number} of {file}{written} rounds {found.changed} of "
            f"{found.rows} values to another integer than the fp64 run {share}: the values it rounds lie closer to a "
            f"boundary than {name}'s spacing there, and what follows reads other integers for them (another bucket, "
            f"another row of a table). {cause}"
        )
    elif pick.op in COMPARING:
        counted = f"values over its {found.rows} rows" if found.by_rows else f"of {found.rows} values"
        message = (
            f"In {label}, `{pick.op}` at line {number} of {file}{written} decides the other way than the fp64 run "
            f"for {found.changed} {counted} "
            f"{share}: the values it compares lie closer to what they are "
            f"compared with than {name}'s spacing, and what follows computes otherwise for them. {cause}"
        )
    else:
        what = "a different set of elements" if pick.op == "topk" else "a different element"
        message = (
            f"In {label}, `{pick.op}` at line {number} of {file}{written} picks {what} than the fp64 run in "
            f"{found.changed} of {found.rows} rows {share}: the scores it ranks lie closer together than {name}'s "
            f"spacing, and the code after it computes other things for those rows (another expert, another entry; "
            f"the module calls after it get other rows than in fp64). {cause}"
        )
    unit, scores, mask = (
        ("values rounded otherwise", "values rounded", "; the integers stay as they are")
        if pick.op in ROUNDS
        else ("values decided otherwise", "values compared", "; a mask or indices stay as they are")
        if pick.op in COMPARING
        else ("rows picked differently", "scores", "; the indices stay as they are")
    )
    evidence: dict[str, Any] = {
        "location": pick.location, "op": pick.op, "rows": found.rows, "rows_changed": found.changed,
        "share_changed": found.share, "floor_share": found.floor, "picks_changed": found.picks,
        **({"by_rows": True} if found.by_rows else {}),
        "upstream_lines": list(pick.upstream),
        "error_before": found.error_before,
    }  # fmt: skip
    where = {"module": pick.module or None, "op": f"aten.{pick.op}", "phase": "forward"}
    if not fixed or found.lines is None or found.changed_after is None or found.error_after is None:
        tried = ", ".join(f"{n} line{'s' if n > 1 else ''}: {'-' if c is None else c}" for n, c in found.tried or [])
        most = max((n for n, c in found.tried or [] if c is not None), default=0)  # over the runs that completed
        fix = (
            f"no line in fp32 is the fix: the {scores} {named(pick.op)} reads were computed in fp32 from 1 to {most} "
            f"lines upstream (rows changed with {tried or 'no run'}) and the picks stayed changed. They are "
            "rounded further up (a norm, the model's inputs), or fed back: a loop that feeds its own picks back "
            "(greedy decoding) parts at the first near-tie and every pick after it follows, so judge each step "
            "teacher-forced (a make() that returns the scores over a fixed sequence, one forward); `fpdoctor plan "
            "--metric top1` searches the modules to keep in fp32"
            if most
            else f"compute what {named(pick.op)} reads in fp32 (its operands .float(), the {scores} in fp32, made so "
            f"where they are first computed) and cast what it feeds back to {name}: no run checked it"
        )
        trial = Trial.untried(
            f"the sets of 1 to {most} lines upstream of it, in fp32, were tried and none gave the picks back"
            if most
            else "no set of lines upstream of it could be run in fp32"
        )
        return catalog.make("selection-changed", message=message, fix=fix, where=where, evidence=evidence, trial=trial)
    lines = _lines_text(found.lines)
    after_share = found.changed_after / max(found.rows, 1)
    shown = (lambda x: f"{x:.3g} a row") if found.by_rows else pct
    calls = [(n, name, module) for f, n in sorted(found.lines, key=lambda x: x[1])
             for name, module in (found.modules or {}).get(f"{f}:{n}", [])]  # fmt: skip
    modules = "".join(
        f"; line {n} calls `{name}`: "
        f"{_in_fp32(name, module, linecache.getline(file, n).strip(), on_indices=name in found.on_indices)}"
        for n, name, module in calls
    )
    evidence |= {"lines_raised": sorted({n for _, n in found.lines}), "rows_changed_after": found.changed_after,
                 "error_after": found.error_after}  # fmt: skip
    given = (
        f"pass the model's inputs in fp32 (not cast to {name} before the forward: the cast rounds what these lines "
        f"read), cast to {name} (.to(p.dtype), p a parameter) wherever else the model reads them, and "
        if found.given
        else ""
    )
    fix = (
        f"{given}compute {lines} of {file} in fp32 (their operands .float(): the {scores} and {named(pick.op)} on fp32 "
        f"values{modules}) and cast what they produce back to {name} (.to(x.dtype){mask}); checked: {unit} "
        f"{shown(found.share)} -> {shown(after_share)}, the end-to-end error {found.error_before:.3g} -> "
        f"{found.error_after:.3g}"
        + ("; then `fpdoctor compare --inputs-as-given` checks the changed model fed its inputs as they are"
           if found.given else "")
        + (f"; these lines do not give back the other {found.changed_after} {unit_of} (what they rank is rounded "
           "further up: a norm, the model's inputs)" if found.partial else "")
    )  # fmt: skip
    trial = Trial.checked(
        ("the inputs fed in fp32, " if found.given else "")
        + f"the ops at {lines} of {file} in fp32, their results cast back to {name}",
        metric=f"{unit} by {named(pick.op)} than in fp64",
        before=shown(found.share),
        after=shown(after_share),
        on="the inputs given",
    )
    return catalog.make("selection-changed", message=message, fix=fix, where=where, evidence=evidence, trial=trial)
