"""Experiments that decide why an op produced NaN/Inf from finite inputs, and check the fix.

At the first op that produced a non-finite value, the op is re-run on the inputs it read:
  as it ran    same dtype, same device: a finite result means the device or a library computed
               something else the first time (any op: fused and custom kernels included);
  in fp64      from the same inputs: non-finite again means the math itself overflows or divides
               by zero, unless the inputs were already ruined upstream, which the walk finds;
  upstream     the dataflow above the op (the provenance of its inputs) is walked back one op at
               a time, nearest first; at each op O the chain from O down to the failing op (O and
               the ops between them that depend on O) is re-run in fp64, everything else as it
               was. The first O whose chain comes out finite is the origin: the op whose precision
               lost the information (a cast that rounds positions, a constant that rounds to zero
               in the compute dtype, a reduction in fp16); the failing op itself when its own fp64
               run is finite. Before an origin is named, the same chain re-run as it ran must
               still be non-finite, so that a stale input cannot pass for a cause.
The fix is then checked: the chain in fp32 (fp64 where the op ran in fp32), with the failing op's
largest magnitude before and after.

What is re-run comes from `Window`: references (not copies) to the arguments of the last ops,
taken by the tracer as it records them, so a healthy run pays one append per op and the memory
of tensors it still held a few hundred ops earlier, up to WINDOW_BYTES (benchmarks/README.md).
Experiments run only at the first NaN and the first Inf producer of a trace, under a time budget,
never on the user's tensors (ops that write their arguments are run on copies) and never with
seeded randomness (it would move the user's RNG).
"""

from __future__ import annotations

import linecache
import math
import os
import re
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.numerics.engine import stable
from fpdoctor.numerics.observe.loader import bad_rows, last_batch, rows_found, rows_text, standing_out
from fpdoctor.numerics.observe.records import Record
from fpdoctor.numerics.observe.values import checkable, dtype_name
from fpdoctor.report.model import Trial
from fpdoctor.torchprivate import defined_at, tree_flatten, tree_unflatten
from fpdoctor.userframes import is_user_file

WINDOW = 512  # ops whose arguments stay referenced, for the upstream walk
WINDOW_BYTES = 256 * 2**20  # and at most this many bytes of their tensor arguments (see Window)
MAX_ANCESTORS = 64  # ops of the walk, nearest first
SELECTIONS = 64  # the latest selections (gather, index) followed as aliases, for re-runs (Window.select)
BUDGET_S = 2.0  # seconds the experiments of one producer may take
PRODUCERS = 4  # producers of each kind (NaN, Inf) experimented on: the first may be a deliberate mask
PRODUCER_LINES = 8  # and the first producer of each op and line, up to this many in all
# Forward ops whose gradient is infinite at a finite input (sqrt and x ** p, 0 < p < 1, at 0; acos and
# asin at +-1): a higher precision only moves the point where the inputs round onto it, and values that
# keep growing reach it again. Their backward is checked with the point kept out (`guard`).
SINGULAR = frozenset({"sqrt", "pow", "acos", "asin"})
# the guard's bound for sqrt and x ** p, an eps each format holds with room: what `x.clamp_min(eps)` writes
GUARD_EPS = {torch.float16: 1e-4, torch.bfloat16: 1e-12, torch.float32: 1e-12}
_NARROW = (torch.float16, torch.bfloat16)
_REDUCTIONS = frozenset({"sum", "mean", "cumsum", "prod", "norm", "linalg_vector_norm", "var", "std"})
_CASTS = frozenset({"_to_copy", "to", "copy", "copy_", "_to_dtype"})
# ops that pick some of a composite's values (InfoNCE's exp(s).diag() / exp(s).sum(1)): a stable form
# computed whole and then picked the same way is finite where it is, so they are passed over in a form
PICKS = frozenset({
    "diagonal", "diagonal_copy", "select", "select_copy", "slice", "slice_copy", "index", "index_select",
    "gather", "narrow", "take", "masked_select",
})  # fmt: skip
_ANY = frozenset({"nan", "inf"})


@dataclass(slots=True)
class Step:
    """One op the window remembers: its record and the arguments it was called with."""

    record: Record
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] | None


class Window:
    """The last `WINDOW` ops' arguments, by reference (see the module docstring), and no more than
    about `WINDOW_BYTES` of tensor arguments: a reference keeps alive a temporary the program let go
    (benchmarks/bench_experiment_window.py measures what that costs). The bytes counted are each
    op's own tensor arguments other than parameters (leaves that want gradients, alive anyway),
    a tensor used by several ops counted at each: an upper bound of what the window holds alone."""

    def __init__(self, size: int = WINDOW, max_bytes: int | None = None) -> None:
        # (record, func, args, kwargs): a tuple, the cheapest thing to append once per op
        self.steps: deque[tuple[Record, Any, Any, Any]] = deque()
        self.sizes: deque[int] = deque()
        self.bytes = 0
        self.size = size
        self.max_bytes = WINDOW_BYTES if max_bytes is None else max_bytes
        self.selections: dict[int, tuple[Any, Any, Any, Any]] = {}  # id(out) -> (weakref, func, args, kwargs)
        self.selection_sizes: dict[int, int] = {}
        self.selection_bytes = 0

    def append(self, step: tuple[Record, Any, Any, Any]) -> None:
        """The tracer's hot path calls this once per op."""
        size = 0
        for a in step[2]:
            if isinstance(a, torch.Tensor) and not (a.requires_grad and a.is_leaf):
                size += a.nbytes
        steps, sizes = self.steps, self.sizes
        steps.append(step)
        sizes.append(size)
        self.bytes += size
        while len(steps) > 1 and (len(steps) > self.size or self.bytes > self.max_bytes):
            steps.popleft()
            self.bytes -= sizes.popleft()

    def clear(self) -> None:
        self.steps.clear()
        self.sizes.clear()
        self.bytes = 0
        self.selections.clear()
        self.selection_sizes.clear()
        self.selection_bytes = 0

    def select(self, out: torch.Tensor, func: Any, args: Any, kwargs: Any) -> None:
        """A selection the tracer follows as an alias of what it selects from (gather, index): kept
        so that a re-run can select the same values from its recomputed source (SELECTIONS of them,
        holding at most a quarter of WINDOW_BYTES of sources: a gather from an LM's logits keeps
        those logits alive)."""
        size = sum(a.nbytes for a in args if isinstance(a, torch.Tensor) and not (a.requires_grad and a.is_leaf))
        limit = self.max_bytes // 4
        if size > limit:
            return
        selections, sizes = self.selections, self.selection_sizes
        selections[id(out)], sizes[id(out)] = (weakref.ref(out), func, args, kwargs), size
        self.selection_bytes += size
        while len(selections) > SELECTIONS or self.selection_bytes > limit:
            oldest = next(iter(selections))
            del selections[oldest]
            self.selection_bytes -= sizes.pop(oldest)

    def by_index(self) -> dict[int, Step]:
        return {s[0].index: Step(*s) for s in self.steps}


@dataclass
class OnLoss:
    """The step's loss re-run with the step's fixes in place (on_loss.py)."""

    loss: str  # "aten.mean.default at train.py:31"
    before: str  # what it was: "nan", "inf"
    after: float | None  # what it is with the fixes: None where still non-finite
    changed: str  # the changes, as the fix says them
    left: str | None = None  # what is still non-finite: "nan", "inf"
    # "loss": the loss was non-finite; "gradients": it was finite, the gradients its backward sends out
    # of the re-run ops were not, and `after` is the loss where they are finite with the changes
    judged: str = "loss"
    exact: float | None = None  # the same ops as written, in fp64: what the loss is meant to be
    # the loss made finite, the gradients its backward sends through the changed ops are still non-finite
    # (the exp of an importance ratio fixed in the forward, its gradient past fp16's range in the backward)
    gradients_left: bool = False


@dataclass
class Experiment:
    """What was re-run at a producer, and what it decided."""

    op: str
    dtype: str
    # device-or-library, the-math, opaque (a custom op non-finite in fp64 too), data (rows of the batch), origin,
    # not-decided
    verdict: str
    as_ran: str | None = None  # "non-finite again", "finite", or why it was not re-run
    fp64: str | None = None  # the op alone in fp64 from the same inputs
    origin: Record | None = None
    chain: list[Record] = field(default_factory=list)  # ops re-run in higher precision, in order
    checked_in: str | None = None  # the precision the fix was checked in
    absmax_before: float | None = None
    absmax_after: float | None = None
    # the origin's output is a parameter's gradient as it is stored (trace's sinks): no op after it brings it in range
    stored: bool = False
    literal: tuple[float, float, str] | None = None  # a constant that rounds: value, rounded, dtype
    bf16: str | None = None  # an fp16 chain re-run in bf16 (fp32's range): "finite" or "non-finite"
    bf16_absmax: float | None = None  # the symptom op's max |x| in that re-run
    literal_fix: tuple[float, float] | None = None  # a constant the dtype holds, tried as it ran: value, max |x|
    cast: str | None = None  # what a rounding cast did to its values
    # a cast that made Inf of values past its format's range, tried holding the format's largest value
    # instead (what writing torch.finfo(x.dtype).min does): that value and the symptom op's max |x| then
    saturated_fix: tuple[float, float] | None = None
    autocast_cast: bool = False  # a cast past the format's range that no line writes (autocast's, of an input)
    autocast_data: bool = False  # ... of data the model is fed (no op made it): features in large units
    # a cast the script writes of data past the format's range (a batch's targets or features in large units,
    # nothing autograd records): their largest |value|, which no precision of the cast alone makes room for
    data_cast: float | None = None
    stable: stable.Checked | None = None  # the chain is a composite with a stable form, checked (stable.py)
    completed: list[Record] = field(default_factory=list)  # its ops, where the form ran on past the chain
    # the walk reached a random draw made in a narrow dtype, and a fresh fp32 draw cures the chain:
    # (its dtype, its largest value below 1 for a uniform draw or None, the symptom op's max |x| then)
    draw: tuple[str, float | None, float] | None = None
    walked: int = 0  # upstream ops tried
    symptom: frozenset[str] = frozenset({"nan", "inf"})  # what the op made that its inputs did not hold
    handed: bool = False  # its inputs held a non-finite value already, which passes through
    rows: dict[str, Any] | None = None  # the batch rows (dim 0) that hold the symptom, where only some do
    # rows of an argument far out of line with the others that alone make the symptom (_outlier_rows)
    outliers: dict[str, Any] | None = None
    note: str | None = None  # why the walk stopped short
    on_loss: OnLoss | None = None  # the step's loss re-run with the step's fixes in place (on_loss.py)
    # the backward of a SINGULAR op: the printed guard's eps, and the derivative at its bound (_try_guard)
    guard: tuple[float, float] | None = None
    # a division non-finite in fp64 too, re-run with its denominator + eps: eps, max |x| (_try_divisor)
    divisor_guard: tuple[float, float] | None = None
    # the backward of a log of a softmax's (or sigmoid's) values: its stable form, the lines it replaces, what the
    # log's backward reached and the most the stable form's hands back on this step's values (_log_of_probs)
    log_form: tuple[str, str, list[Record], float] | None = None

    def evidence(self) -> dict[str, Any]:
        """`evidence.experiment`: what was re-run, in which precision, with which result."""
        found: dict[str, Any] = {"op": self.op, "dtype": self.dtype, "verdict": self.verdict}
        if self.as_ran is not None:
            found["rerun_as_ran"] = self.as_ran
        if self.fp64 is not None:
            found["rerun_fp64"] = self.fp64
        found["upstream_ops_tried"] = self.walked
        if self.origin is not None:
            found["origin"] = {"op": self.origin.op, "location": _where(self.origin), "module": self.origin.module}
            found["rerun_in_higher_precision"] = [f"{r.op} ({_where(r) or 'no source line'})" for r in self.chain]
        if self.checked_in is not None:
            found["fix_checked"] = {
                "precision": self.checked_in,
                "absmax_before": self.absmax_before,
                "absmax_after": self.absmax_after,
                "finite_after": True,
            }
        if self.literal is not None:
            found["constant"] = {"value": self.literal[0], "rounded": self.literal[1], "dtype": self.literal[2]}
            if self.literal_fix is not None:
                found["constant"]["replacement_checked"] = self.literal_fix[0]
        if self.cast is not None:
            found["cast"] = self.cast
        if self.saturated_fix is not None:
            found["cast_saturated_checked"] = self.saturated_fix[0]
        if self.bf16 is not None:
            found["rerun_bf16"] = self.bf16
        if self.guard is not None:
            found["guard_checked"] = {"eps": self.guard[0], "absmax_after": self.guard[1]}
        if self.note:
            found["note"] = self.note
        if self.rows is not None:
            found["rows"] = self.rows
        if self.outliers is not None:
            found["rows_standing_out"] = self.outliers
        return found

    def rows_text(self) -> str:
        """' It is in rows 3, 7 of the 16 along dim 0 ...', or '' where every row holds it."""
        return rows_text(self.rows)

    def word(self, title: str, message: str, fix: str, label: str, name: str = "") -> tuple[str, str, str, Trial]:
        """The finding's title, message and fix as the experiment decided them, and the fix's trial;
        `name`: the op as the title names it (a backward op by its forward op), else the op."""
        parts = [f"re-run as it ran: {self.as_ran}"] + (
            [f"in fp64 from the same inputs: {self.fp64}"] if self.fp64 else []
        )
        tried = " Experiment: " + "; ".join(parts) + "."
        if not transparent_op(self.op) and "defined by" not in message and "registered at" not in message:
            tried += f" {self.op} is {whose(self.op)}."  # whose kernel it is: the user's, the environment's
        if self.verdict == "device-or-library":
            return (
                # a title that already says arithmetic cannot produce it (bounds.py) stays: both agree
                title
                if "arithmetic cannot" in title
                else f"{label}: {self.op} produced a non-finite value its own re-run does not reproduce",
                message + tried + " The same op on the same inputs, same dtype and device, gave a finite "
                "result: the device or the library computed something else the first time, not this code.",
                _DEVICE,
                Trial.untried(
                    f"the fix is a check of the device or library; what decided it was run: {self.op} re-run as "
                    "it ran, on the inputs it read, gave a finite result"
                ),
            )
        if self.verdict == "the-math":
            upstream = (
                f" Re-running the {self.walked} ops above it in fp64 did not remove it either." if self.walked else ""
            )
            if self.stable is not None and self.stable.scaled:  # log(cosh(x)) past fp64's cosh: the form is the fix
                return (
                    f"{label}: {name or self.op} is non-finite in fp64 too, and its stable form is finite",
                    message + tried + upstream + " No precision change is the fix; a form without the overflow is.",
                    *self._stable_fix(_lines(self.form_records)),
                )
            advice = _without_precision(fix)
            trial = Trial.untried(
                "a change to the math at the source line, which fpdoctor does not write; what was tried is "
                f"every precision change: in fp64 {self.op} is non-finite too"
            )
            if self.divisor_guard is not None:
                eps, after = self.divisor_guard
                trial = Trial.checked(
                    f"the denominator plus eps = {eps:g}",
                    metric=f"{self.op}'s output, max |x|",
                    before="nan" if "nan" in self.symptom else "inf",
                    after=after,
                    on="this step's inputs, as the op ran",
                )
            return (
                # a title that says which non-finite input it turned into NaN (a masked row) stays
                title
                if " turned " in title
                else f"{label}: {name or self.op} is non-finite in fp64 too: {_math_cause(self.op, self.symptom)}",
                message + tried + upstream + " No precision change is the fix.",
                (f"{advice}. " if advice else "Change the math at the source line: ")
                + "Not a precision change: tried, in fp64 this op is non-finite too, so fp32 will not help.",
                trial,
            )
        if self.verdict == "opaque":
            return (
                f"{label}: custom op {self.op} made a non-finite value, again when re-run and in fp64",
                message + tried + f" {self.op} is not an aten op: its fp64 run is its own kernel again, so no "
                "re-run can tell its math from its implementation. Its inputs are in the finding's evidence: a "
                "non-finite output from finite, moderate inputs points at the kernel (a fused epilogue, a custom "
                "CUDA or Triton kernel), not at this code's arithmetic.",
                custom_op_fix(self.op, None),
                Trial.untried(
                    f"{self.op} is a custom op: fpdoctor can only run its own kernel again (as it ran and in fp64, "
                    "both non-finite), not a reference to measure a fix against"
                ),
            )
        if self.verdict == "data" and self.outliers is not None:
            return self._word_data(label, message + tried)
        if self.verdict == "draw" and self.origin is not None and self.draw is not None:
            return self._word_draw(label, message + tried)
        if self.verdict == "origin" and self.origin is not None:
            return self._word_origin(label, message + tried, fix)
        reason = self.note or "the op could not be re-run in higher precision"
        if not transparent_op(self.op):  # a custom kernel: arithmetic advice would be a guess
            fix = custom_op_fix(self.op, self.as_ran)
        return title, message + tried + (f" {self.note}" if self.note else ""), fix, Trial.untried(reason)

    def _word_data(self, label: str, message: str) -> tuple[str, str, str, Trial]:
        """A few rows of the batch far out of line with the others make it alone (checked on the
        other rows): the data is the origin, and the fix is the data's, never a precision change."""
        rows = self.outliers
        assert rows is not None
        indices, items = rows["indices"], rows.get("dataset_indices")
        one = len(indices) == 1
        what = ("row " if one else "rows ") + ", ".join(str(i) for i in indices[:8])
        named = ", ".join(str(i) for i in (items or [])[:8])
        item_text = f" (dataset item{'' if one else 's'} {named})" if items else ""
        kind = "nan" if "nan" in self.symptom else "inf"
        op_rows = rows.get("op_rows", indices)
        cut = ("row " if len(op_rows) == 1 else "rows ") + ", ".join(str(i) for i in op_rows[:8])
        where = f"dataset[{named}]" if one and items else f"dataset items {named}" if items else f"the items in {what}"
        fix = (
            f"Find and repair or drop {where} ({what} of the batch at this step): its values reach "
            f"{_num(rows['largest'])} where every other row stays within {_num(rows['others_largest'])} (a reading "
            "written wrong, a unit error, an item not normalised). A check where the Dataset reads an item "
            "(`assert torch.isfinite(x).all() and x.abs().max() < LIMIT, index`) names every such item; bounding "
            "the inputs (a clamp, or standardising with statistics computed without it) keeps one bad item from "
            "breaking a step. Not a precision change: the other rows are finite in this precision as it ran."
        )
        alone = "that row alone makes it" if len(op_rows) == 1 else "those rows alone make it"
        through = rows.get("through")
        if through is not None:  # an optimizer's op, on the gradient a backward op made from those rows
            backward = f"{through['op']}'s backward"
            rerun = (
                f" The gradient it read, made by {backward}, reaches |g| {_num(through['gradient_before'])}; "
                f"{backward} re-run without {cut} gives {_num(through['gradient_after'])}, and "
                f"{self.op} re-run on that (what it writes over taken as 0) is finite (max |x| "
                f"{_num(rows['without_them'])}): {alone}. The optimizer's state keeps it at every later step."
            )
            change = f"{cut} of the batch left out of {backward}"
        else:
            rerun = (
                f" Re-run as it ran without {cut} of its argument that stand out, {self.op} is finite (max |x| "
                f"{_num(rows['without_them'])}): {alone}."
            )
            change = f"{cut} of its argument left out"
        return (
            f"{label}: {self.op} made {kind} from {what} of the batch{item_text}, whose values stand out",
            message
            + rows_text(rows, stand_out=True)
            + rerun
            + " No precision change is the fix: the values come from the data.",
            fix,
            Trial.checked(
                change,
                metric=f"{self.op}'s output, max |x|",
                before=kind,
                after=rows["without_them"],
                on="this step's inputs, as the op ran",
            ),
        )

    @property
    def form_records(self) -> list[Record]:
        """The ops of the stable form the fix writes: the form as completed past the chain, or the
        chain's first ops."""
        assert self.stable is not None
        return self.completed or self.chain[: len(self.stable.form.ops)]

    @property
    def clean(self) -> str:
        """What the cured output is: finite, or free of the NaN it made beside an Inf it was handed."""
        if not self.handed or self.symptom == _ANY:
            return "finite"
        return "free of NaN" if "nan" in self.symptom else "free of Inf"

    @property
    def lines(self) -> str:
        """'lines 17-18 of model.py': the lines of the ops re-run in higher precision."""
        return _lines(self.chain)

    def _trial(self) -> Trial:
        """The origin's fix as it was checked: the chain re-run in the fix's precision."""
        lines = _lines(self.chain)
        if self.checked_in:
            return self._largest_trial(lines, self.checked_in, self.absmax_after)
        return Trial.checked(
            f"{lines} in fp64",
            metric=f"{self.op}'s output",
            before="non-finite",
            after=self.clean,
            on="the inputs these ops read in this run",
        )

    def _stable_fix(self, where: str) -> tuple[str, Trial]:
        checked = self.stable
        assert checked is not None
        # a binary cross-entropy by hand holds both halves, log(p) and log(1 - p), on its line: the form of
        # the half that broke alone moves the overflow to the other as the model grows confident
        ran = self.form_records or self.chain
        both = checked.form.ops[0] == "sigmoid" and any(
            len(re.findall(r"\blog\(", _line_text(r))) >= 2 for r in ran if r.location
        )
        fix = _stable_fix_text(checked, where, self.op, both_halves=both)
        trial = Trial.checked(
            f"{checked.form.written} replaced by {checked.form.stable}, in {checked.dtype}",
            metric=f"{self.op}'s output",
            before="non-finite",
            after=f"finite, max |x| {_num(checked.absmax)}; "
            + ("the replacement " if checked.form.prefix else "")
            + f"finite on the inputs scaled to {checked.dtype}'s range",
            on="the inputs these ops read in this run",
        )
        return fix, trial

    def _as_ran(self, changed: str, biggest: float | None) -> Trial:
        """A fix checked by the chain as it ran with `changed` in place: the symptom op's output then."""
        return Trial.checked(
            changed,
            metric=f"{self.op}'s output",
            before="non-finite",
            after=f"{self.clean}, max |x| {_num(biggest)}",
            on="the inputs these ops read in this run",
        )

    def _word_draw(self, label: str, message: str) -> tuple[str, str, str, Trial]:
        """The origin is a random draw made in a narrow dtype: its values are that dtype's."""
        origin, draw = self.origin, self.draw
        assert origin is not None and draw is not None
        dtype, top, after = draw
        where = _where(origin)
        at = f" at {where}" if where else ""
        values = f" (the largest below 1 is {top:.4g}, and 0 is among them)" if top is not None else ""
        why = (
            f" Walking the dataflow upstream, the values come from the random draw {origin.op}{at}, made in {dtype}: "
            f"a draw in {dtype} takes only {dtype}'s values{values}, and the ops after it make {self.op}'s "
            f"{'/'.join(sorted(self.symptom))} of them. No re-run can raise a draw that was made; a new one in "
            "fp32 is the check."
        )
        fix = (
            f"Draw it in fp32: {origin.op}{at} with dtype=torch.float32 (torch.rand_like(x, dtype=torch.float32): "
            "a *_like draw takes the dtype of x, bf16 or fp16 under autocast), the ops that transform it in fp32, and "
            f"cast after them; checked: with a fresh fp32 draw of the same shape, {self.op}'s output is "
            f"{self.clean} (max |x| {_num(after)}). The draw's {dtype} values also bias what it samples where "
            "nothing goes non-finite (a Gumbel noise capped by the largest value below 1)."
        )
        trial = Trial.checked(
            f"{origin.op} drawn in fp32 (a fresh draw of the same shape), the ops after it as they ran",
            metric=f"{self.op}'s output",
            before="non-finite",
            after=f"{self.clean}, max |x| {_num(after)}",
            on="a fresh fp32 draw, the other inputs these ops read in this run",
        )
        return f"{label}: {self.op} made non-finite by a random draw in {dtype} upstream{at}", message + why, fix, trial

    def _word_origin(self, label: str, message: str, advice: str) -> tuple[str, str, str, Trial]:
        """The origin named, its fix checked where the symptom appeared and, where the step went on to
        its loss, on the loss (on_loss.py)."""
        text, message, fix, trial = self._word_origin_at_op(label, message, advice)
        if self.log_form is not None:
            return (text, message, *self._log_form_fix())
        found = self.on_loss
        if found is None:
            return text, message, fix, trial
        how = "the ops from the change down to the loss re-run with it in place, the rest as they ran"
        changed = found.changed
        if fix.startswith("Write F.binary_cross_entropy_with_logits") and "F.logsigmoid" in changed:
            # the check replaced the half that broke; the fix names the whole cross-entropy, each half that form
            changed += " (the half that broke here; the other half takes the same form)"
        if self.data_cast is not None or self.autocast_data:  # a rescale: the check measured the cast kept wide
            if found.after is None or found.gradients_left or found.judged == "gradients":
                fix += (
                    f" (Checked: with {found.changed}, the step's loss or its gradients through those ops are still "
                    "non-finite.)"
                )
            return text, message, fix, trial
        with_ = f"with {found.changed}" if ";" not in found.changed else f"with these together ({found.changed})"
        if found.judged == "gradients":
            if found.after is not None:
                fix = _after_checked(
                    fix,
                    f" On the step's backward: {with_}, the gradients a backward from {found.loss} sends "
                    f"through those ops are finite where they were not (checked: {how}, and their backward run).",
                )
                trial = Trial.checked(
                    changed,
                    metric=f"the gradients from the step's loss ({found.loss}) through the changed ops",
                    before="non-finite",
                    after="finite",
                    on="this step's inputs and weights",
                )
            else:
                fix = _after_checked(
                    fix,
                    f" Not the whole fix: {with_}, the gradients a backward from {found.loss} sends through "
                    f"those ops are still non-finite (checked: {how}, and their backward run).",
                )
            return text, message, fix, trial
        if found.after is not None and found.exact is not None and not _near(found.after, found.exact):
            # finite, yet not what the loss computes in fp64: the change alters the math, not only its precision
            fix = _after_checked(
                fix,
                f" Not the fix as it stands: {with_}, {found.loss} is {found.after:.4g} where it was "
                f"{found.before}, but the same ops as written give {found.exact:.4g} in fp64 (checked: {how}): "
                "the change alters what the loss computes, not only its precision.",
            )
            return text, message, fix, trial
        if found.after is not None:
            if found.gradients_left:
                said = (
                    f" Not the whole fix: {with_}, {found.loss} is {found.after:.4g} where it was {found.before}, but "
                    f"the gradients its backward sends through those ops are still non-finite (checked: {how}, and "
                    "their backward run): the backward of the changed ops needs the wider format too, or their values "
                    "kept in range (a clamp of what feeds the exp)."
                )
            else:
                exact = f"; the same ops as written give {found.exact:.4g} in fp64" if found.exact is not None else ""
                said = (
                    f" On the step's loss: {with_}, {found.loss} is {found.after:.4g} where it was "
                    f"{found.before}{exact} (checked: {how})."
                )
            fix = _after_checked(fix, said)
            left = "; its gradients still non-finite" if found.gradients_left else ""
            trial = Trial.checked(
                changed,
                metric=f"the step's loss ({found.loss}){left}",
                before=found.before,
                after=found.after,
                on="this step's inputs and weights",
            )
        else:
            fix = _after_checked(
                fix,
                f" Not the whole fix: {with_}, {found.loss} is still {found.left} (checked: {how}): "
                "something else between the change and the loss makes it non-finite too.",
            )
        return text, message, fix, trial

    def _largest_trial(self, lines: str, precision: str, after: float | None) -> Trial:
        """The ops at `lines` re-run in `precision`: checked on the op's largest value, `after` that run's."""
        return Trial.checked(
            f"{lines} in {precision}",
            metric=f"{self.op}'s largest |value|",
            before=self.absmax_before,
            after=after,
            on="the inputs these ops read in this run",
        )

    def _past_range_after(self) -> bool:
        """The op's result, computed wider, is still past its own format's range, and is stored as it is (a
        parameter's gradient: no op after it, which a wider result could wait for, brings it in range)."""
        return self.stored and _past(self.absmax_after, self.dtype)

    def _kept_wide(self) -> str:
        """Where the fixed op's values pass the run's format (1.5e6 in fp16): they stay in the wider
        precision, which a cast back after the op would undo."""
        limit = _limit(self.dtype)
        after = self.absmax_after
        if limit is None or after is None or not math.isfinite(after) or after <= limit or not self.checked_in:
            return ""
        return (
            f", and what it makes kept in {self.checked_in} for what reads it: its largest value, {_num(after)}, is "
            f"past {self.dtype}'s {limit:g} (cast back, it overflows again); cast back to {self.dtype} only after "
            f"the ops that bring it within that range (a log, a division by its norm), before a layer that holds "
            f"{self.dtype} weights (a Linear or a norm refuses an {self.checked_in} input)"
        )

    @property
    def _bf16_gives(self) -> str:
        """What the chain re-run in bf16 gave where it cured the symptom."""
        return "the same ops give a finite result" if self.clean == "finite" else f"{self.op}'s output is {self.clean}"

    def _range_cast_fix(self, at: str, checked: str, *, gradient: bool) -> str:
        """A cast past the format's range that no line of the user's writes: a gradient cast to the
        format because the value it is the gradient of was held in it (autocast's output, a .half()),
        or a module's input autocast casts; no loss scale or mask value makes room for it, and keeping
        a few layers in fp32 moves the cast to the layers before (or after) them."""
        if self.bf16 == "finite":
            first = (
                "Autocast to bf16, which has fp32's range: torch.autocast(device, dtype=torch.bfloat16) (checked: "
                f"in bf16 {self._bf16_gives}); or make"
            )
            last = ""
        else:
            first = "Make"
            last = f" Training in fp32 is the other way: {checked}." + (
                " In bf16 they are non-finite too (checked): bf16 is not the fix." if self.bf16 == "non-finite" else ""
            )
        if not gradient and self.autocast_data:
            # the model's input as the batch holds it: the data's units are the cause, on whichever rank holds them
            bf16 = (
                f" Autocast to bf16, which has fp32's range, also runs (checked: in bf16 {self._bf16_gives}), but the "
                "model then still reads values of that size."
                if self.bf16 == "finite"
                else last
            )
            return (
                f"The values autocast casts to {self.dtype}{at} are the data the model is fed (no op made them: a "
                f"module's input as the batch holds it), past its range ({self.cast}): features in large units. "
                "Bring them into range before the model: standardise them with statistics taken once over the "
                "training set ((x - mean) / std, per feature), or divide them by a fixed scale." + bf16
            )
        if not gradient:
            return (
                f"The values autocast casts to {self.dtype}{at} (the line writes no cast: a module's input) are past "
                f"its range ({self.cast}): they were made that large before the cast, in fp32. {first} them smaller "
                "where they are made: inputs in large units (standardise them), or a value that grows without bound "
                "(an exp of an unbounded log-scale, a product or sum over many layers). Keeping only this module in "
                "fp32 moves the overflow to what reads its output." + last
            )
        return (
            f"The gradient cast back{at} to {self.dtype} is past its range ({self.cast}): the backward casts a "
            f"gradient to the dtype of the value it belongs to, here {self.dtype} (an autocast output or a cast), and "
            f"a loss scale below 1 does not make room for a gradient this large. {first} the gradient smaller where "
            f"it starts: a loss or targets in large units (standardise them) give gradients past {self.dtype}'s "
            "range. Keeping only the layers that make that value in fp32 moves the cast to the layers before them."
            + last
        )

    def _data_cast_fix(self, at: str, checked: str) -> tuple[str, Trial]:
        """Data past the format's range, cast by the script (prices in dollars to fp16): the cast kept in
        fp32 is finite (`checked`), but the model in the format that reads them or is fitted to them (its
        output, a loss against them, their gradients) cannot hold values of that size either: the values
        must be brought into range, in their units, before the cast."""
        assert self.data_cast is not None
        limit = _limit(self.dtype) or 0.0
        fix = (
            f"Bring the values cast{at} into {self.dtype}'s range before the cast: they are data in large units "
            f"(largest {_num(self.data_cast)}, {self.data_cast / limit:.3g}x {self.dtype}'s {limit:g}). "
            "Standardise them with statistics taken once over the training set ((x - mean) / std; where they are "
            "targets, a prediction is then prediction * std + mean in their units), or divide them by a fixed "
            f"scale. Keeping the cast in fp32 alone is not the fix: {checked}, but a {self.dtype} model fitted to "
            f"or reading values of that size (its output, the loss's gradient, a layer's input) passes "
            f"{self.dtype}'s range itself. Training in fp32 or bf16 is the other way."
        )
        trial = Trial.untried(
            "a rescale changes the units the model learns in, which a re-run of this step cannot judge (the cast "
            f"kept in {self.checked_in or 'fp64'} was: finite, and not the fix)"
        )
        return fix, trial

    def _log_form_fix(self) -> tuple[str, Trial]:
        """The fix of a log of a softmax's values whose backward overflowed: the stable form, which
        computes in the run's own dtype what the fp32 of the division alone cannot hand back (its
        result stays past the format's range for every op after it)."""
        assert self.log_form is not None
        written, stable_form, records, bound = self.log_form
        where = _lines(records) if any(r.location for r in records) else "the lines that write it"
        times = "(1 - sigmoid)" if "sigmoid" in written else "(onehot - softmax)"
        reached = (
            f"{_num(self.absmax_after)} here, past {self.dtype}'s {_limit(self.dtype):g}"
            if self.absmax_after is not None and _limit(self.dtype) is not None
            else "past the format's range"
        )
        fix = (
            f"Write {stable_form} instead of {written} at {where} (taking the same entries from it after, a "
            f".gather or an index, as before): its backward hands back the incoming gradient times {times}, "
            f"never more than the gradient itself (at most {_num(bound)} on this step's values, in "
            f"{self.dtype} as it runs), where the log's divides it by the probability ({reached}). Computing the "
            "division in fp32 does not help: what it hands back stays past the format's range for the ops after "
            "it, in the backward autograd writes. It needs import torch.nn.functional as F."
        )
        trial = Trial.checked(
            f"{written} written as {stable_form}",
            metric="the largest |gradient| the backward hands back",
            before="inf",
            after=bound,
            on="this step's incoming gradient, as it ran",
        )
        return fix, trial

    def _word_origin_at_op(self, label: str, message: str, advice: str) -> tuple[str, str, str, Trial]:
        """The origin named; where it is the op itself, its own advice stays, with the check."""
        origin = self.origin
        assert origin is not None
        where = _where(origin)
        at = f" at {where}" if where else ""
        own = origin.index == self.chain[-1].index if self.chain else False
        made = origin.outputs[0].dtype.removeprefix("torch.") if origin.outputs else self.dtype
        cause = f"{origin.op} in {self.dtype}" if own else f"{origin.op}{at} (in {made})"
        if self.literal is not None:
            value, rounded, dtype = self.literal
            cause = f"the constant {value:g} in {origin.op}{at}, which is {rounded:g} in {dtype}"
        elif self.cast is not None:
            cause = f"the cast {origin.op}{at}: {self.cast}"
        lines = _lines(self.chain)
        checked = (
            f"with {lines} in {self.checked_in}, {self.op}'s output is {self.clean} (checked: max |x| "
            f"{_num(self.absmax_before)} -> {_num(self.absmax_after)})"
            if self.checked_in
            else f"in fp64 from {origin.op} down, {self.op}'s output is {self.clean}; in fp32 it is not"
        )
        if own:
            text = (
                f"{label}: {self.op} is non-finite in {self.dtype} and in fp32, finite in fp64"
                if self.checked_in == "fp64" and self.dtype != "float32"
                else f"{label}: {self.op} is non-finite only in its own precision ({self.dtype})"
            )
            why = f" The origin is the op itself: {cause}; {checked}."
        else:
            text = f"{label}: {self.op} made non-finite by {origin.op} upstream{at}"
            why = (
                f" Walking the dataflow upstream and re-running from each op down in fp64, the nearest op whose "
                f"higher precision removes it is the origin: {cause}. Raising the precision of {self.op} alone "
                f"does not help ({self.fp64}); {checked}."
            )
        trial = self._trial()
        if self.literal is not None and self.literal_fix is not None:
            # the user's constant is the culprit: the fix names it and the value that was tried in its place
            value, rounded, dtype = self.literal
            new = self.literal_fix[0]
            # the format's own limit: written as torch.finfo of the tensor's dtype, it holds in every dtype
            spelled = f"{_finfo(origin, dtype)}.{'min' if new < 0 else 'max'} ({new:g} in {dtype})"
            fix = (
                f"Replace the constant {value:g} at {where or origin.op} (it is {rounded:g} in {dtype}) with "
                f"{spelled if abs(new) == float(torch.finfo(getattr(torch, dtype)).max) else f'{new:g}'}, which "
                f"{dtype} holds: with it, {self.op}'s output is {self.clean} as it ran "
                f"(checked: max |x| {_num(self.literal_fix[1])})"
                + (
                    f", and its derivative, which the backward takes, fits {dtype} (checked in fp64)."
                    if self.chain and self.chain[-1].phase == "forward"
                    else "."
                )
            )
            trial = self._as_ran(
                f"the constant {value:g} replaced by {self.literal_fix[0]:g}, the ops as they ran", self.literal_fix[1]
            )
            return text, message + why, fix, trial
        if self.saturated_fix is not None:
            # a cast past the format's range: the fix is a value the format holds, never more precision
            # (the cast in fp64 hands fp64 to code that reads the format)
            limit, biggest = self.saturated_fix
            fix = (
                f"Write the limit of the dtype you cast to{at}, not a wider one's: {_finfo(origin, self.dtype)}.min "
                f"({-limit:g} here) for a mask fill, or clamp the values to +-{limit:g} before the cast: with the "
                f"cast holding that value instead of Inf, {self.op}'s output is {self.clean} as it ran (checked: max "
                f"|x| {_num(biggest)})."
            )
            trial = self._as_ran(f"the cast{at} holding +-{limit:g} instead of Inf, the ops as they ran", biggest)
            return text, message + why, fix, trial
        if self.cast is not None and (origin.phase == "backward" or self.autocast_cast) and "exceed" in self.cast:
            if self.autocast_data and origin.phase != "backward":  # the fix is a rescale of the data
                trial = Trial.untried(
                    "a rescale changes the units the model learns in, which a re-run of this step cannot judge"
                    + ("; in bf16 the step is finite (checked)" if self.bf16 == "finite" else "")
                )
            elif self.bf16 == "finite":
                trial = self._largest_trial(lines, "bf16", self.bf16_absmax)
            return text, message + why, self._range_cast_fix(at, checked, gradient=origin.phase == "backward"), trial
        if self.data_cast is not None and self.cast is not None:
            return text, message + why, *self._data_cast_fix(at, checked)
        if self.stable is not None and self.stable.scaled:
            ran = self.form_records
            return text, message + why, *self._stable_fix(_lines(ran))
        if own and self.checked_in and (clip := _clip_args(_line_text(origin))) is not None:
            # torch's clip_grad_norm_ takes the norm in the gradients' dtype and scales them in place: no
            # .float() of its operands reaches that norm (copies would be clipped, not the gradients)
            params, max_norm = clip
            fix = (
                f"clip_grad_norm_{at} takes the total norm in the gradients' dtype ({self.dtype}), past its range "
                f"here: take the norm in fp32 and scale the gradients by it, in place of that line: "
                f"grads = [p.grad for p in {params} if p.grad is not None]; "
                "norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])); "
                f"coef = ({max_norm} / (norm + 1e-6)).clamp(max=1.0); then for g in grads: g.mul_(coef.to(g.dtype)) "
                f"(torch 2.6+: torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)). {checked[0].upper()}"
                f"{checked[1:]}."
            )
        elif own and origin.phase == "backward" and self._past_range_after():
            # a gradient past the format's range computed in fp32 is past it still where it is stored: the gradient
            # of a 16-bit value is 16-bit, so no precision of this op is the fix, only a smaller gradient
            limit = _limit(self.dtype) or 0.0
            fix = (
                f"{origin.op}{at} makes a gradient past {self.dtype}'s range: computed in {self.checked_in or 'fp64'} "
                f"it is {_num(self.absmax_after)} (largest {self.dtype}: {limit:g}), and the gradient of a "
                f"{self.dtype} value (a parameter, an activation) is stored in {self.dtype}, so computing this op "
                "wider and casting back is no fix. Make the gradient smaller where it starts: a loss multiplied by a "
                "large constant before .backward() (a hand-written loss scale: torch.amp.GradScaler lowers its "
                "scale when the gradients overflow, or use a smaller constant), a loss or targets in large units "
                "(standardise them); or keep the parameters in fp32 (torch.autocast for the compute)."
            )
            trial = Trial.untried(
                f"the gradient's size is set by the loss and its scale: computed wider, this op's result is still past "
                f"{self.dtype}'s range ({_num(self.absmax_after)})"
            )
            if self.bf16 == "finite":  # bf16's range holds it: the one precision change that is a fix, checked
                trial = self._largest_trial(lines, "bf16", self.bf16_absmax)
        elif own:
            reduction = op_packet(origin.op) in _REDUCTIONS
            # the operands raised before the op: its result in fp32 of fp16 operands is the same overflow
            wide, method = ("float64", "double") if self.checked_in == "fp64" else ("float32", "float")
            name = _method(origin.op)
            typed = reduction and name in _TYPED  # takes dtype=: sum, mean, prod and their running forms
            again, others = _calls_on_line(origin)
            if typed and again > 1:  # the check ran the whole line wide: one of its sums alone is not what ran
                how = f"a reduction: give each of the {again} `.{name}()` calls on that line dtype=torch.{wide}"
            else:
                how = f"a reduction: .{name}(dtype=torch.{wide})" if typed else f"its operands .{method}() before it"
            if others:  # other ops on the line read or make what it reads: the check ran them wide too
                how += (
                    f"; and every other op on that line ({', '.join(others[:4])}), as the check ran the whole line: "
                    f"each reduction given dtype=torch.{wide}, each other op's operands .{method}()"
                )
            elif typed and again > 1:
                how += ", as the check ran the whole line"
            how = f" ({how})"
            other = _without_precision(advice)
            note = _matmul_note(origin, method)
            lead = f"Compute {origin.op}{at} in {self.checked_in or 'fp64'}{how}"
            if op_packet(origin.op) in _CASTS and self.cast is not None:  # the op is the cast itself: leave it out
                lead = f"Leave out the cast to {self.dtype}{at} (keep the tensor in {self.checked_in or 'fp64'} there)"
            fix = f"{lead}{self._kept_wide()}{note}: {checked}." + (
                f" Also possible, not tried: {other}." if other else ""
            )
        else:
            fix = f"Change the origin, not the op that showed it: {cause}. Verified: {checked}."
            if self.checked_in == "fp32" and made in ("float16", "bfloat16"):  # autocast off is not the edit
                fix += (
                    " On those lines, cast the operands (.float()) and the result back: an autocast-disabled region "
                    f"alone leaves tensors already in {made} as they are."
                )
        if self.bf16 is not None:
            fix += (
                " Or run it in bf16, which has fp32's range where fp16's range ends: torch.autocast(device, "
                f"dtype=torch.bfloat16) or model.to(torch.bfloat16); in bf16 {self._bf16_gives} too (checked)."
                if self.bf16 == "finite"
                else " In bf16 they are non-finite too (checked): bf16 is not the fix."
            )
        return text, message + why, fix, trial


def _method(op: str) -> str:
    """'aten.sum.default' -> 'sum'."""
    return op.split(".")[1] if op.count(".") >= 1 else op


# reductions whose call takes dtype= (the accumulation's type): the others (var, std, norm) take .float() first
_TYPED = frozenset({"sum", "mean", "prod", "cumsum", "cumprod", "nansum", "nanmean"})


# calls on a line that compute nothing new: casts, views and reads
_PASSIVE = frozenset({"float", "double", "half", "bfloat16", "to", "detach", "item", "clone", "contiguous", "view",
                      "reshape", "size", "dim", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand",
                      "flatten", "numel", "tolist", "cpu", "cuda", "type_as", "new_tensor", "tensor"})  # fmt: skip


def _calls_on_line(origin: Record) -> tuple[int, list[str]]:
    """How often the op is called as a method or a torch function on its source line as written, and
    the other ops called there (`torch.dot(w, l) / w.sum()` at the sum: 1, ['dot']); the comment left
    out, and Python's builtin sum( is not the op."""
    if not origin.location:
        return 1, []
    code = linecache.getline(origin.location[0], origin.location[1]).split("#", 1)[0]
    calls = re.findall(r"(?:\.|\btorch\.|\bF\.)(\w+)\(", code)
    name = _method(origin.op)
    others = list(dict.fromkeys(c for c in calls if c != name and c not in _PASSIVE))
    return calls.count(name) or 1, others


_DEVICE = (
    "Suspect the device or the library, not this code: re-run on the same inputs, the op gave a finite result. "
    "Next: replay the step (fpdoctor.Sentinel replays bad steps for you), run the same step on another GPU, and "
    "check this GPU with `fpdoctor health` (Xid errors, ECC, GEMM fingerprints); for a custom kernel, test it on "
    "these inputs."
)


NEAR_EXACT = 0.02  # a loss within this share of its fp64 value is the same loss in a narrow format


# The squashing ops whose log has a stable form (stable.FORMS) whose backward never hands back more than
# the incoming gradient: the gradient times (onehot - softmax), or (1 - sigmoid)
_SQUASHES = frozenset({"_softmax", "sigmoid"})


def _log_of_probs(target: Step, steps: dict[int, Step]) -> tuple[str, str, list[Record], float] | None:
    """The backward of a log (LogBackward0: the incoming gradient divided by the log's input) whose
    input a softmax or a sigmoid made (directly, or picked from it: a gather of the target class):
    (what the code writes, its stable form, the two ops' records, the most the stable form's backward
    hands back on this step's values: the incoming gradient's largest |value|, which it never
    exceeds). None for another log, or where the softmax's step is no longer kept."""
    if len(target.args) < 2 or len(target.record.inputs) < 2:
        return None
    g = target.args[0]
    src = target.record.inputs[1]
    if not isinstance(g, torch.Tensor) or src[0] != "op":
        return None
    made = steps.get(src[1])
    guard = made if made is not None and op_packet(made.record.op) == "add" and _eps(made.args) else None
    if guard is not None:  # log(probs + 1e-8): a guard against log(0) between them, which the backward divides by
        first = guard.record.inputs[0] if guard.record.inputs else None
        made = steps.get(first[1]) if first is not None and first[0] == "op" else None
    packet = op_packet(made.record.op) if made is not None else ""
    form = stable.form_of(["_softmax" if packet == "softmax" else packet, "log"])
    if made is None or form is None or form.ops[0] not in _SQUASHES:
        return None
    bound = float(g.detach().abs().max()) if g.numel() else 0.0
    if not math.isfinite(bound):
        return None
    written = form.written if guard is None else f"{form.written.removesuffix(')')} + eps)"
    records = [made.record, *([guard.record] if guard is not None else []), target.record]
    return written, form.stable, records, bound


def _eps(args: tuple[Any, ...]) -> bool:
    """aten.add's second operand is a small positive constant (an eps of 1e-8 .. 1e-3)."""
    other = args[1] if len(args) > 1 else None
    if isinstance(other, torch.Tensor):
        other = float(other) if other.numel() == 1 else None
    return isinstance(other, (int, float)) and 0 < other <= 1e-3


def _near(value: float, exact: float) -> bool:
    return abs(value - exact) <= NEAR_EXACT * max(abs(exact), 1e-6)


def _after_checked(fix: str, sentence: str) -> str:
    """`sentence` put into a fix after what it checked, before the alternatives not tried."""
    cut = min((k for k in (fix.find(m) for m in (" Also possible, not tried:", " Or run it in bf16", " In bf16 they"))
               if k >= 0), default=len(fix))  # fmt: skip
    return fix[:cut] + sentence + fix[cut:]


def _stable_fix_text(checked: stable.Checked, where: str, op: str, *, both_halves: bool = False) -> str:
    form = checked.form
    # the names the form writes, as imports: pasted into a file that has not imported them, it runs
    needs = [
        i for name, i in (("F.", "import torch.nn.functional as F"), ("math.", "import math")) if name in form.stable
    ]
    lead = f"Write {form.stable} instead of {form.written} at {where}"
    if both_halves:
        lead = (
            "Write F.binary_cross_entropy_with_logits(z, y, reduction='none') in place of the per-element "
            f"cross-entropy written by hand at {where}, -(y * log(p) + (1 - y) * log(1 - p)) with p = sigmoid(z) "
            "(the reduction after it, .mean() or .sum(), stays as it is): both of its halves, as log(sigmoid(z)) "
            "is F.logsigmoid(z) and log(1 - sigmoid(z)) is F.logsigmoid(-z) (replacing only the half that broke "
            f"here, {form.written}, moves the overflow to the other as the model grows confident)"
        )
        needs = ["import torch.nn.functional as F"]
    text = (
        lead
        + (f", then take its {', '.join(checked.picked)} as your code does" if checked.picked else "")
        + f": torch computes it {form.why}. In "
        f"{checked.dtype} on the inputs this step read, {op}'s "
        + ("output is then finite, the ops between re-run as they ran" if form.prefix else "replacement is finite")
        + f" (checked: max |x| {_num(checked.absmax)}), and "
        + ("the replacement is finite " if form.prefix else "")
        + f"on those inputs scaled to {checked.dtype}'s largest values too (checked)"
    )
    if checked.fp32_fails_here:
        text += "; the same lines in fp32 are non-finite on this step's inputs too (checked): more precision is no fix"
    elif checked.fp32_fails:
        text += (
            "; the same lines in fp32, finite on this step's inputs, are non-finite on those scaled inputs (checked): "
            "more precision only moves the edge, which a model that grows confident crosses later"
        )
    if form.ops[0] == "sigmoid" and not both_halves:
        text += (
            ". The other side likewise: log(sigmoid(z)) is F.logsigmoid(z), log(1 - sigmoid(z)) is F.logsigmoid(-z); "
            "for a binary cross-entropy written by hand, F.binary_cross_entropy_with_logits(z, y) is both"
        )
    return text + "." + (f" It needs {'; '.join(needs)}." if needs else "")


def transparent_op(op: str) -> bool:
    """An aten or prims op: its re-runs are torch's own arithmetic, whose advice applies."""
    return op.startswith(("aten.", "prims."))


def whose(op: str) -> str:
    """Who defined the custom op `op` ("myns.scale.default"), from the file torch's dispatcher
    says it was defined in: the program's own code, or the environment's (a sitecustomize or
    usercustomize, a module a .pth file imports, an installed package), which no line of the
    program names."""
    namespace, name = op.split(".")[:2]
    found = defined_at(f"{namespace}::{name}")
    if found is None:
        return "a custom op; where it was defined is not known"
    file, line = found
    startup = {
        os.path.abspath(path): module
        for module in ("sitecustomize", "usercustomize")
        if (path := getattr(sys.modules.get(module), "__file__", None))
    }
    if os.path.abspath(file) in startup:
        return f"defined by the environment, not your code: {startup[os.path.abspath(file)]} at {file}:{line}"
    if any(s in file for s in ("site-packages", "dist-packages")):
        return f"defined by an installed package, not your code: registered at {file}:{line}"
    if file.startswith("<") or (file.endswith(".py") and is_user_file(file)):  # "<string>": python -c, exec
        return f"a custom op defined by your code at {file}:{line}"
    return f"a compiled extension's op, registered at {file}:{line}"


def custom_op_fix(op: str, rerun: str | None) -> str:
    """The fix for a non-finite value a custom op (torch.library, a C++ extension, a Triton kernel)
    made: test the kernel, not an epsilon; `rerun`: what re-running it as it ran gave, if it ran."""
    said = f" (re-run as it ran: {rerun})" if rerun else ""
    return (
        f"Test {op} against a reference on these inputs{said}: the same computation as unfused torch ops, in "
        "fp64. Not an epsilon or a clamp: no arithmetic of this code was shown to make the value."
    )


def _without_precision(advice: str) -> str:
    """The op's advice less what a higher precision would do: tried, it does not help."""
    kept = [part for part in advice.split("; ") if "fp32" not in part or " or " in part]
    text = "; ".join(
        re.sub(r",? or (compute|keep)[^;]*fp32[^;]*$", "", re.sub(r"accumulate in fp32 \(.*\) or ", "", part))
        for part in kept
    )
    return text.strip().rstrip(".,;")


# ops whose NaN from finite inputs means an input outside their domain, and which inputs those are
_DOMAIN = {
    "log": "a negative value", "log2": "a negative value", "log10": "a negative value",
    "sqrt": "a negative value", "rsqrt": "a negative value",
    "acos": "a value outside [-1, 1]", "asin": "a value outside [-1, 1]", "atanh": "a value outside [-1, 1]",
    "acosh": "a value below 1",
}  # fmt: skip


def _math_cause(op: str, symptom: frozenset[str]) -> str:
    """What a non-finite value that fp64 makes too says about the math, for the title."""
    outside = _DOMAIN.get(op_packet(op))
    if outside is not None and symptom == frozenset({"nan"}):
        return f"an input outside its domain ({outside}): the math itself is undefined there"
    return "the math itself overflows or divides by zero"


def op_packet(op: str) -> str:
    """'aten.sum.default' -> 'sum'."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 else op


def _where(r: Record) -> str | None:
    return f"{r.location[0]}:{r.location[1]}" if r.location else None


def _lines(chain: list[Record]) -> str:
    """'lines 17-18 of model.py' for the chain's source lines, or its ops where lines are unknown."""
    located = [r.location for r in chain if r.location]
    if not located:
        return ", ".join(r.op for r in chain)
    files = {loc[0] for loc in located}
    numbers = sorted({loc[1] for loc in located})
    if len(numbers) == 1:
        span = f"line {numbers[0]}"
    elif numbers[-1] - numbers[0] == len(numbers) - 1:  # consecutive: a range
        span = f"lines {numbers[0]}-{numbers[-1]}"
    else:  # the lines the chain ran, not the ones between them (an if/else branch not taken)
        span = f"lines {', '.join(str(n) for n in numbers[:-1])} and {numbers[-1]}"
    return f"{span} of {located[0][0]}" if len(files) == 1 else ", ".join(f"{f}:{n}" for f, n, _ in located)


def _past(value: float | None, dtype: str) -> bool:
    """Whether a finite `value` is past the largest finite value of `dtype`."""
    limit = _limit(dtype)
    return value is not None and limit is not None and math.isfinite(value) and value > limit


def _limit(dtype: str) -> float | None:
    """The largest finite value of a floating dtype named as the records name it ("float16")."""
    found = getattr(torch, dtype, None)
    return float(torch.finfo(found).max) if isinstance(found, torch.dtype) and found.is_floating_point else None


def _num(value: float | None) -> str:
    if value is None:
        return "unknown"
    return f"{value:.3g}" if math.isfinite(value) else "inf" if value > 0 else "nan"


def _tiny(dtype: str) -> float:
    return float(torch.finfo(getattr(torch, dtype)).tiny)


class _Skip(Exception):
    """An op the experiment cannot re-run faithfully."""


def _kind(t: torch.Tensor) -> str | None:
    if not t.is_floating_point():
        return None
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    return "nan" if bool(torch.isnan(t).any()) else "inf"


def _kinds(outs: list[torch.Tensor]) -> set[str]:
    """What non-finite values the floating tensors `outs` hold: "nan", "inf", both or none."""
    return {k for k in (_kind(o) for o in outs) if k} | {"inf" for o in outs if bool(torch.isinf(o).any())}


def _absmax(t: torch.Tensor) -> float:
    """The largest finite magnitude, or NaN/inf when the tensor has them."""
    if not t.numel():
        return 0.0
    return float(t.detach().abs().max().double())


def _finite_absmax(t: torch.Tensor) -> float:
    """The largest finite magnitude; inf where every value is the Inf the op was handed (never 0)."""
    finite = t.detach()[torch.isfinite(t)]
    return float(finite.abs().max().double()) if finite.numel() else (math.inf if t.numel() else 0.0)


def _outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _aligned(step: Step) -> list[tuple[int, torch.Tensor, tuple[str, int] | None]]:
    """(position in the flattened arguments, tensor, source) for each tensor argument; the
    sources line up with the record's inputs, which the tracer took for checkable tensors in
    this order (none when they do not line up: the op is then re-run from its own arguments)."""
    flat, _ = tree_flatten((step.args, step.kwargs or {}))
    tensors = [(i, v) for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    inputs = step.record.inputs
    checked = [(i, v) for i, v in tensors if checkable(v)]
    if len(checked) != len(inputs):
        return [(i, v, None) for i, v in tensors]
    sources = {i: src for (i, _), src in zip(checked, inputs, strict=True)}
    return [(i, v, sources.get(i)) for i, v in tensors]


def _substitute(original: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a recomputed output) in the place of `original` (the argument, maybe a view of it)."""
    if original.shape == value.shape and original._base is None:
        return value
    base = original._base
    if base is not None and base.shape == value.shape:
        laid = torch.empty_strided(base.size(), base.stride(), dtype=value.dtype, device=value.device)
        laid.copy_(value)
        return laid.as_strided(original.size(), original.stride(), original.storage_offset() - base.storage_offset())
    if original.shape == value.shape:
        return value
    raise _Skip("an argument is a view the experiment cannot rebuild")


Lookup = Callable[[torch.Tensor], "tuple[str, int] | None"]
# the window's selections while decide() runs: a re-run selects again from its recomputed source
_SELECTED: ContextVar[dict[int, tuple[Any, Any, Any, Any]]] = ContextVar("selected", default={})  # noqa: B039


def _reselect(t: torch.Tensor, outs: list[torch.Tensor]) -> torch.Tensor | None:
    """`t` (or the base it is a view of), a selection (gather, index) of an output the chain
    recomputed, selected again from that output's recomputed values; None where it is not one."""
    selections = _SELECTED.get()
    # the selection itself, or the base of a view of it (`.squeeze(1)` after a gather): _substitute lays
    # the view over what is selected again
    t = next((c for c in (t, t._base) if c is not None and id(c) in selections and selections[id(c)][0]() is c), t)
    kept = selections.get(id(t))
    if kept is None or kept[0]() is not t:
        return None
    _, func, args, kwargs = kept
    flat, spec = tree_flatten((args, kwargs or {}))
    for i, v in enumerate(flat):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            match = next((o for o in outs if o.shape == v.shape), None)
            if match is not None:
                flat[i] = match
    args_, kwargs_ = tree_unflatten(flat, spec)
    out = func(*args_, **kwargs_)
    return out if isinstance(out, torch.Tensor) and out.shape == t.shape else None


def _run(
    step: Step, dtype: torch.dtype | None, values: dict[int, list[torch.Tensor]], lookup: Lookup | None, *,
    strict: bool = False, leaves: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Run one op: tensors from earlier ops of the chain replaced by their recomputed values,
    floating tensors and dtype arguments raised to `dtype` (None: as it ran). `lookup` tells the
    op or leaf a tensor holds the values of now: one that is no longer the recorded source was
    written in place since, and the op cannot be re-run on what it read. `strict`: an argument made
    by a recomputed op that none of its values replaces stops the run (_Skip), never read as it ran.
    `leaves`: every other argument that wants a gradient is read detached, as a new leaf that wants
    one, appended there (a backward through the run reaches them, never the program's graph)."""
    func = step.func
    if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
        raise _Skip(f"{step.record.op} draws random numbers")
    flat, spec = tree_flatten((step.args, step.kwargs or {}))
    mutable = bool(getattr(getattr(func, "_schema", None), "is_mutable", False))
    for i, arg, src in _aligned(step):
        t = arg
        if src is not None and src[0] == "op" and src[1] in values:
            outs = values[src[1]]
            match = next((o for o in outs if o.shape == t.shape), None)
            if match is None:
                match = next((o for o in outs if t._base is not None and o.shape == t._base.shape), None)
            if match is None:  # a selection (gather, index) of that output: selected again from it
                match = _reselect(t, outs)
            # no recomputed output has its shape (a reduction's result, matched to the op that made its
            # operand): the argument stays as it ran, and the control run as it ran still decides
            if match is None and strict:
                raise _Skip(f"an input of {step.record.op} is not one the re-run made")
            t = t if match is None else _substitute(t, match)
            if mutable:
                t = t.clone()  # a re-run view may share the program's memory: never write it
        elif src is not None and lookup is not None and lookup(t) != src:
            raise _Skip(f"an input of {step.record.op} was written in place since")
        elif leaves is not None and t.requires_grad:
            t = t.detach().requires_grad_(True)
            leaves.append(t)
        elif mutable:
            t = t.clone()  # never write the user's tensors
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        flat[i] = t
    if dtype is not None:
        flat = [dtype if isinstance(v, torch.dtype) and v.is_floating_point and v != dtype else v for v in flat]
    args, kwargs = tree_unflatten(flat, spec)
    return _outputs(func(*args, **kwargs))


def _replay(
    chain: list[Step], dtype: torch.dtype | None, lookup: Lookup | None,
    values: dict[int, list[torch.Tensor]] | None = None,
) -> list[torch.Tensor]:  # fmt: skip
    """Run the chain in index order; the last op's outputs. `values`: outputs of ops before the
    chain to read instead of what they made as they ran."""
    values = dict(values or {})
    out: list[torch.Tensor] = []
    for step in chain:
        out = _run(step, dtype, values, lookup)
        values[step.record.index] = out
    return out


def _cured_from(
    chain: list[Step], k: int, value: torch.Tensor, lookup: Lookup | None, symptom: frozenset[str]
) -> float | None:
    """The chain's ops after its first k re-run as they ran on `value` in place of what the k-th
    made: the last op's largest |value| where the symptom is gone, else None."""
    kind, after = _chain_kind(chain[k:], None, lookup, symptom, values={chain[k - 1].record.index: [value]})
    return None if kind is not None else after


def _chain_kind(
    chain: list[Step], dtype: torch.dtype | None, lookup: Lookup | None, symptom: frozenset[str] = _ANY,
    values: dict[int, list[torch.Tensor]] | None = None,
) -> tuple[str | None, float]:  # fmt: skip
    """The symptom's kind in the chain's output (None: cured), and the output's largest magnitude.
    `values`: as _replay's."""
    outs = [o for o in _replay(chain, dtype, lookup, values) if o.is_floating_point()]
    kinds = _kinds(outs) & symptom
    kind = "nan" if "nan" in kinds else next(iter(kinds), None)
    # cured of the symptom while a value it was handed still passes through: the finite values' magnitude
    magnitude = _absmax if kind is not None or symptom == _ANY else _finite_absmax
    return kind, max((magnitude(o) for o in outs), default=0.0)


_DIVIDES = frozenset({"div", "div_", "true_divide", "floor_divide", "remainder", "fmod"})


def _bad_rows(target: Step, lookup: Lookup | None, *, batch: bool) -> dict[str, Any] | None:
    """The rows along dim 0 of the op's output (run as it ran) that hold NaN/Inf, where only some do,
    and how its inputs' same rows differ from the others (their largest magnitude, all zero)."""
    out = next((o for o in _replay([target], None, lookup) if o.is_floating_point() and o.dim() >= 2), None)
    if out is None or (found := bad_rows(out, batch=batch)) is None:
        return None
    bad = torch.zeros(out.shape[0], dtype=torch.bool, device=out.device)
    bad[found["indices"]] = True
    sources = {i: src for i, _, src in _aligned(target)}
    said: dict[int, str] = {}
    given: set[int] = set()  # arguments the trace did not compute: the batch's own rows
    for position, t in enumerate(tree_flatten((target.args, target.kwargs or {}))[0]):
        if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.shape[0] == out.shape[0]):
            continue
        size = t.detach().reshape(t.shape[0], -1).abs().double().amax(1)
        inside, outside = float(size[bad].max()), float(size[~bad].max())
        src = sources.get(position)
        if inside == 0 and outside > 0 and src is not None and src[0] == "op":
            # computed in the trace: zeros made upstream (the spread of a constant row, an underflow, a
            # mask), not a padded input row
            said[position] = (
                f"argument {position} is all zero (computed upstream: a constant row's spread, an underflow or a mask?)"
            )
        elif inside == 0 and outside > 0:
            said[position] = f"argument {position} is all zero (a padded or empty row?)"
            given.add(position)
        elif inside > 100 * outside or outside > 100 * inside:
            said[position] = f"argument {position}'s largest |x| is {inside:.3g}, against {outside:.3g} in the others"
    if said:  # an empty row of the data itself first; else, of a division's two (0/0: both are zero),
        # the divisor's zeros, which made the NaN/Inf
        divides = target.func.overloadpacket.__name__ in _DIVIDES and 1 in said
        found["differs"] = said[min(given)] if given else said[1] if divides else said[min(said)]
    return found


def _outlier_rows(target: Step, steps: dict[int, Step], symptom: frozenset[str]) -> dict[str, Any] | None:
    """The data's doing: rows along dim 0 of an argument (not a parameter) far out of line with the
    others (loader.standing_out) that alone make the symptom (the op re-run as it ran on the other rows
    only, every argument with that dim 0 cut the same way, comes out clean), where an input of the step
    (a tensor the trace did not see made: the batch) has rows far out of line too. Named by the
    input's rows and their dataset items (loader.rows_found); None where any of it is missing: rows
    out of line in values the model computed (a mask's fill, a stale log-probability) are not data."""
    cut = _without_outliers(target)
    if cut is None or _kinds(cut[1]) & symptom:
        return None  # no such rows, or the other rows make it too: not theirs alone
    named = _batch_standing_out(steps)
    if named is not None:
        named["op_rows"] = cut[0]
        named["without_them"] = max((_absmax(o) for o in cut[1]), default=0.0)
    return named


def _without_outliers(step: Step) -> tuple[list[int], list[torch.Tensor]] | None:
    """The first argument (not a parameter) with rows standing out (loader.standing_out), and the op's
    floating outputs re-run as it ran without those rows, every argument with that dim 0 cut the same
    way; None where no argument has such rows or the op cannot run on the cut arguments."""
    flat, spec = tree_flatten((step.args, step.kwargs or {}))
    for t in flat:
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
            continue
        found = standing_out(t)
        if found is None:
            continue
        rows, n = found[0], t.shape[0]
        keep = torch.tensor([i for i in range(n) if i not in rows], device=t.device)
        # the other arguments cut along dim 0 where it is n; then, where the op refuses that (a matmul's
        # backward reads the batch as a transposed matrix's columns), each other matrix along dim 1 first
        for columns in (False, True):
            cut = [_rows_kept(v, n, keep, columns=columns and v is not t) for v in flat]
            args, kwargs = tree_unflatten(cut, spec)
            try:
                outs = step.func(*args, **kwargs)
            except Exception:
                continue  # no check, no verdict
            return rows, [o for o in tree_flatten(outs)[0] if isinstance(o, torch.Tensor) and o.is_floating_point()]
        return None
    return None


def _update_on(step: Step, gradient: torch.Tensor, grad: torch.Tensor, written: set[int]) -> list[torch.Tensor]:
    """An optimizer's op re-run on `grad` in the place of `gradient` (a foreach op on its element alone),
    what it writes over taken as 0; its outputs, or what it wrote where it returns nothing (foreach)."""
    given, spec = tree_flatten(_element_of(step, gradient))
    flat = [torch.zeros_like(v) if id(v) in written else grad if v is gradient else v for v in given]
    args, kwargs = tree_unflatten(flat, spec)
    outs = _outputs(step.func(*args, **kwargs))
    return outs or [v for v, old in zip(flat, given, strict=True) if id(old) in written]


def _element_of(step: Step, t: torch.Tensor) -> tuple[Any, Any]:
    """The op's (args, kwargs), a foreach op's lists cut to the one element `t` is at (each list of
    that length, its scalars too): the update of that one tensor, judged apart from the others."""
    args, kwargs = list(step.args), dict(step.kwargs or {})
    at = next(((len(a), i) for a in args if isinstance(a, (list, tuple)) for i, v in enumerate(a) if v is t), None)
    if at is None:
        return tuple(args), kwargs
    n, i = at
    args = [[a[i]] if isinstance(a, (list, tuple)) and len(a) == n else a for a in args]
    return tuple(args), kwargs


def _rows_kept(v: Any, n: int, keep: torch.Tensor, *, columns: bool = False) -> Any:
    """`v` with only rows `keep` of its `n` along dim 0; with `columns`, a matrix along dim 1 where that
    is `n` (the transposed operand of a matmul's backward: grad_output.t() @ input), else along dim 0;
    anything else as is (a weight's transpose in the forward's addmm is never cut)."""
    if not isinstance(v, torch.Tensor) or isinstance(v, torch.nn.Parameter) or v.dim() == 0:
        return v
    if columns and v.dim() == 2 and v.shape[1] == n:
        return v.detach().index_select(1, keep.to(v.device))
    if v.shape[0] == n:
        return v.detach().index_select(0, keep.to(v.device))
    return v


def _batch_standing_out(steps: dict[int, Step]) -> dict[str, Any] | None:
    """The step's input with rows far out of line (_input_standing_out), named as rows_found names
    them, with how far out of line; None where no input of the step has such rows."""
    source = _input_standing_out(steps)
    if source is None:
        return None
    given, (places, largest, outside) = source
    named = rows_found(places, given.shape[0], batch=True)
    shape = "x".join(str(d) for d in given.shape)
    named["differs"] = (
        f"the step's input {dtype_name(given.dtype).removeprefix('torch.')}[{shape}] holds |x| up to "
        f"{largest:.3g} there, against {outside:.3g} in every other row"
    )
    named["largest"], named["others_largest"] = largest, outside
    return named


def _gradient_outliers(target: Step, steps: dict[int, Step], symptom: frozenset[str]) -> dict[str, Any] | None:
    """The data's doing in the optimizer: an update op (Adam's square of the gradient into its second
    moment) made the symptom from a finite gradient that the backward op made from a few rows far out of
    line (_without_outliers on that backward op), where the step's batch has such rows too. Checked by
    the update op re-run on the gradient made without those rows, what it writes over taken as zero
    (its old value is gone): clean, where on the whole gradient from that zero state it makes the symptom
    again (the control). The gradient's largest |g| with and without them is kept."""
    written = _written(target)
    for _, gradient, src in _aligned(target):
        producer = steps.get(src[1]) if src is not None and src[0] == "op" else None
        if producer is None or producer.record.phase != "backward" or id(gradient) in written:
            continue
        cut = _without_outliers(producer)
        if cut is None:
            continue
        remade = next((o for o in cut[1] if o.shape == gradient.shape), None)
        if remade is None:
            continue
        try:
            # the control: on the whole gradient, from a state of 0, the op makes the symptom again
            if not _kinds(_update_on(target, gradient, gradient, written)) & symptom:
                continue
            outs = _update_on(target, gradient, remade, written)
        except Exception:
            continue
        if not outs or _kinds(outs) & symptom:
            continue
        named = _batch_standing_out(steps)
        if named is None:
            return None
        named["op_rows"] = cut[0]
        named["through"] = {
            "op": producer.record.forward_op or producer.record.op,
            "gradient_before": _absmax(gradient),
            "gradient_after": _absmax(remade),
        }
        named["without_them"] = max((_absmax(o) for o in outs), default=0.0)
        return named
    return None


def _input_standing_out(steps: dict[int, Step]) -> tuple[torch.Tensor, tuple[list[int], float, float]] | None:
    """An input of the step whose rows along dim 0 stand out (loader.standing_out), and those rows: a
    tensor of the batch a DataLoader last handed out (dim 0 its items, whatever the model transposes),
    or where none of that batch's does, among the window's arguments a leaf of the trace that is not a
    parameter (a batch given as it is)."""
    batch = last_batch()
    if batch is not None:
        found_in = next(((t, found) for t in batch if (found := standing_out(t)) is not None), None)
        if found_in is not None:
            return found_in
        # none there: a batch given as it is, read after a loader's (an evaluation's) still alive
    seen: set[int] = set()
    for step in steps.values():
        for _, t, src in _aligned(step):
            if src is None or src[0] != "leaf" or id(t) in seen or isinstance(t, torch.nn.Parameter):
                continue
            seen.add(id(t))
            found = standing_out(t)
            if found is not None:
                return t, found
    return None


def _written(step: Step) -> set[int]:
    """The ids of the tensors the op writes in place (its schema's written arguments): what they hold
    now is what it made, not what it read."""
    schema = getattr(step.func, "_schema", None)
    return {
        id(v)
        for a, given in zip(schema.arguments if schema is not None else (), step.args, strict=False)
        if a.alias_info is not None and a.alias_info.is_write
        for v in tree_flatten(given)[0]
        if isinstance(v, torch.Tensor)
    }


def _symptom(target: Step) -> tuple[frozenset[str], bool]:
    """What the producer made that its inputs did not hold: NaN from Inf inputs (0/0 beside inf/x)
    is cured when the NaN is gone, though the Inf it was handed still passes through. What an op
    wrote in place holds what it made, and is not read for what it was handed."""
    made = {"nan" if k == "nan" else "inf" for o in target.record.outputs for k, n in (o.counts or {}).items() if n}
    made |= {"nan" if o.kind == "nan" else "inf" for o in target.record.outputs if o.kind}
    held: set[str] = set()
    written = _written(target) if target.record.mutates is not None or target.record.phase == "optimizer" else set()
    for t in tree_flatten((target.args, target.kwargs or {}))[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and id(t) not in written:
            held |= {"nan"} if bool(torch.isnan(t).any()) else set()
            held |= {"inf"} if bool(torch.isinf(t).any()) else set()
    return frozenset(made - held or made) or _ANY, bool(held)


def _said(kind: str | None) -> str:
    return "finite" if kind is None else f"{kind} again"


def _ancestors(target: Step, steps: dict[int, Step]) -> tuple[list[Step], dict[int, set[int]], bool]:
    """The window's ops upstream of `target`, nearest (latest) first, at most MAX_ANCESTORS; for
    each op of the walk, the ancestors it depends on; whether the walk reached the window's edge."""
    found: dict[int, Step] = {}
    edge = False
    frontier = [target]
    while frontier:
        step = frontier.pop()
        for src in step.record.inputs:
            if src[0] != "op" or src[1] in found:
                continue
            upstream = steps.get(src[1])
            if upstream is None:
                edge = True  # made before the window (or forgotten): the walk cannot go there
                continue
            found[src[1]] = upstream
            frontier.append(upstream)
    nearest = sorted(found.values(), key=lambda s: -s.record.index)
    if len(nearest) > MAX_ANCESTORS:
        nearest, edge = nearest[:MAX_ANCESTORS], True
    kept = {s.record.index for s in nearest}
    depends: dict[int, set[int]] = {}
    for step in sorted([*nearest, target], key=lambda s: s.record.index):
        deps: set[int] = set()
        for src in step.record.inputs:
            if src[0] == "op" and src[1] in kept:
                deps |= {src[1], *depends.get(src[1], ())}
        depends[step.record.index] = deps
    return nearest, depends, edge


def _chain(origin: Step, target: Step, nearest: list[Step], depends: dict[int, set[int]]) -> list[Step]:
    """`origin` and the ops between it and `target` that depend on it, then `target`, in order."""
    start = origin.record.index
    between = [s for s in nearest if start in depends.get(s.record.index, ()) or s.record.index == start]
    if origin is target:
        between = []
    return [*sorted(between, key=lambda s: s.record.index), target]


# ops that turn an Inf into 0 or a saturated finite value (1 / inf, tanh(inf)), in place too
ZEROING = frozenset({
    "rsqrt", "reciprocal", "exp", "exp2", "div", "pow", "sigmoid", "tanh", "erf", "erfc", "atan",
    "rsqrt_", "reciprocal_", "exp_", "div_", "pow_", "sigmoid_", "tanh_",
})  # fmt: skip


def zeroed_exactly(record: Record, producer: int, window: Window, lookup: Lookup | None = None) -> bool | None:
    """An op that made an overflow's Inf finite (tanh(inf) = 1, x / inf = 0): whether it gave what the
    exact computation gives, rounded to its format (tanh(4.7e5) is 1 too). The ops from the overflow's
    producer (index `producer`) to it re-run as they ran and in fp64; True where every output value the
    Inf reached (elementwise, or broadcast from it) is the fp64 one rounded, within one spacing of the
    format. None where they cannot be re-run, or the Inf does not map onto the output's values (a
    reduction of it): the op is then reported, unjudged."""
    steps = window.by_index()
    target, origin = steps.get(record.index), steps.get(producer)
    if target is None or origin is None:
        return None
    nearest, depends, _ = _ancestors(target, steps)
    if producer not in {s.record.index for s in nearest}:
        return None
    chain = _chain(origin, target, nearest, depends)
    made = {step.record.index for step in chain}
    for step in chain:  # a non-finite value from outside the chain (a second overflow) stays so in fp64 too
        for _, arg, src in _aligned(step):
            outside = src is None or src[0] != "op" or src[1] not in made
            if outside and arg.is_floating_point() and not bool(torch.isfinite(arg).all()):
                return None
    try:
        with torch.no_grad():
            values: dict[int, list[torch.Tensor]] = {}
            for step in chain:  # as it ran, keeping what each made: the Inf the op read is among them
                values[step.record.index] = _run(step, None, values, lookup)
            exact = _replay(chain, torch.float64, lookup)
    except Exception:  # an op that cannot run again on these inputs (_Skip, a shape it reselects wrongly)
        return None
    ran = next((t for t in values[record.index] if t.is_floating_point()), None)
    wide = next((t for t in exact if t.is_floating_point()), None)
    if ran is None or wide is None or ran.shape != wide.shape:
        return None
    read = [t for src in record.inputs if src[0] == "op" for t in values.get(src[1], []) if t.is_floating_point()]
    # the values the Inf became (an Inf norm of shape [N, 1] reaches its row of x / norm): the others carry
    # the format's own rounding
    where = None
    for t in read:
        try:
            where = torch.broadcast_to(torch.isinf(t), ran.shape) if bool(torch.isinf(t).any()) else None
        except RuntimeError:  # not of the output's shape, nor broadcast to it
            where = None
        if where is not None:
            break
    if where is None:
        return None
    got, rounded = ran[where].double(), wide[where].to(ran.dtype).double()
    spacing = torch.finfo(ran.dtype).eps * rounded.abs().clamp_min(torch.finfo(ran.dtype).tiny)
    return bool(((got - rounded).abs() <= spacing).all())


def _compute_dtype(step: Step) -> torch.dtype | None:
    outs = [t for t in tree_flatten((step.args, step.kwargs or {}))[0] if isinstance(t, torch.dtype)]
    if outs and outs[0].is_floating_point:
        return outs[0]
    floating = [t.dtype for t in tree_flatten(step.args)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return floating[0] if floating else None


def _literal(step: Step) -> tuple[float, float, str] | None:
    """A Python constant among the op's arguments that rounds to 0 (or overflows) in its dtype."""
    dtype = _compute_dtype(step)
    if dtype not in _NARROW:
        return None
    for value in tree_flatten((step.args, step.kwargs or {}))[0]:
        if type(value) is float and value != 0 and math.isfinite(value):
            rounded = float(torch.tensor(value, dtype=torch.float64).to(dtype))
            if rounded == 0 or not math.isfinite(rounded):
                return value, rounded, dtype_name(dtype).removeprefix("torch.")
    return None


def _cast(step: Step) -> str | None:
    """What a narrowing cast did: how many values it changed, and the largest exact integer."""
    name = step.func.overloadpacket.__name__ if hasattr(step.func, "overloadpacket") else ""
    dtype = _compute_dtype(step)
    source = next((t for t in tree_flatten(step.args)[0] if isinstance(t, torch.Tensor)), None)
    if name not in _CASTS or dtype not in _NARROW or source is None:
        return None
    exact = source.to(torch.float64)
    changed = int((exact != source.to(dtype).to(torch.float64)).sum())
    if not changed:
        return None
    largest = int(2 / torch.finfo(dtype).eps)  # 2 ** (mantissa bits + 1): 2048 in fp16, 256 in bf16
    fmt = dtype_name(dtype).removeprefix("torch.")
    ints = "integers" if not source.is_floating_point() else "values"
    top = float(torch.finfo(dtype).max)
    over = int((exact.abs() > top).sum())
    if over:  # past the format's largest value: the cast makes Inf, which is not rounding
        return f"{over} of {source.numel()} {ints} exceed {fmt}'s largest value ({top:g}; max |x| {_absmax(exact):.6g})"
    rounded = source.to(dtype).to(torch.float64)
    if bool((exact == exact.round()).all()):  # whole numbers: the format's spacing passes 1 above `largest`
        held = f"{fmt} holds integers exactly only up to {largest}"
    else:
        eps = torch.finfo(dtype).eps
        held = f"{fmt} keeps {round(-math.log2(eps)) + 1} significant bits, a relative spacing of {eps:g}"
    # what the rounding makes that the code after it may not expect: 1 - u, log(u) and 1 / x read these
    to_one = int(((exact.abs() != 1) & (rounded.abs() == 1)).sum())
    to_zero = int(((exact != 0) & (rounded == 0)).sum())
    made = "".join(
        (f"; {k} value(s) that are not {v} become exactly {v}" if k else "")
        for k, v in ((to_one, "±1"), (to_zero, "0"))
    )
    return f"it rounds {changed} of {source.numel()} {ints} (max |x| {_absmax(exact):.6g}; {held}){made}"


def decide(
    target_record: Record, window: Window, lookup: Lookup | None = None, budget_s: float = BUDGET_S
) -> Experiment | None:
    """Run the experiments at a producer (see the module docstring); None when its arguments are
    no longer in the window. Never raises for an op it cannot re-run: it says so instead."""
    token = _SELECTED.set(window.selections)
    try:
        return _decide(target_record, window, lookup, budget_s)
    finally:
        _SELECTED.reset(token)


def _decide(target_record: Record, window: Window, lookup: Lookup | None, budget_s: float) -> Experiment | None:
    steps = window.by_index()
    target = steps.get(target_record.index)
    if target is None:
        return None
    out = target_record.outputs[0] if target_record.outputs else None
    experiment = Experiment(target_record.op, (out.dtype if out else "unknown").removeprefix("torch."), "not-decided")
    deadline = time.monotonic() + budget_s
    with torch.no_grad():
        symptom, experiment.handed = _symptom(target)
        experiment.symptom = symptom
        if target_record.phase == "optimizer" and not experiment.handed:
            # a finite gradient made by a few rows of the batch far out of line: the data, as in the forward
            experiment.outliers = _gradient_outliers(target, steps, symptom)
            if experiment.outliers is not None:
                experiment.as_ran = "not re-run (the op wrote its inputs in place)"
                experiment.verdict = "data"
                return experiment
        # (a) as it ran: an op that wrote its arguments cannot be re-run on what it read
        if target_record.mutates is not None or bool(getattr(target.func._schema, "is_mutable", False)):
            experiment.as_ran = "not re-run (the op wrote its inputs in place)"
        else:
            try:
                kind, _ = _chain_kind([target], None, lookup, symptom)
                experiment.as_ran = _said(kind)
                if kind is None:
                    experiment.verdict = "device-or-library"
                    return experiment
                experiment.rows = _bad_rows(target, lookup, batch=target_record.phase == "forward")
                if target_record.phase == "forward" and not experiment.handed:
                    # a few rows of the batch far out of line with the others, which alone make it: the data
                    experiment.outliers = _outlier_rows(target, steps, symptom)
                    if experiment.outliers is not None:
                        experiment.verdict = "data"
                        return experiment
            except _Skip as skip:
                experiment.as_ran = f"not re-run ({skip})"
            except Exception as exc:
                experiment.as_ran = f"not re-run ({type(exc).__name__}: {exc})"
        if target_record.phase == "backward" and op_packet(target_record.forward_op or "") in SINGULAR:
            try:
                experiment.guard = _try_guard(target)
            except Exception:
                experiment.guard = None
        if target_record.phase == "backward" and op_packet(target_record.forward_op or "") == "log":
            try:
                experiment.log_form = _log_of_probs(target, steps)
            except Exception:  # the experiment is ours; the finding stands without it
                experiment.log_form = None
        # (b) in fp64, and (c) the walk upstream; the op alone is the walk's first step
        nearest, depends, edge = _ancestors(target, steps)
        for origin in [target, *nearest]:
            if time.monotonic() > deadline:
                experiment.note = f"The walk upstream stopped after {experiment.walked} ops (time budget)."
                break
            chain = _chain(origin, target, nearest, depends)
            try:
                kind, _ = _chain_kind(chain, torch.float64, lookup, symptom)
            except _Skip as skip:
                if _drawn_narrow(experiment, origin, chain, lookup, symptom):
                    return experiment
                experiment.note = f"The walk upstream stopped at {origin.record.op}: {skip}."
                break
            except Exception as exc:
                experiment.note = f"The walk upstream stopped at {origin.record.op}: {type(exc).__name__}: {exc}."
                break
            if origin is target:
                experiment.fp64 = _said(kind)
            else:
                experiment.walked += 1
            if kind is not None:
                continue
            # finite in fp64: the same chain as it ran must still fail, or an input went stale
            try:
                control, before = _chain_kind(chain, None, lookup, symptom)
            except Exception:
                control, before = None, math.nan
            if control is None:
                experiment.note = (
                    f"From {origin.record.op} down the chain re-run as it ran is finite too: its saved inputs "
                    "changed since (an in-place write), so it decides nothing."
                )
                break
            _settle_origin(experiment, origin, chain, before, lookup, symptom=symptom)
            return experiment
        else:
            if edge and not experiment.note:
                experiment.note = (
                    f"The walk upstream stopped after {experiment.walked} ops: earlier ones are no longer kept."
                )
        if experiment.fp64 is not None and experiment.fp64 != "finite":
            # a custom op's fp64 run is its own kernel again: it cannot tell the math from the kernel
            experiment.verdict = "the-math" if _transparent(target) else "opaque"
            if experiment.verdict == "the-math" and op_packet(target_record.op) == "div":
                experiment.divisor_guard = _try_divisor(target, symptom)
    return experiment


def _try_divisor(target: Step, symptom: frozenset[str]) -> tuple[float, float] | None:
    """The division as it ran with its tensor denominator plus its format's eps (the guard the fix
    prints): (eps, the output's largest |x|) where that removes the symptom, else None."""
    args = target.args
    if len(args) < 2 or not (isinstance(args[1], torch.Tensor) and args[1].is_floating_point()):
        return None
    eps = float(torch.finfo(args[1].dtype).eps)
    try:
        out = target.func(args[0], args[1] + eps, *args[2:], **(target.kwargs or {}))
    except Exception:
        return None
    if not isinstance(out, torch.Tensor):
        return None
    return None if _kinds([out]) & symptom else (eps, _absmax(out))


# random draws a fresh one can stand in for: uniform and normal, by the op's packet
_UNIFORM = frozenset({"rand", "rand_like", "uniform", "uniform_"})
_NORMAL = frozenset({"randn", "randn_like", "normal", "normal_"})


def _drawn_narrow(
    experiment: Experiment, origin: Step, chain: list[Step], lookup: Lookup | None, symptom: frozenset[str]
) -> bool:
    """Where the walk reached a uniform or normal draw made in bf16/fp16: the chain re-run as it ran
    on a fresh fp32 draw of the same shape (a private generator: the user's RNG is not touched).
    Cured there, the draw is the origin (experiment.verdict "draw") and True."""
    packet = op_packet(origin.record.op)
    out = origin.record.outputs[0] if origin.record.outputs else None
    if packet not in _UNIFORM | _NORMAL or out is None or out.dtype not in ("torch.bfloat16", "torch.float16"):
        return False
    made = next((t for t in tree_flatten((origin.args, origin.kwargs or {}))[0] if isinstance(t, torch.Tensor)), None)
    device = made.device if made is not None else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    draw = torch.rand if packet in _UNIFORM else torch.randn
    fresh = draw(tuple(out.shape), generator=generator, dtype=torch.float32, device=device)
    try:
        after = _cured_from(chain, 1, fresh, lookup, symptom) if len(chain) > 1 else None
    except Exception:
        return False
    if after is None:
        return False
    dtype = getattr(torch, out.dtype.removeprefix("torch."))
    top = 1.0 - torch.finfo(dtype).eps / 2 if packet in _UNIFORM else None
    experiment.verdict, experiment.origin = "draw", origin.record
    experiment.chain = [s.record for s in chain]
    experiment.draw = (out.dtype.removeprefix("torch."), top, after)
    return True


def _transparent(step: Step) -> bool:
    """An op whose fp64 run is the reference arithmetic (aten, prims), not a custom kernel run again."""
    return getattr(step.func, "namespace", "aten") in ("aten", "prims")


# A replacement constant must also keep the derivative the backward takes through it within the
# dtype: at most its largest value / SLOPE_ROOM, which leaves room for a loss scale and the gradient
# arriving from above (rsqrt(6e-5)'s derivative is 1e6: the forward is finite, its backward not).
SLOPE_ROOM = 64.0
_LADDER = (1e-4, 1e-3, 1e-2, 1e-1)  # after the dtype's smallest normal value, larger ones in turn


def _try_constant(
    literal: tuple[float, float, str], origin: Step, chain: list[Step], lookup: Lookup | None, symptom: frozenset[str]
) -> tuple[float, float] | None:
    """The chain as it ran with the constant replaced by the smallest value of a ladder (the dtype's
    smallest normal value first) that removes the symptom and whose derivative through the chain
    fits the dtype (measured in fp64 by a relative step of the constant): the fix that keeps the
    dtype, printed only when one does."""
    dtype = getattr(torch, literal[2])
    limit = float(torch.finfo(dtype).max)
    room = limit / SLOPE_ROOM
    tiny = _tiny(literal[2])
    ladder: tuple[float, ...] = (tiny, *(v for v in _LADDER if v > tiny))
    if not math.isfinite(literal[1]):
        # a constant past the range (a mask fill of torch.finfo(torch.float32).min): its nearest value the
        # dtype holds, with its sign, then smaller ones; never a small one, which would unmask what it masks
        ladder = tuple(math.copysign(v, literal[0]) for v in (limit, limit / 4, 1e4) if v <= limit)
    for value in ladder:
        kind, after = _chain_kind(_with_constant(literal[0], value, origin, chain), None, lookup, symptom)
        if kind is not None:
            continue
        # a chain that ends in the backward computed the gradient itself; one in the forward has its
        # backward still to come: the derivative through it must fit too
        if chain[-1].record.phase != "forward" or _slope(literal[0], value, origin, chain, lookup) <= room:
            return value, after
    return None


def _past_range(step: Step) -> float | None:
    """The largest finite |value| of a narrowing cast's source where it is past its format's largest
    (the cast made Inf); None otherwise."""
    dtype = _compute_dtype(step)
    source = next((t for t in tree_flatten(step.args)[0] if isinstance(t, torch.Tensor)), None)
    if dtype not in _NARROW or source is None or not source.is_floating_point():
        return None
    finite = source[torch.isfinite(source)]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    return largest if largest > float(torch.finfo(dtype).max) else None


def _fed(step: Step) -> bool:
    """The cast reads a tensor autograd records nothing of: data the model is fed as the batch holds it."""
    source = next((t for t in tree_flatten(step.args)[0] if isinstance(t, torch.Tensor)), None)
    return source is not None and not source.requires_grad and source.grad_fn is None


def _data(step: Step) -> bool:
    """A forward cast outside any module of a tensor autograd records nothing of: data (targets or
    features as the batch holds them), not a value the model made."""
    source = next((t for t in tree_flatten(step.args)[0] if isinstance(t, torch.Tensor)), None)
    return step.record.module is None and source is not None and not source.requires_grad and source.grad_fn is None


# a cast as a line writes it: .half(), .bfloat16(), .type(...), .type_as(...), dtype=..., .to(...) of
# anything but a device
# a cast the line writes; `.to(` a device is a move, however the device is named (args.device, local_rank)
_CAST_WRITTEN = re.compile(
    r"\.(half|bfloat16|type|type_as)\(|dtype\s*=|\.to\((?![^)]*(\bdevice|\bdev\b|rank\b|[\"']cuda|[\"']cpu))"
)


_MATMULS = frozenset({"mm", "bmm", "matmul", "addmm", "baddbmm", "addbmm", "linear", "convolution"})
_MATMUL = re.compile(r"@|\b(matmul|mm|bmm|einsum|linear|baddbmm|addmm)\(")


def _matmul_note(origin: Record, method: str = "float") -> str:
    """Where the op's line also multiplies matrices: autocast casts a matmul's .float() operands back to
    its dtype, so the operands of the op itself are what take .float() (the product's result), or the
    line runs with autocast off. `method`: the cast the fix writes (.float(), .double())."""
    if op_packet(origin.op) in _MATMULS:  # the op is the matmul: only autocast off keeps it in fp32
        return (
            "; under autocast, do it inside torch.autocast(device, enabled=False), which otherwise casts a matmul's "
            ".float() operands back"
        )
    if not _MATMUL.search(_line_text(origin)):
        return ""
    return (
        f"; on that line autocast casts a matmul's .{method}() operands back to fp16: take .{method}() of "
        f"the product ((a @ b).{method}()), or run the line inside torch.autocast(device, enabled=False)"
    )


def _finfo(record: Record, dtype: str) -> str:
    return finfo_spelled(_line_text(record), dtype)


def finfo_spelled(code: str, dtype: str) -> str:
    """torch.finfo of the dtype an op ran in, as the user's line `code` can write it: of a tensor whose
    .dtype the line already reads (`scores.dtype`: the format it ran in, under autocast too), else of
    the format itself (`dtype`, "float16"), whose limit every wider format holds."""
    named = _DTYPE_OF.search(code)
    return f"torch.finfo({named.group(1)}.dtype)" if named else f"torch.finfo(torch.{dtype})"


_DTYPE_OF = re.compile(r"([A-Za-z_][\w.]*)\.dtype\b")


def autocasts(record: Record) -> bool:
    """A cast autocast made, of a module's input: its source line writes none (a line that cannot be
    read counts as written). Autocast's own state cannot tell: inside its cast, torch reports it off."""
    line = _line_text(record)
    return bool(line) and not _CAST_WRITTEN.search(line)


# A line that clips gradients by their norm with torch's function (its norm is taken in their dtype)
_CLIP = re.compile(r"clip_grad_norm_?\(")


def _clip_args(line: str) -> tuple[str, str] | None:
    """The parameters and max_norm a clip_grad_norm_ call on `line` passes, as written (positional or
    by keyword); None where the line calls none or they cannot be read."""
    found = _CLIP.search(line)
    if found is None:
        return None
    depth, parts, start, i = 0, [], found.end(), found.end()
    for i in range(found.end(), len(line)):  # the call's top-level arguments
        c = line[i]
        if c in "([{":
            depth += 1
        elif c in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(line[start:i].strip())
            start = i + 1
    else:
        return None
    parts.append(line[start:i].strip())
    named = dict(p.split("=", 1) for p in parts if "=" in p and not p.startswith(("(", "[")))
    named = {k.strip(): v.strip() for k, v in named.items()}
    positional = [p for p in parts if not ("=" in p and not p.startswith(("(", "[")))]
    params = named.get("parameters", positional[0] if positional else None)
    max_norm = named.get("max_norm", positional[1] if len(positional) > 1 else None)
    return (params, max_norm) if params and max_norm else None


def _line_text(record: Record) -> str:
    """The record's source line as written, empty where it cannot be read."""
    return linecache.getline(record.location[0], record.location[1]) if record.location else ""


SENTINEL_SIZE = 1e8  # a value past a format's range this large is written as a fill, not measured


def _sentinel_like(origin: Step) -> bool:
    """The values a cast takes past its format's range are a sentinel (a mask's -1e9, float32's lowest:
    one or two values), not data in large units (incomes, raw sensor counts: many values), which holding at
    the limit would change: those want scaling, or a format with the range."""
    dtype = _compute_dtype(origin)
    source = origin.args[0] if origin.args else None
    if dtype is None or not isinstance(source, torch.Tensor) or not source.is_floating_point():
        return True
    with torch.no_grad():
        past = source[torch.isfinite(source) & (source.abs() > torch.finfo(dtype).max)]
        if past.numel() == 0:
            return True
        # a fill written far past any range (-1e9, float32's lowest), one or two values of it
        return int(past.unique().numel()) <= 2 and float(past.abs().min()) >= SENTINEL_SIZE


def _try_saturated(
    origin: Step, chain: list[Step], lookup: Lookup | None, symptom: frozenset[str]
) -> tuple[float, float] | None:
    """The chain as it ran with the cast holding its format's largest finite value (with the sign)
    where it made Inf of a finite value: (that value, the symptom op's max |x|) when that removes the
    symptom, else None."""
    dtype = _compute_dtype(origin)
    assert dtype is not None
    limit = float(torch.finfo(dtype).max)
    func = origin.func

    def saturating(*args: Any, **kwargs: Any) -> Any:
        out = func(*args, **kwargs)
        source = args[0]
        made = torch.isinf(out) & torch.isfinite(source)
        return torch.where(made, out.sign() * limit, out)

    held = Step(origin.record, saturating, origin.args, origin.kwargs)
    kind, after = _chain_kind([held if s is origin else s for s in chain], None, lookup, symptom)
    return (limit, after) if kind is None else None


def _try_guard(target: Step) -> tuple[float, float] | None:
    """The guard the fix prints, checked where it acts: the forward op's derivative at the clamp's
    bound, in the dtype the backward ran in (sqrt and x ** p at x = eps, x.clamp_min(eps); acos and
    asin at x = 1 - eps, x.clamp(-1 + eps, 1 - eps), eps the format's spacing at 1, the least it
    holds there). Past the bound the derivative is smaller, so finite there is finite everywhere the
    clamp lets x go: (eps, that derivative), or None where it is not finite."""
    dtype = _compute_dtype(target) or torch.float32
    forward = op_packet(target.record.forward_op or "")
    if forward in ("acos", "asin"):
        eps = float(torch.finfo(dtype).eps)
        x = torch.tensor(1.0 - eps, dtype=dtype)
        derivative = (1 - x * x).rsqrt()
    else:
        eps = GUARD_EPS.get(dtype, 1e-12)
        x = torch.tensor(eps, dtype=dtype)
        # x ** p: the backward's own pow(x, p - 1) names p; sqrt is p = 1/2
        scalar = target.args[1] if op_packet(target.record.op) == "pow" and len(target.args) > 1 else None
        p = float(scalar) + 1.0 if forward == "pow" and isinstance(scalar, (int, float)) else 0.5
        derivative = p * x ** (p - 1.0)
    value = float(derivative.abs())
    return (eps, value) if math.isfinite(value) else None


def _with_constant(old: float, new: float, origin: Step, chain: list[Step]) -> list[Step]:
    flat, spec = tree_flatten((origin.args, origin.kwargs or {}))
    flat = [new if type(v) is float and v == old else v for v in flat]
    args, kwargs = tree_unflatten(flat, spec)
    changed = Step(origin.record, origin.func, args, kwargs)
    return [changed if s is origin else s for s in chain]


def _slope(old: float, value: float, origin: Step, chain: list[Step], lookup: Lookup | None) -> float:
    """The largest change of the chain's output per unit change of the constant, in fp64."""
    step = value * 1e-4
    low = _replay(_with_constant(old, value, origin, chain), torch.float64, lookup)
    high = _replay(_with_constant(old, value + step, origin, chain), torch.float64, lookup)
    change = [(h - lo).abs().max() for h, lo in zip(high, low, strict=False) if h.is_floating_point()]
    found = float(max(change, default=torch.zeros(())) / step)
    return found if math.isfinite(found) else math.inf


def completed_form(experiment: Experiment, steps: list[Step]) -> None:
    """A composite whose first op made the symptom (exp overflows in log(exp(x).sum(dim))): the
    experiment ran at that op, before the ops that complete the form had run. `steps`: that op,
    then the ops that read its output in turn (found by the trace as they run); where they are a
    form of stable.py, its stable form is checked as where the whole chain made the symptom."""
    if experiment.verdict not in ("origin", "the-math") or len(steps) < 2:
        return
    # a form the chain itself is decides; one completed before gives way to a longer one (its log, later)
    if experiment.stable is not None and len(steps) <= len(experiment.form_records):
        return
    found = _form_in(steps)
    if found is None or found[0].prefix or found[1] != len(steps):
        return
    form, _, picked = found
    reduction = next((s for s in steps if op_packet(s.record.op) in _REDUCTIONS), None)  # its dim is the form's
    checked = stable.check(form, steps[0].args, reduction.args if reduction is not None else (), picked=picked)
    if checked is not None:
        experiment.stable, experiment.completed = checked, [s.record for s in steps]


def _form_in(chain: list[Step]) -> tuple[stable.Form, int, tuple[str, ...]] | None:
    """The stable.py form the chain is or starts with, its ops picked values passed over
    (`PICKS`): the form, how many of the chain's ops it spans, and the picks among them."""
    kept = [i for i, s in enumerate(chain) if op_packet(s.record.op) not in PICKS]
    form = stable.form_of([op_packet(chain[i].record.op) for i in kept])
    if form is None:
        return None
    end = kept[len(form.ops) - 1] + 1
    picks = [s for s in chain[:end] if op_packet(s.record.op) in PICKS]
    # a pick is passed over only on the numerator's side of a division: one that the reduction reads makes
    # another sum (log of a sum over picked columns is not logsumexp of them all)
    summed = {i for s in chain[:end] if op_packet(s.record.op) in _REDUCTIONS for k, i in s.record.inputs if k == "op"}
    if picks and ("div" not in form.ops or any(s.record.index in summed for s in picks)):
        return None
    picked = tuple(dict.fromkeys(op_packet(s.record.op).removesuffix("_copy") for s in picks))
    return form, end, picked


def _settle_origin(
    experiment: Experiment,
    origin: Step,
    chain: list[Step],
    before: float,
    lookup: Lookup | None,
    *,
    symptom: frozenset[str] = _ANY,
) -> None:
    """Name the origin and check the fix in the narrowest precision that removes the symptom."""
    experiment.verdict = "origin"
    experiment.origin = origin.record
    experiment.chain = [s.record for s in chain]
    try:  # naming the constant or the cast is a detail: the origin stands without it
        experiment.literal = _literal(origin)
        experiment.cast = _cast(origin)
        if experiment.literal is not None:
            experiment.literal_fix = _try_constant(experiment.literal, origin, chain, lookup, symptom)
        # a gradient the backward casts to its value's dtype is not a value the user wrote: holding it at
        # the limit would clip it; the fix is the dtype the value had (below) or a smaller gradient
        largest = _past_range(origin) if experiment.cast is not None else None
        if largest is not None and origin.record.phase != "backward":
            if autocasts(origin.record):  # autocast's cast of a module's input: no value to write
                experiment.autocast_cast = True
                experiment.autocast_data = _fed(origin)
            elif _sentinel_like(origin):  # a mask value past the range: its limit is the value to write
                experiment.saturated_fix = _try_saturated(origin, chain, lookup, symptom)
            elif _data(origin):  # data in large units, cast by the script
                experiment.data_cast = largest
    except Exception:
        pass
    try:  # a composite torch computes in a stable form (stable.py): that form is the fix
        found = _form_in(chain)
        # a pick inside the form leaves its value a part of the whole the stable form makes: the ops after
        # it cannot be re-run on that whole, so such a form is checked only where it ends the chain
        if found is not None and (found[1] == len(chain) or not found[2]):
            form, k, picked = found
            reduction = next((s for s in chain[:k] if op_packet(s.record.op) in _REDUCTIONS), None)
            experiment.stable = stable.check(
                form, origin.args, reduction.args if reduction is not None else (),
                (lambda y: _cured_from(chain, k, y, lookup, symptom)) if k < len(chain) else None, picked=picked,
            )  # fmt: skip
            if picked and experiment.stable is not None:
                experiment.completed = [s.record for s in chain[:k]]
    except Exception:
        pass
    experiment.absmax_before = before
    ran = {t.dtype for s in chain for t in tree_flatten(s.args)[0] if isinstance(t, torch.Tensor)}
    ran |= {d for s in chain if (d := _compute_dtype(s)) is not None}  # a cast's target: what it ran in
    if torch.float16 in ran:  # fp16 advice names bf16: say what bf16 does here
        try:
            kind, experiment.bf16_absmax = _chain_kind(chain, torch.bfloat16, lookup, symptom)
            experiment.bf16 = "finite" if kind is None else "non-finite"
        except Exception:
            experiment.bf16 = None
    for dtype in (torch.float32, torch.float64):
        if dtype == torch.float32 and ran <= {torch.float32, torch.float64}:
            continue  # the chain ran in fp32 already: the check is fp64
        try:
            kind, after = _chain_kind(chain, dtype, lookup, symptom)
        except Exception:
            continue
        if kind is None:
            experiment.checked_in = dtype_name(dtype).removeprefix("torch.").replace("float", "fp")
            experiment.absmax_after = after
            return
