"""From trace records to findings: producers, the sinks they reach, inputs, masked values.

Roles of a record with a non-finite output:
  nan-producer  NaN out, no NaN in (Inf in is allowed: inf - inf, 0 * inf)
  inf-producer  Inf out, every input finite (overflow, division by zero, log(0))
  constant      no tensor inputs (torch.full(..., nan), an -inf attention mask)
  propagator    passes on what it received
`origins` of a record are the producers, constants and leaves its non-finite values come from.
A producer is blamed when a sink it reaches is non-finite; the first NaN producer and the first
Inf producer are reported separately. An -inf constant feeding a NaN producer (a mask row that
is entirely masked) is evidence for that producer, not an error of its own.

An Inf need not reach a sink as Inf to do harm: rsqrt(Inf) = 0, exp(-Inf) = 0, x / Inf = 0. When
an op of that kind turns an *overflow's* Inf into finite values and those reach a sink, the
overflow is reported as `nonfinite-zeroed`. Infinities written on purpose (masked_fill, where,
full: attention masks) are masking, and a producer nobody downstream sees stays
`nonfinite-masked`.

Under an enabled GradScaler a step it skipped is judged with the scaler (scaler_skips.py): the
non-finite gradients of a step skipped while the scale calibrates are a note, not a producer to
blame; a scaler that keeps skipping is one error naming the recurring origin, before the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from fpdoctor import catalog
from fpdoctor.numerics.engine.reruns import (
    SINGULAR,
    ZEROING,
    Experiment,
    custom_op_fix,
    finfo_spelled,
    transparent_op,
)
from fpdoctor.numerics.observe.amp import MAX_CONSECUTIVE_SKIPS
from fpdoctor.numerics.observe.loader import rows_text
from fpdoctor.numerics.trace.bounds import impossible
from fpdoctor.numerics.trace.recipes import range_cause
from fpdoctor.numerics.trace.scaler_skips import ScalerRun, recurring
from fpdoctor.numerics.trace.steps import StepCounter
from fpdoctor.numerics.trace.tracer import RETURNED, Leaf, Record, Tracer
from fpdoctor.report.model import Finding, Trial
from fpdoctor.report.render import ordinal

Origin = tuple[str, int]  # ("op", record index) or ("leaf", leaf index)

# Ops that turn an Inf input into a finite output without any masking intent: zeros (rsqrt,
# reciprocal, exp(-inf), x / inf, inf ** negative) or saturated values (sigmoid, tanh, erf, atan).
# Ops that write an infinity on purpose (attention masks): their Inf is a mask, not an overflow.
_DELIBERATE = frozenset({
    "masked_fill", "masked_fill_", "where", "full", "full_like", "fill", "fill_", "new_full", "scalar_tensor",
    "index_put", "index_put_", "scatter", "scatter_", "masked_scatter", "masked_scatter_", "index_fill",
    "index_fill_",
})  # fmt: skip
_SATURATING = frozenset({"sigmoid", "tanh", "erf", "erfc", "atan"})
# a division by one number held as +Inf from the start (a count or a size past fp16's range) makes its values 0
_DIVIDES = frozenset({"div", "div_"})
_SOFTMAXES = frozenset({"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"})
# ops a mask's -inf passes through on its way to the softmax: casts, views, copies, a triangle of it (a causal
# mask), an additive mask's sum (baddbmm and addmm add it to the scores inside nn.MultiheadAttention), a scale
_PASSES_MASK = frozenset({
    "_to_copy", "to", "clone", "contiguous", "view", "reshape", "expand", "unsqueeze", "squeeze", "transpose",
    "permute", "_unsafe_view", "alias", "slice", "select", "add", "add_", "sub", "sub_", "repeat", "triu", "tril",
    "cat", "constant_pad_nd", "baddbmm", "addmm", "mul", "mul_", "div", "div_", "masked_fill", "masked_fill_",
    "where", "copy_", "expand_copy", "index_select",
})  # fmt: skip
# sums that add a mask to the scores: its fill must leave them room
_ADDS = frozenset({"add", "add_", "sub", "sub_", "baddbmm", "addmm"})
_FILLED = re.compile(r"([A-Za-z_][\w.]*)\.masked_fill_?\(")  # `scores.masked_fill(` -> scores
# GradScaler's unscaling of the gradients (by 1/scale, checking them for Inf/NaN as it goes)
_UNSCALE = frozenset({"_amp_foreach_non_finite_check_and_unscale_", "_amp_non_finite_check_and_unscale_"})


# floating formats by their largest value, smallest first: the narrowest a mask's -inf passes through
_BY_RANGE = ("torch.float8_e4m3fn", "torch.float8_e5m2", "torch.float16", "torch.bfloat16", "torch.float32",
             "torch.float64")  # fmt: skip


def _narrower(a: str | None, b: str | None) -> str | None:
    """Of two dtypes ("torch.float16"), the one with the smaller largest value (None: unknown)."""
    known = [d for d in (a, b) if d in _BY_RANGE]
    return min(known, key=_BY_RANGE.index) if known else (a or b)


def _mask_write(r: Record) -> bool:
    """An op that writes an infinity on purpose, -inf from finite inputs: only its literal fill
    value can have made it (a causal attention mask)."""
    return _packet(r.op) in _DELIBERATE and r.kind == "-inf"


def _packet(op: str) -> str:
    """'aten.div.Tensor' -> 'div': the overload packet's name."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else op


def _known(values: dict[str, Any]) -> dict[str, Any]:
    """Keys whose value is unknown are omitted (`module` may be null: outside any module)."""
    return {k: v for k, v in values.items() if v is not None or k == "module"}


def _count(call: int | None) -> int | None:
    """Calls are kept from 0 and shown from 1, as users count steps (the 80th call is 80)."""
    return None if call is None else call + 1


def _written_scalar(leaf: Leaf, first: Record) -> bool:
    """A 0-dim value seen first by an in-place write: a Python scalar the code assigned."""
    return leaf.origin is None and leaf.name == "input" and not leaf.shape and _packet(first.op).endswith("_")


def where_text(path: tuple[str, int, str] | None) -> str | None:
    """'file:line in function', as every finding of the trace words a source line."""
    return f"{path[0]}:{path[1]} in {path[2]}" if path else None


def _leaf_origin(leaf: Leaf) -> str:
    """parameter (a named parameter or buffer), input, or collective (received from other ranks)."""
    return leaf.origin or ("parameter" if leaf.name != "input" else "input")


def _leaf_text(leaf: Leaf) -> str:
    origin = _leaf_origin(leaf)
    return f"parameter {leaf.name}" if origin == "parameter" else "an input tensor" if origin == "input" else leaf.name


def module_text(module: str | None) -> str:
    """'in module `enc.0`', 'in the root module' or 'outside any module'."""
    if module is None:
        return "outside any module"
    return f"in module `{module}`" if module else "in the root module"


class Analysis:
    def __init__(self, tracer: Tracer, steps: StepCounter | None = None) -> None:
        self.tracer = tracer
        self.steps = steps  # optimizer steps, for "at optimizer step 2" beside the call count
        self.records = tracer.records
        stored = {i for kind, i, said in tracer.sinks if kind == "op" and said.startswith("gradient of")}
        for experiment in tracer.experiments.values():  # an origin whose output is a parameter's gradient
            experiment.stored = experiment.origin is not None and experiment.origin.index in stored
        self.leaves = tracer.leaves
        self.roles: dict[int, str] = {}
        self.origins: dict[int, frozenset[Origin]] = {}
        self.reached: dict[Origin, list[str]] = defaultdict(list)
        self._classify()
        self._reach()

    def kind_of(self, src: tuple[str, int]) -> str | None:
        return self.records[src[1]].kind if src[0] == "op" else self.leaves[src[1]].kind

    def _classify(self) -> None:
        for r in self.records:
            if not r.kind:
                continue
            bad_inputs = [(src, k) for src in r.inputs if (k := self.kind_of(src))]
            if not r.inputs:
                role = "constant"
            elif r.kind == "nan" and not any(k == "nan" for _, k in bad_inputs):
                role = "nan-producer"
            elif r.kind != "nan" and not bad_inputs:
                role = "inf-producer"
            else:
                role = "propagator"
            origins: set[Origin] = {("op", r.index)} if role != "propagator" else set()
            for src, _ in bad_inputs:
                origins |= self.origins.get(src[1], frozenset()) if src[0] == "op" else {src}
            self.roles[r.index] = role
            self.origins[r.index] = frozenset(origins)

    def _reach(self) -> None:
        for kind, index, description in self.tracer.sinks:
            if kind == "op" and self.records[index].kind:
                for origin in self.origins.get(index, ()):
                    if description not in self.reached[origin] and len(self.reached[origin]) < 8:
                        self.reached[origin].append(description)

    # -- describing -----------------------------------------------------------------------------
    def made_from(self, r: Record) -> str:
        """' from finite inputs', or ' from inf in aten.add.Tensor (...)': the non-finite inputs an
        op was handed, so that a NaN made of an Inf is never said to come from finite values."""
        fed = [s for s in r.inputs if self.kind_of(s)]
        if not fed:
            return " from finite inputs"
        return " from " + ", ".join(f"{self.kind_of(s)} in {self.source_text(s)}" for s in fed[:2])

    def source_text(self, src: tuple[str, int]) -> str:
        if src[0] == "leaf":
            leaf = self.leaves[src[1]]
            return _leaf_text(leaf)
        r = self.records[src[1]]
        return f"{r.op} ({module_text(r.module)})"

    def input_stats(self, record: Record) -> list[dict[str, Any]]:
        if record.input_stats is not None:  # measured on the live inputs when the op ran
            return [
                {"from": self.source_text(src), **st, "nonfinite": self.kind_of(src)}
                if st is not None
                else self._recorded_stats(src)  # written in place by this op: its values before the write
                for src, st in zip(record.inputs, record.input_stats, strict=False)
            ]
        return [self._recorded_stats(src) for src in record.inputs[:6]]

    def _recorded_stats(self, src: tuple[str, int]) -> dict[str, Any]:
        """What the trace knew of an input from the op or leaf that made it."""
        lo: float | None
        hi: float | None
        item: Leaf | Record = self.leaves[src[1]] if src[0] == "leaf" else self.records[src[1]]
        if isinstance(item, Leaf):
            lo, hi, dtype, shape, kind = item.lo, item.hi, item.dtype, item.shape, item.kind
        else:
            out = item.outputs[0]
            lo, hi, dtype, shape, kind = out.lo, out.hi, out.dtype, out.shape, item.kind
        return {"from": self.source_text(src), "dtype": dtype, "shape": list(shape), "min": lo, "max": hi,
                "nonfinite": kind}  # fmt: skip

    def where(self, r: Record) -> dict[str, Any]:
        where: dict[str, Any] = _known({"module": r.module, "op": r.op, "phase": r.phase, "iteration": _count(r.call)})
        if r.node:
            where["autograd_node"] = r.node
        if r.forward_op:
            where["forward_op"] = r.forward_op
        if r.recompute:
            where["recompute"] = True
        return where

    def step_of(self, r: Record) -> tuple[int, bool] | None:
        return self.steps.step_of(r.index, r.phase) if self.steps is not None else None

    def when(self, r: Record) -> str:
        """', optimizer step 2, module call 12': when it happened, as a training log counts; the
        call count alone (', call 12') where no optimizer stepped."""
        step = self.step_of(r)
        call = r.call + 1 if r.call is not None else None
        if step is None:
            if r.item is not None:  # in a Dataset's __getitem__: the item it read, not the line's count
                return f", reading dataset[{r.item}]"
            return f", call {call}" if r.call else ""
        n, evaluating = step
        if not evaluating:
            text = f", optimizer step {n}"
        else:
            text = f", in an evaluation after optimizer step {n}" if n else ", in an evaluation before the first step"
        if call is not None and r.phase != "optimizer":  # in the optimizer, the call is the step
            if r.module is not None:
                text += f", module call {call}"
            elif r.item is not None:  # in a Dataset's __getitem__: the item it read, not the line's count
                text += f", reading dataset[{r.item}]"
            elif call > 1:  # outside modules: the line's count
                text += f", the {ordinal(call)} time this line ran"
        return text

    def at_step(self, r: Record) -> str:
        """' (forward, optimizer step 2, module call 12)' where steps were counted, else ''."""
        return f" ({r.phase}{self.when(r)})" if self.step_of(r) is not None else ""

    def step_evidence(self, r: Record) -> dict[str, Any]:
        """evidence.step (from 1, as a training log counts), and `evaluation` for an evaluation forward."""
        step = self.step_of(r)
        item = {"dataset_index": r.item} if r.item is not None else {}  # made in a Dataset's __getitem__
        if step is None:
            return item
        n, evaluating = step
        return {**({"step": n} if n else {}), **({"evaluation": True} if evaluating else {}), **item}

    def _tried(self, r: Record, advice: str) -> tuple[str, Trial]:
        """The fix for the op `r` made NaN/Inf, as its experiment decided and checked it where one ran
        (experiments.py), else its advice, untried."""
        experiment = self.tracer.experiments.get(r.index)
        if experiment is None:
            return advice, Trial.untried(
                _unexperimented([s for s in r.inputs if self.kind_of(s)], self.tracer.experiments)
            )
        if _guard_checked(r, experiment):
            return _guarded(r, experiment, advice)
        _, _, fix, trial = experiment.word("", "", advice, "")
        return fix, trial

    def producer_finding(self, r: Record, label: str, others: list[Record]) -> Finding:
        out = next(o for o in r.outputs if o.kind)
        kinds = [k for k in ("nan", "+inf", "-inf") if out.counts and out.counts.get(k)] or [str(out.kind)]
        count = sum(out.counts.values()) if out.counts else None
        numel = math.prod(out.shape)
        reaches = self.reached.get(("op", r.index), [])
        fed = [s for s in r.inputs if self.kind_of(s)]
        from_text = self.made_from(r)
        location = where_text(r.location)
        phase = r.phase + (" (activation-checkpoint recompute)" if r.recompute else "")
        message = (
            f"{self._op_text(r).rstrip()} ({phase}{self.when(r)}"
            + f") produced {count if count is not None else 'some'} {'/'.join(kinds)} of {numel} values"
            f"{from_text}; they reach {', '.join(reaches[:3]) or 'a sink'}."
            + (f" Source: {location}." if location else "")
        )
        evidence: dict[str, Any] = {
            "kind": kinds[0],
            "count": count,
            "numel": numel,
            "dtype": out.dtype,
            "shape": list(out.shape),
            "counts": out.counts,
            "inputs": self.input_stats(r),
            "reaches": reaches,
            "location": location,
            "first": label,
            **self.step_evidence(r),
        }
        if others:
            # each op and line once: the same op on the same line in five steps is one other producer
            evidence["other_producers"] = list(
                dict.fromkeys(
                    f"{o.op} {module_text(o.module)} ({o.phase})"
                    + (f" at {where_text(o.location)}" if o.location else "")
                    for o in others
                )
            )[:5]
            # a loss by hand per head, each line its own exp: one change on every such line
            if lines := self._same_op_lines(r, others):
                evidence["same_op_at"] = lines
                evidence["same_op_checked"] = self._checked_lines(others, lines)
        # the same hand-written composite on other lines (a softmax or log-sum-exp by hand per head), overflowed
        # in this run or not yet: each wants its stable form (same_line.py)
        forms = self.tracer.forms
        here_line = (where_text(r.location) or "").split(" in ", 1)[0]
        if here_line in forms and len(forms) > 1:
            evidence["forms_at"] = {
                line: {**dataclasses.asdict(met), "edge": met.edge} for line, met in forms.items() if line != here_line
            }
        title = (
            f"{label}: {r.op} produced {kinds[0]} from finite inputs"
            if not fed
            else f"{label}: {r.op} turned {self.kind_of(fed[0])} into {kinds[0]}"
        )
        fix = _fix_for(r)
        if not fed and impossible(r.bound, out.dtype):
            evidence["arithmetic_bound"] = r.bound
            title = f"{label}: {r.op} produced {kinds[0]} that arithmetic cannot produce from its inputs"
            message += (
                f" Arithmetic cannot explain it: from these finite inputs no output of {r.op} can exceed "
                f"{r.bound:.4g} in magnitude (|inputs| multiplied and summed in float64), below "
                f"{out.dtype.removeprefix('torch.')}'s largest value."
            )
            fix = _IMPOSSIBLE
        experiment = self.tracer.experiments.get(r.index)  # what re-running it decided (experiments.py)
        if experiment is not None:
            name = f"the backward of {r.forward_op} ({r.op})" if r.phase == "backward" and r.forward_op else ""
            title, message, fix, trial = experiment.word(title, message, fix, label, name)
            if _guard_checked(r, experiment):  # the point kept out, checked: that is the fix, whatever the walk found
                fix, trial = _guarded(r, experiment, _advice(r))
            message += experiment.rows_text()  # where only some rows of the batch make it: which
            evidence["experiment"] = experiment.evidence()
        else:
            trial = Trial.untried(_unexperimented(fed, self.tracer.experiments))
        # a softmax handed only -inf makes NaN in a row where every value is -inf, and nowhere else; a mask
        # wrote them (an overflow to -inf is the overflow's finding)
        mask = (
            self._mask_behind(fed[0])
            if fed and _packet(r.op) in _SOFTMAXES and kinds[0] == "nan" and all(self.kind_of(f) == "-inf" for f in fed)
            else None
        )
        if mask is not None:
            extra, fix, trial = self._fully_masked(r, *mask)
            message += extra
            evidence["fully_masked"] = True
        elif fed and (experiment is None or experiment.verdict != "origin"):
            # handed a non-finite value, it made another kind (inf * 0, inf - inf): the cause is upstream
            handed = f"{self.kind_of(fed[0])} in {self.source_text(fed[0])}"
            fix = (
                f"Fix what made its input non-finite ({handed}): the finding of the op that first made it names "
                f"its cause. {r.op} only "
                f"turned it into {kinds[0]}; guarding it here would hide the value, not remove it."
            )
            trial = Trial.untried(
                "its input was already non-finite: the op that made it is the cause, and its finding carries the trial"
            )
        return catalog.make(
            "nonfinite-produced",
            title=title,
            message=message,
            where=self.where(r),
            evidence=_known(evidence),
            fix=fix,
            trial=trial,
        )

    def _mask_behind(self, src: tuple[str, int]) -> tuple[Record, bool, str] | None:
        """The op that wrote the -inf a softmax read, back through every -inf input past casts, views and
        additions (an additive mask: scores + bias), where it is a mask's write (masked_fill, where, an
        index_put of -inf, a full of it): (that op, whether an addition came between, the narrowest format
        the -inf passed through on the way, where a finite fill must hold). None where an op made it
        otherwise (an overflow)."""
        todo: list[tuple[tuple[str, int], bool, str | None]] = [(src, False, None)]
        seen: set[int] = set()
        while todo and len(seen) < 64:
            (kind, index), added, narrow = todo.pop()
            if kind != "op" or index in seen:
                continue
            seen.add(index)
            made = self.records[index]
            out = next((o.dtype for o in made.outputs if o.kind), None)
            narrow = _narrower(narrow, str(out) if out is not None else None)
            if _mask_write(made):
                return made, added, narrow or "torch.float32"
            name = _packet(made.op)
            if name not in _PASSES_MASK:
                continue
            for s in made.inputs:
                if self.kind_of(s) == "-inf":
                    todo.append((s, added or name in _ADDS, narrow))
        return None

    def _fully_masked(self, r: Record, writer: Record, added: bool, narrow: str) -> tuple[str, str, Trial]:
        """A softmax of a row that holds -inf alone (every key masked: an empty or fully padded
        sequence) is 0/0: what to say, the fix at the line that wrote the -inf (`writer`, the mask; `added`:
        added to the scores after it), in the narrowest format it passed through (`narrow`: a mask built in
        fp32 and cast to fp16 must hold in fp16), and why it is not re-run."""
        at = writer.location
        code = linecache.getline(at[0], at[1]).strip() if at is not None else ""
        out = next((o for o in writer.outputs if o.kind), None)
        own = str(out.dtype) if out is not None else "torch.float32"
        finfo = f"torch.finfo({narrow})"
        if narrow == own:  # the tensor written: its own format, as the line can name it, under any dtype
            finfo = finfo_spelled(code, own.removeprefix("torch."))
            filled = _FILLED.search(code)
            if filled and finfo.startswith("torch.finfo(torch."):
                finfo = f"torch.finfo({filled.group(1)}.dtype)"
        line = f" at line {at[1]} of {at[0].rsplit('/', 1)[-1]} (`{code}`)" if at is not None and code else ""
        extra = (
            f" Every value of those rows is -inf: {r.op} read a row where every position is masked (an empty or "
            "fully padded sequence, a query with no key to attend to), and softmax of such a row is 0/0 in every "
            "precision."
        )
        # an additive mask is added to the scores: its fill leaves them room, or the sum overflows to -inf
        # again, and stays clear of the range's top half, where a sum of it is near the limit
        fill = f"{finfo}.min / 4" if added else f"{finfo}.min"
        room = " (a quarter of it: the mask is added to the scores, and the sum must stay finite)" if added else ""
        fix = (
            f"Write a finite fill instead of -inf{line}: {fill}{room}, so that a fully masked row gets a uniform "
            "softmax (finite; whatever reads those rows must ignore them, as a masked pooling does); or give such "
            "rows a position to attend to, or drop them before the model"
        )
        if "inf" not in code:  # the -inf was written by library code from a mask the line passes (key_padding_mask)
            fix = (
                f"The mask passed{line} masks every position of those rows, and the library fills them with -inf: "
                "drop such rows before the model, or leave one position unmasked in the mask you pass (the first), "
                "and ignore their output"
            )
        trial = Trial.untried(
            "not re-run: a row of equal finite values has a uniform softmax, so the fill removes this NaN by "
            "construction; `fpdoctor trace` on the changed script checks what reads those rows"
        )
        return extra, fix, trial

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        # Inputs and parameters that hold NaN or +Inf are always reported: bad data or a bad
        # checkpoint. An -inf one (an additive attention mask passed in) only when no op is to
        # blame: a row that is entirely masked is the producer's story.
        leaves: dict[str, tuple[Leaf, list[str]]] = {}
        for origin, reaches in self.reached.items():
            if origin[0] == "leaf":
                leaf = self.leaves[origin[1]]
                # the same parameter met twice (before and after an in-place write): one finding
                key = leaf.name if leaf.name != "input" else f"input {origin[1]}"
                if key in leaves:
                    leaves[key][1].extend(r for r in reaches if r not in leaves[key][1])
                else:
                    leaves[key] = (leaf, list(reaches))
        # an input first met in a backward is no data: a checkpointed block's recompute reads the saved
        # activations the forward made (its NaN is that forward's producer's), not a batch
        leaves = {k: v for k, v in leaves.items() if not (v[0].name == "input" and self._first_in_backward(v[0]))}
        bad_data = {("leaf", leaf.index) for leaf, _ in leaves.values() if leaf.kind in ("nan", "+inf")}
        blamed = [
            r
            for r in self.records
            if r.index in self.roles and ("op", r.index) in self.reached and not self._only_from(r, bad_data)
        ]
        scaler = self.scaler_run()
        own = self._scaler_own(blamed) if scaler is not None else []
        absorbed = self._absorbed(scaler, blamed) if scaler is not None else []
        absorbed = [r for r in absorbed if r not in own]
        if absorbed or own:
            assert scaler is not None
            found.append(self._scaler_finding(scaler, absorbed, own))
            gone = {r.index for r in (*absorbed, *own)}
            blamed = [r for r in blamed if r.index not in gone]
        elif scaler is not None and scaler.skipped:
            found.append(self._scaler_finding(scaler, []))
        nan_producers = [r for r in blamed if self.roles[r.index] == "nan-producer"]
        inf_producers = [r for r in blamed if self.roles[r.index] == "inf-producer"]
        # an attention mask's -inf (masked_fill, where, index_fill with a literal -inf) is written
        # on purpose: it reaches the sinks only alongside the real NaN or Inf, and is not a cause.
        # It stays the story only where nothing else is (the -inf itself reached the loss).
        masks = [r for r in inf_producers if _mask_write(r)]
        if masks and (nan_producers or len(masks) < len(inf_producers) or bad_data):
            inf_producers = [r for r in inf_producers if not _mask_write(r)]
        # the first Inf and the first NaN, the one made first ahead (x / 0: the forward's NaN, then its
        # backward's Inf)
        firsts = [
            (p[0], label, p[1:]) for p, label in ((inf_producers, "first Inf"), (nan_producers, "first NaN")) if p
        ]
        by_record: dict[int, Finding] = {}  # record index -> its finding: a NaN made of the first Inf takes its fix
        for record, label, others in sorted(firsts, key=lambda first: first[0].index):
            finding = self.producer_finding(record, label, others)
            # made of the first Inf alone: every non-finite value it read is that finding's op's output
            from_firsts = [i for kind, i in record.inputs if kind == "op" and i in by_record]
            alone = bool(from_firsts) and all(
                src == ("op", from_firsts[0]) for src in record.inputs if self.kind_of(src)
            )
            source = by_record[from_firsts[0]] if alone else None
            # unless its own fix is the same remedy (the same "Write ... instead of ..." before where it applies)
            if (
                source is not None and source.trial is not None and source.trial.tried
                and finding.fix.split(" at ")[0] != source.fix.split(" at ")[0]
            ):  # fmt: skip
                finding = _made_of(finding, source, self.records[record.index].op)
            by_record[record.index] = finding
            found.append(finding)
        producers_reached = bool(nan_producers or inf_producers or absorbed)
        gradients: list[Finding] = []  # gradients the optimizer read non-finite: one finding, the first
        batches: dict[tuple[Any, ...], list[Finding]] = {}  # a DataLoader's batches, one finding per reader
        for leaf, reaches in leaves.values():
            first_op = self.records[leaf.first_use].op if leaf.first_use is not None else ""
            if _sentinel(leaf, reaches, first_op):
                continue
            if ("leaf", leaf.index) in bad_data or not producers_reached:
                made = self.input_finding(leaf, reaches)
                if made.evidence.get("origin") == "gradient":
                    gradients.append(made)
                elif (leaf.rows or {}).get("dataset_indices"):  # the same reader's batch step after step: one
                    reader = (made.where.get("module"), made.where.get("op"), tuple(leaf.shape[1:]), leaf.dtype)
                    batches.setdefault(reader, []).append(made)
                    if len(batches[reader]) == 1:
                        found.append(made)
                else:
                    found.append(made)
        for same in batches.values():
            if len(same) > 1:
                found[found.index(same[0])] = _batches_merged(same)
        if gradients:
            more = (
                f" The same for {len(gradients) - 1} more of the optimizer's gradients." if len(gradients) > 1 else ""
            )
            found.append(dataclasses.replace(gradients[0], message=gradients[0].message + more))
        for origin, reaches in self.reached.items():
            if origin[0] == "op" and self.roles.get(origin[1]) == "constant":
                r = self.records[origin[1]]
                if r.kind == "nan" or not producers_reached:
                    found.append(self._constant_finding(r, reaches))
        # an Inf made finite as the exact computation would have it (tanh of a huge value is 1 anyway) is harmless
        zeroed = [
            z for z in self.zeroed()
            if (scaler is None or not self._skipped_with(scaler, z[0]))
            and self.tracer.zeroed_exact.get((z[1].op, z[1].location)) is not True
        ]  # fmt: skip
        if zeroed:
            found.append(self._zeroed_finding(*zeroed[0], others=len(zeroed) - 1))
        else:
            divisors = self.zeroed_leaves()
            if divisors:
                found.append(self._zeroed_leaf_finding(*divisors[0]))
        hidden = {p.index for p, _, _ in zeroed}
        masked = [
            r
            for r in self.records
            if self.roles.get(r.index) in ("nan-producer", "inf-producer")
            and ("op", r.index) not in self.reached
            and r.index not in hidden
            and (scaler is None or not self._skipped_with(scaler, r))
        ]
        if masked:
            r = masked[0]
            out = next(o for o in r.outputs if o.kind)
            found.append(
                catalog.make(
                    "nonfinite-masked",
                    message=(
                        f"{r.op} {module_text(r.module)} ({r.phase}{self.when(r)}) produced {r.kind}, but later ops "
                        "masked or dropped it before it reached a module output, the loss, a gradient or a parameter "
                        f"({len(masked)} such op(s) in total)."
                        + (f" Source: {where_text(r.location)}." if r.location else "")
                    ),
                    where=self.where(r),
                    evidence=_known(
                        {
                            "kind": r.kind,
                            "count": sum(out.counts.values()) if out.counts else None,
                            "numel": math.prod(out.shape),
                            "dtype": out.dtype,
                            "ops": len(masked),
                            "location": where_text(r.location),
                            **self.step_evidence(r),
                        }
                    ),
                )
            )
        return found

    # -- GradScaler skips ---------------------------------------------------------------------
    def scaler_run(self) -> ScalerRun | None:
        """What an enabled GradScaler did over the traced steps; None where none stepped."""
        steps = self.steps.scaler_steps() if self.steps is not None else []
        return ScalerRun(tuple(steps)) if steps else None

    def _skipped_with(self, run: ScalerRun, r: Record) -> bool:
        """A producer that is the scaler's story: on a step it skipped, in a training step (not an
        evaluation forward); while the scale calibrates, only the gradients and their unscaling,
        which the scale made (a forward overflow happens before any scaling)."""
        step = self.step_of(r)
        if step is None or step[0] not in run.skipped:
            return False
        if step[1] and not any(x.startswith("gradient of") for x in self.reached.get(("op", r.index), [])):
            return False  # an evaluation forward; one under no_grad whose value the gradients read (a pseudo-label,
            # a teacher's output) is the training step's
        return run.collapsed or r.phase in ("backward", "optimizer")

    def _absorbed(self, run: ScalerRun, blamed: list[Record]) -> list[Record]:
        return [r for r in blamed if self._skipped_with(run, r)]

    def _scaler_own(self, blamed: list[Record]) -> list[Record]:
        """Producers inside the scaler's own unscaling: its unscale op and the scalars it reads
        (1/scale, computed in float64 and cast to float32). Once the scale has fallen below float32's
        normal range, 1/scale overflows to inf and the unscale turns finite (zero) gradients into NaN:
        the scaler's state is the cause there, not a line of the user's."""
        own: dict[int, Record] = {}
        for r in blamed:
            if _packet(r.op) not in _UNSCALE:
                continue
            own[r.index] = r
            # upstream through the non-finite scalars it read (a copy, the cast, the reciprocal's)
            todo = [i for kind, i in r.inputs if kind == "op"]
            while todo and len(own) < 64:
                fed = self.records[todo.pop()]
                if fed.index not in own and fed.outputs and all(o.kind and not o.shape for o in fed.outputs):
                    own[fed.index] = fed
                    todo += [i for kind, i in fed.inputs if kind == "op"]
        blamed_now = {r.index for r in blamed}
        return sorted((r for r in own.values() if r.index in blamed_now), key=lambda r: r.index)

    def _op_text(self, r: Record) -> str:
        """'aten.mm.default in module `2`', or for a backward op 'the backward of aten.sqrt.default
        (SqrtBackward0: aten.div.Tensor)': the forward op is the one on the user's line."""
        if r.phase == "backward" and r.forward_op:
            return f"the backward of {r.forward_op} ({r.node or 'autograd'}: {r.op}) {module_text(r.module)}"
        return f"{r.op} {module_text(r.module)}"

    def _scaler_finding(self, run: ScalerRun, absorbed: list[Record], unscaled: Sequence[Record] = ()) -> Finding:
        """The scaler's skips: an error naming the recurring origin where they persist, else a note;
        `unscaled`: the scaler's own unscaling that made NaN once its scale fell out of float32's range."""
        skipped = sorted(run.skipped)
        counted = f"{len(skipped)} of {run.total} steps"
        keyed = [((self.step_of(x) or (0, False))[0], (x.op, x.forward_op, x.location), x.index) for x in absorbed]
        origin = recurring(keyed)
        r = self.records[origin[0]] if origin is not None else None
        other = self._second_origin(r, absorbed, run) if r is not None else None
        evidence: dict[str, Any] = {
            "skipped": len(skipped),
            "steps": run.total,
            "skipped_steps": skipped[:32],
            "scale_first": run.scales[0] if run.scales else None,
            "scale_last": run.scales[-1] if run.scales else None,
            "scale_min": min(run.scales) if run.scales else None,
            "longest_skip_run": run.longest[0],
            "step": skipped[0],
        }
        if not run.collapsed:  # a scale out of float32's range (`unscaled`) is below 1: collapsed
            first = absorbed[0] if absorbed else None
            return catalog.make(
                "grad-scaler-calibrated",
                title=f"GradScaler skipped {counted} while calibrating its scale ({run.scale_text()})",
                message=(
                    f"GradScaler found non-finite gradients and skipped {counted} (optimizer step"
                    f"{'s' if len(skipped) > 1 else ''} {', '.join(map(str, skipped[:8]))}"
                    f"{', ...' if len(skipped) > 8 else ''}) while its scale calibrated ({run.scale_text()}): "
                    "the scaler's overflow check at work, not an error; the optimizer stepped on the others."
                    + (
                        f" The first such value: {self._op_text(first)} ({first.phase}{self.when(first)})"
                        f"{', ' + str(where_text(first.location)) if first.location else ''}."
                        if first is not None
                        else ""
                    )
                ),
                where={"module": None, "phase": "optimizer"},
                evidence=_known({**evidence, "ops": len(absorbed)}),
            )
        every = run.every_step
        # collapsed by its scale alone (skips now and then, the scale pushed far below 1 by them): the steps it
        # takes run on gradients scaled so small that the half-precision backward flushes them to zero
        sank = not every and not run.stopped and run.longest[0] < MAX_CONSECUTIVE_SKIPS and bool(run.scales)
        title = (
            f"GradScaler skipped {run.total} of {run.total} steps: the optimizer never ran"
            if every
            else f"GradScaler skipped {counted}, and its scale sank to {min(run.scales):g}: it shrinks the gradients "
            f"{1 / min(run.scales):.3g}-fold"
            if sank
            else f"GradScaler skipped {counted} ({run.longest[0]} in a row from step {run.longest[1]}): "
            "the optimizer stopped running"
        )
        low = min(run.scales) < 1 if run.scales else False
        moved = (
            "never moved" if every
            else "move on gradients the scale shrinks (toward fp16's zero, where they flush) instead of growing them"
            if sank
            else "stopped moving"
        )  # fmt: skip
        message = (
            f"GradScaler found non-finite gradients and skipped {counted} (scale {run.scale_text()}"
            + (", below 1: the gradients are non-finite even unscaled" if low else "")
            + f"), so the weights {moved}: this is not the scale calibrating, it does not go away as the scale falls."
        )
        fix = catalog.get("grad-scaler-stalled").fix
        if r is not None and origin is not None:
            out = next(o for o in r.outputs if o.kind)
            made = self.made_from(r) if self.roles.get(r.index) != "propagator" else " passed on"
            message += (
                f" The recurring non-finite value starts at {self._op_text(r)} ({r.phase}{self.when(r)}), on "
                f"{origin[1]} of the {len(skipped)} skipped steps: it made {out.kind}{made} in {out.dtype}."
                + (f" Source: {where_text(r.location)}." if r.location else "")
            )
            evidence["origin"] = _known(
                {
                    "op": r.op,
                    "forward_op": r.forward_op,
                    "autograd_node": r.node,
                    "module": r.module,
                    "phase": r.phase,
                    "kind": out.kind,
                    "dtype": out.dtype,
                    "shape": list(out.shape),
                    "inputs": self.input_stats(r),
                    "location": where_text(r.location),
                    "recurs_on_steps": origin[1],
                    **self.step_evidence(r),
                }
            )
            evidence["location"] = where_text(r.location)
            evidence["step"] = (self.step_of(r) or (skipped[0], False))[0]
            fix, trial = self._tried(r, _advice(r))
            fix = fix.rstrip(". ")
            if len(run.scales) >= 3 and len(set(run.scales)) == 1:  # skipped at one scale that never came down
                fix = (
                    f"The scale stayed at {run.scales[0]:g} over all {len(run.scales)} steps: the scaler never "
                    "lowered it (a GradScaler made anew each step starts at its init scale), so no other scale was "
                    "tried. Build one scaler before the loop and use it for every step; if the value still overflows "
                    "then: " + fix[0].lower() + fix[1:]
                )
            else:
                fix += (
                    f"; the scaler cannot fix it: the value is non-finite at every scale it tried ({run.scale_text()})"
                )
            if other is not None:
                o, steps, mine = other
                at = where_text(o.location) or o.op
                message += (
                    f" On {steps} of those steps the first non-finite value is made earlier, at {self._op_text(o)} "
                    f"({o.phase}{self.when(o)})" + (f", {at}" if o.location else "") + "."
                )
                second, tried = self._tried(o, _advice(o))
                cured = trial.tried and isinstance(trial.after, (int, float)) and math.isfinite(trial.after)
                covers = (
                    f"That is checked on the {mine} skipped steps whose first non-finite value is made on its line"
                    if cured
                    else "Its check does not leave the value finite"
                )
                fix = (
                    f"{fix}. {covers}; on {steps} others the value is made first at {at}, which needs its own change "
                    f"({'checked' if tried.tried else 'not tried'}): {second[0].lower()}{second[1:].rstrip('. ')}"
                )
                evidence["second_origin"] = {
                    "op": o.op, "location": at, "steps": steps, "fix_trial": tried.to_dict(),
                }  # fmt: skip
        else:
            trial = Trial.untried("no op that made the non-finite value was seen, so there was nothing to re-run")
        if len(absorbed) > 1:
            evidence["other_ops"] = len({(x.op, x.location) for x in absorbed}) - 1
        if r is not None and (lines := self._same_op_lines(r, absorbed)):  # each of two norms by hand
            evidence["same_op_at"] = lines
            evidence["same_op_checked"] = self._checked_lines(absorbed, lines)
        if unscaled:
            message += self._scale_out_of_range(run, unscaled, evidence)
        return catalog.make(
            "grad-scaler-stalled",
            title=title,
            message=message,
            where=self.where(r) if r is not None else {"module": None, "phase": "optimizer"},
            evidence=_known(evidence),
            fix=fix,
            trial=trial,
        )

    def _second_origin(self, r: Record, absorbed: Sequence[Record], run: ScalerRun) -> tuple[Record, int, int] | None:
        """The skipped steps whose first non-finite op is on another line than the origin `r`'s, where they
        are OTHER_ORIGIN of those seen: (their recurring first op, how many steps, how many start on `r`'s
        line). An exp two lines up that overflows only once the weights have grown: the origin's fix leaves
        those steps skipped. None where the origin's own checked fix raises that line already (its walk
        went up to it)."""
        firsts: dict[int, Record] = {}  # each skipped step's first non-finite op
        for x in absorbed:
            step = (self.step_of(x) or (0, False))[0]
            if step in run.skipped and (step not in firsts or x.index < firsts[step].index):
                firsts[step] = x
        line = _line_of(r)
        rest = recurring((step, _line_of(x), x.index) for step, x in firsts.items() if _line_of(x) != line)
        experiment = self.tracer.experiments.get(r.index)
        raised = {_line_of(x) for x in [*(experiment.chain if experiment else []), r]}
        if rest is None or _line_of(self.records[rest[0]]) in raised or rest[1] < max(2, OTHER_ORIGIN * len(firsts)):
            return None
        return self.records[rest[0]], rest[1], sum(_line_of(x) == line for x in firsts.values())

    def _same_op_lines(self, r: Record, others: Sequence[Record]) -> list[str]:
        """'file:line' of each other line where the same op made the same symptom in the same step as
        `r`: the fix is one change on every such line (same_line.py)."""
        here, step = where_text(r.location), self.step_of(r)
        if here is None:
            return []
        lines = [
            line for o in others
            if o.op == r.op and o.phase == r.phase and (line := where_text(o.location)) and line != here
            and self.step_of(o) == step
        ]  # fmt: skip
        return list(dict.fromkeys(line.split(" in ", 1)[0] for line in lines))

    def _checked_lines(self, others: Sequence[Record], lines: list[str]) -> list[str]:
        """Those of `lines` where a producer's experiment checked its own fix (the first producers are
        experimented on, PRODUCERS of each kind: the same op on another line often is one of them)."""
        experiments = self.tracer.experiments
        checked = {
            (where_text(o.location) or "").split(" in ", 1)[0] for o in others
            if (e := experiments.get(o.index)) is not None and e.verdict == "origin" and (e.checked_in or e.stable)
        }  # fmt: skip
        return [line for line in lines if line in checked]

    def _scale_out_of_range(self, run: ScalerRun, own: Sequence[Record], evidence: dict[str, Any]) -> str:
        """What the scaler's own unscaling did once its scale left float32's range (`_scaler_own`)."""
        step = (self.step_of(own[0]) or (0, False))[0]
        scale = next((x for n, _, x in run.steps if n == step), None)
        # the steps whose unscaled gradients the optimizer applied: the scaler did not skip them
        steps = sorted({(self.step_of(r) or (0, False))[0] for r in own if _packet(r.op) in _UNSCALE} - run.skipped)
        evidence["scale_out_of_range"] = _known(
            {"step": step, "scale": scale, "applied_steps": steps[:32], "location": where_text(own[0].location)}
        )
        at = f" ({scale:.3g})" if scale is not None else ""
        text = (
            f" By step {step} the scale{at} had fallen below float32's smallest normal number (1.2e-38): 1/scale "
            "overflowed to inf"
        )
        if not steps:
            return text + "."
        # zero gradients (a loss scaled below the format's range) times inf are NaN, others +-inf
        made = "NaN" if all(r.kind == "nan" for r in own if _packet(r.op) in _UNSCALE) else "Inf and NaN"
        return text + (
            f" and unscaling turned the gradients into {made}. The scaler checks the gradients before it "
            f"multiplies them, so it did not skip: the optimizer applied {made} gradients on {len(steps)} "
            f"step{'s' if len(steps) != 1 else ''} ({', '.join(map(str, steps[:8]))}"
            f"{', ...' if len(steps) > 8 else ''}), "
            "and the weights it wrote are not finite. This follows from the skips: their cause is the fix."
        )

    # -- Inf turned into zeros -----------------------------------------------------------------
    def _overflows(self, src: Origin) -> list[Record]:
        """The overflow producers behind a non-finite input (not masks written on purpose)."""
        origins = self.origins.get(src[1], frozenset()) if src[0] == "op" else frozenset()
        return [
            self.records[i]
            for kind, i in sorted(origins)
            if kind == "op" and self.roles.get(i) == "inf-producer" and _packet(self.records[i].op) not in _DELIBERATE
        ]

    def zeroed(self) -> list[tuple[Record, Record, list[str]]]:
        """(overflow producer, op that made its Inf finite, sinks reached), first first."""
        zeroing: dict[int, Record] = {}  # zeroing record -> the overflow behind it
        for r in self.records:
            if r.kind or _packet(r.op) not in ZEROING:
                continue
            for src in r.inputs:
                if self.kind_of(src) in ("+inf", "-inf"):
                    overflows = self._overflows(src)
                    if overflows:
                        zeroing[r.index] = overflows[0]
                        break
        if not zeroing:
            return []
        reached = self._reached_from(set(zeroing))
        return [(zeroing[z], self.records[z], reached[z]) for z in sorted(reached)]

    def _reached_from(self, zeroing: set[int]) -> dict[int, list[str]]:
        """The sinks each of the `zeroing` records' values reach, forward through the inputs."""
        derived: dict[int, frozenset[int]] = {}
        for r in self.records:
            behind: frozenset[int] = frozenset({r.index}) if r.index in zeroing else frozenset()
            for kind, i in r.inputs:
                if kind == "op" and i in derived:
                    behind |= derived[i]
            if behind:
                derived[r.index] = behind
        reached: dict[int, list[str]] = defaultdict(list)
        for kind, index, description in self.tracer.sinks:
            for z in sorted(derived.get(index, ())) if kind == "op" else ():
                if description not in reached[z] and len(reached[z]) < 8:
                    reached[z].append(description)
        return reached

    def zeroed_leaves(self) -> list[tuple[Leaf, Record, list[str]]]:
        """(a one-value tensor no traced op made, holding +Inf in float16, the division by it, the sinks
        reached): torch.tensor(120000, dtype=torch.float16) is Inf with no op to overflow (the number did on
        its way in), and a loss divided by it is 0, so every gradient is. First first."""
        zeroing: dict[int, Leaf] = {}
        for r in self.records:
            if r.kind or _packet(r.op) not in _DIVIDES:
                continue
            for src in r.inputs[1:]:  # the divisor
                if src[0] != "leaf":
                    continue
                leaf = self.leaves[src[1]]
                # one value (a count, a size): a tensor of several holding +Inf on purpose (padded distances whose
                # reciprocal weights them 0) is no number that overflowed; bf16 holds what fp32 holds
                one = math.prod(leaf.shape) == 1
                if one and leaf.kind == "+inf" and leaf.dtype == "torch.float16" and leaf.name == "input":
                    zeroing[r.index] = leaf
                    break
        reached = self._reached_from(set(zeroing)) if zeroing else {}
        return [(zeroing[z], self.records[z], reached[z]) for z in sorted(reached)]

    def _zeroed_leaf_finding(self, leaf: Leaf, zeroer: Record, reaches: list[str]) -> Finding:
        fmt = leaf.dtype.removeprefix("torch.")
        top = 65504.0 if fmt == "float16" else 3.39e38
        at = where_text(zeroer.location)
        message = (
            f"{zeroer.op} {module_text(zeroer.module)} ({zeroer.phase}{self.when(zeroer)}) divides by a {fmt} tensor "
            f"of shape {list(leaf.shape)} that holds +Inf and that no traced op made: a tensor made from a number "
            f"past {fmt}'s largest value ({top:.5g}) is Inf from the start (torch.tensor(120000, "
            f"dtype=torch.float16) is), or it came in so. Divided by Inf, the values are 0, so no NaN shows, but "
            f"they reach {', '.join(reaches[:3])}: a loss made 0 gives every gradient 0."
            + (f" Source: {at}." if at else "")
        )
        return catalog.make(
            "nonfinite-zeroed",
            title=f"{zeroer.op} divides by a {fmt} tensor that holds Inf, and makes its values 0",
            message=message,
            where={**self.where(zeroer), "zeroed_by": zeroer.op},
            evidence=_known(
                {
                    "kind": "+inf",
                    "dtype": leaf.dtype,
                    "shape": list(leaf.shape),
                    "origin": "input",
                    "zeroed_by": _known(
                        {"op": zeroer.op, "module": zeroer.module, "phase": zeroer.phase, "into": "0", "location": at}
                    ),
                    "reaches": reaches,
                    "location": at,
                    **self.step_evidence(zeroer),
                }
            ),
            fix=(
                f"make the number it divides by{f' at {at}' if at else ''} in fp32 where it is made "
                "(torch.tensor(n, dtype=torch.float32); a count summed with .sum(dtype=torch.float32)), not in "
                f"{fmt}: .float() after it is made keeps the Inf; the division then computes in fp32 by type promotion"
            ),
            trial=Trial.untried(
                "the tensor held Inf when the traced code first read it: the number it was made from is not "
                "among the ops the trace can run again"
            ),
        )

    def _zeroed_finding(self, producer: Record, zeroer: Record, reaches: list[str], others: int) -> Finding:
        out = next(o for o in producer.outputs if o.kind)
        count = sum(out.counts.values()) if out.counts else None
        numel = math.prod(out.shape)
        into = "saturated finite values" if _packet(zeroer.op) in _SATURATING else "0"
        location = where_text(producer.location)
        rows = f"{count} of {numel}" if count is not None else f"some of {numel}"
        message = (
            f"{producer.op} {module_text(producer.module)} ({producer.phase}{self.when(producer)}) overflowed "
            f"{out.dtype}: {rows} values "
            f"became {out.kind} from finite inputs. {zeroer.op} {module_text(zeroer.module)} then turned the Inf "
            f"into {into}, so no NaN shows, but those values are destroyed and they reach {', '.join(reaches[:3])}."
            + (f" Source: {location}." if location else "")
            + (f" ({others} more op(s) zeroed an overflow.)" if others else "")
        )
        where = self.where(producer)
        where["zeroed_by"] = zeroer.op
        evidence = _known(
            {
                "kind": out.kind,
                "count": count,
                "numel": numel,
                "dtype": out.dtype,
                "shape": list(out.shape),
                "inputs": self.input_stats(producer),
                "zeroed_by": _known(
                    {
                        "op": zeroer.op,
                        "module": zeroer.module,
                        "phase": zeroer.phase,
                        "into": into,
                        "location": where_text(zeroer.location),
                    }
                ),
                "reaches": reaches,
                "location": location,
                **self.step_evidence(producer),
            }
        )
        fix, trial = self._tried(producer, _fix_for(producer))
        return catalog.make(
            "nonfinite-zeroed",
            title=f"{producer.op} overflowed to {out.kind} and {zeroer.op} turned it into {into}",
            message=message,
            where=where,
            evidence=evidence,
            fix=fix,
            trial=trial,
        )

    def _only_from(self, r: Record, bad_data: set[Origin]) -> bool:
        """A NaN producer whose non-finite inputs all come from bad data (inf - inf of an Inf in
        the batch) is that data's consequence, not a numerical bug of its own."""
        if self.roles.get(r.index) != "nan-producer" or not bad_data:
            return False
        upstream: set[Origin] = set()
        for src in r.inputs:
            if self.kind_of(src):
                upstream |= self.origins.get(src[1], frozenset()) if src[0] == "op" else {src}
        return bool(upstream) and upstream <= bad_data

    def _first_in_backward(self, leaf: Leaf) -> bool:
        first = leaf.first_use
        return first is not None and first < len(self.records) and self.records[first].phase == "backward"

    def input_finding(self, leaf: Leaf, reaches: list[str]) -> Finding:
        """The finding for a non-finite value that came in from outside the trace (a parameter,
        an input, a tensor received from other ranks); `reaches`: the sinks it reached."""
        first = (
            self.records[leaf.first_use] if leaf.first_use is not None and leaf.first_use < len(self.records) else None
        )
        what = _leaf_text(leaf)
        count = sum(leaf.counts.values()) if leaf.counts else None
        numel = math.prod(leaf.shape)
        if first is not None and _written_scalar(leaf, first):
            return self._written_finding(leaf, first, reaches)
        if first is not None and first.phase == "optimizer" and _leaf_origin(leaf) == "input":
            return self._gradient_finding(leaf, first, reaches)
        items = (leaf.rows or {}).get("dataset_indices")
        return catalog.make(
            "nonfinite-input",
            fix=_items_fix(items) if items else None,
            trial=Trial.untried(_ITEMS_UNTRIED) if items else None,
            message=(
                f"{what} {list(leaf.shape)} {leaf.dtype} already held {count} {leaf.kind} value(s) when it was "
                f"first used"
                + (f" by {first.op} {module_text(first.module)}{self.at_step(first)}" if first else "")
                + f"; it reaches {', '.join(reaches[:3])}."
                + (
                    " Another rank sent it: that rank's report names the op that made it."
                    if leaf.origin == "collective"
                    else ""
                )
                + rows_text(leaf.rows)
            ),
            where=_known(
                {
                    "module": first.module if first else None,
                    "op": first.op if first else None,
                    "phase": first.phase if first else None,
                    "input": leaf.name,
                }
            ),
            evidence=_known(
                {
                    "kind": leaf.kind,
                    "count": count,
                    "numel": numel,
                    "dtype": leaf.dtype,
                    "shape": list(leaf.shape),
                    "counts": leaf.counts,
                    "origin": _leaf_origin(leaf),
                    "rows": leaf.rows,
                    "reaches": reaches,
                    **(self.step_evidence(first) if first else {}),
                }
            ),
        )

    def _gradient_finding(self, leaf: Leaf, first: Record, reaches: list[str]) -> Finding:
        """A gradient the optimizer read non-finite, made by a backward the trace did not see op by op (a
        torch.compile'd graph's, a custom or C++ autograd op's): not the data pipeline's."""
        count = sum(leaf.counts.values()) if leaf.counts else None
        return catalog.make(
            "nonfinite-input",
            title="A gradient reached the optimizer non-finite from a backward the trace did not see op by op",
            message=(
                f"The optimizer's {first.op}{self.at_step(first)} read a gradient {list(leaf.shape)} {leaf.dtype} that "
                f"already held {count} {leaf.kind} value(s): the backward that made it ran where the trace does not "
                "see each op (a torch.compile'd graph's backward, a custom or C++ autograd op, a gradient written by "
                f"a hook); it reaches {', '.join(reaches[:3])}."
            ),
            where=_known({"module": first.module, "op": first.op, "phase": first.phase, "input": leaf.name}),
            evidence=_known(
                {
                    "kind": leaf.kind,
                    "count": count,
                    "numel": math.prod(leaf.shape),
                    "dtype": leaf.dtype,
                    "shape": list(leaf.shape),
                    "origin": "gradient",
                    "reaches": reaches,
                    **self.step_evidence(first),
                }
            ),
            fix=(
                "Find the op in that backward: a compiled model's graphs are checked by their outputs (a finding "
                "about a compiled graph names it and its line); run the same script with TORCH_COMPILE_DISABLE=1 "
                "under `fpdoctor trace` to name the op eagerly, with its checked fix"
            ),
            trial=Trial.untried(
                "the op that made the gradient ran where the trace does not re-run ops: the eager trace names it"
            ),
        )

    def _written_finding(self, leaf: Leaf, first: Record, reaches: list[str]) -> Finding:
        """`t[i] = float("inf")`, `t[mask] = v`, `t.fill_(nan)`: the code itself wrote the value."""
        location = where_text(first.location)
        return catalog.make(
            "nonfinite-input",
            title=f"Your code wrote {leaf.kind} into a tensor",
            message=(
                f"A scalar {leaf.kind} was written into a tensor by {first.op} {module_text(first.module)} (an "
                f"assignment such as t[i] = float('inf') or t.fill_/masked_fill_); it reaches {', '.join(reaches[:3])}."
                + (f" Source: {location}." if location else "")
            ),
            where=_known({"module": first.module, "op": first.op, "phase": first.phase, "input": leaf.name}),
            evidence=_known(
                {
                    "kind": leaf.kind,
                    "count": 1,
                    "numel": 1,
                    "dtype": leaf.dtype,
                    "origin": "constant",
                    "reaches": reaches,
                    "location": location,
                }
            ),
            fix="The value is your code's own: if it marks masked positions, use a finite value "
            "(torch.finfo(dtype).min / .max) or mask after the reduction; otherwise fix the assignment at the source "
            "line.",
            trial=Trial.untried("a change to the assignment at the source line, which fpdoctor does not rewrite"),
        )

    def _constant_finding(self, r: Record, reaches: list[str]) -> Finding:
        out = next(o for o in r.outputs if o.kind)
        return catalog.make(
            "nonfinite-input",
            message=(
                f"A constant created by {r.op} {module_text(r.module)}{self.at_step(r)} holds {r.kind}; it "
                "reaches "
                f"{', '.join(reaches[:3])}." + (f" Source: {where_text(r.location)}." if r.location else "")
            ),
            where=self.where(r),
            evidence=_known(
                {
                    "kind": r.kind,
                    "count": sum(out.counts.values()) if out.counts else None,
                    "numel": math.prod(out.shape),
                    "dtype": out.dtype,
                    "origin": "constant",
                    "reaches": reaches,
                    "location": where_text(r.location),
                    **self.step_evidence(r),
                }
            ),
        )


_ITEMS_UNTRIED = (
    "the items were made before the traced code read them (by the Dataset, here or in a DataLoader worker): "
    "the trace re-runs ops it saw run"
)


def _items_fix(items: list[int]) -> str:
    """An input's non-finite rows are these dataset items: where they are made is the fix."""
    named = ", ".join(str(i) for i in items[:8]) + (", ..." if len(items) > 8 else "")
    return (
        f"Fix dataset item{'s' if len(items) > 1 else ''} {named} where {'they are' if len(items) > 1 else 'it is'} "
        "made (the file, or the Dataset's __getitem__: a division by a statistic that is 0 for a constant item, "
        "a log of 0); check every item the same way (torch.isfinite(x).all() in __getitem__, with the index). "
        "Where a DataLoader's workers make them (num_workers > 0), the trace does not follow __getitem__: run it "
        "with num_workers=0 and it names the line that makes the value and checks a guard there"
    )


def _made_of(finding: Finding, source: Finding, op: str) -> Finding:
    """The first NaN made by an op that read the first Inf (0 * -inf, after a log of 0): its cause is the Inf's,
    so is its fix, the one checked there (a fix of its own, "these lines in fp32", would contradict that one)."""
    return dataclasses.replace(
        finding,
        fix=f"the first Inf's fix ({op} made this NaN of that Inf, from {source.where.get('op')}): {source.fix}",
        trial=source.trial,
        evidence={**finding.evidence, "made_of": source.where.get("op")},
    )


def _batches_merged(same: list[Finding]) -> Finding:
    """One finding for the batches one reader took non-finite at several steps: the first, with every
    step and every dataset item."""
    first = same[0]
    steps = [f.evidence.get("step") for f in same if f.evidence.get("step") is not None]
    items: list[int] = []
    for f in same:
        items += [i for i in (f.evidence.get("rows") or {}).get("dataset_indices", []) if i not in items]
    listed = ", ".join(str(s) for s in steps[:12]) + (", ..." if len(steps) > 12 else "")
    return dataclasses.replace(
        first,
        message=first.message
        + f" The same on {len(same)} batches (steps {listed}): dataset items "
        + ", ".join(str(i) for i in items[:16])
        + (", ..." if len(items) > 16 else "")
        + ".",
        evidence={**first.evidence, "occurrences": len(same), "steps": steps, "dataset_indices": items},
        fix=_items_fix(items),
    )


# an eps written as the format's own (a literal such as 1e-12 is 0 in fp16, and the guard with it)
_DIV = (
    "guard the denominator (x / (d + torch.finfo(d.dtype).eps), or torch.where(d != 0, x / d, 0) with the division "
    "masked too)"
)


# what a best score is first read by: a comparison with the new value (EarlyStopping's monitor_op), its
# size, whether it is finite yet
_COMPARED = frozenset({"lt", "gt", "le", "ge", "eq", "ne", "less", "greater", "abs", "isfinite", "isinf"})


def _sentinel(leaf: Leaf, reaches: list[str], first_op: str) -> bool:
    """A one-value +-inf input first read by a comparison (or its size, its finiteness) that reaches no
    model output, gradient or weight, only values read back by Python: a starting best score
    (EarlyStopping's torch.tensor(inf)), a running minimum's first value, on purpose. A NaN, an Inf that
    reaches the model, or one first multiplied or added into a value the user reads, is never one."""
    counts = leaf.counts or {}
    infinite = leaf.kind in ("+inf", "-inf") and not counts.get("nan")
    compared = _packet(first_op) in _COMPARED if first_op else False
    one = math.prod(leaf.shape) == 1
    return infinite and one and compared and bool(reaches) and all(r == RETURNED for r in reaches)


def _division(line: str) -> tuple[str, str] | None:
    """The numerator and denominator as written, where the line holds one tensor division `a / b`
    (a statement on one line; `return` and assignments too)."""
    text = line.strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    divisions = [n for n in ast.walk(tree) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div)]
    # a division written as a call (x.div(n), torch.div) is another one than the `/` the line holds
    named = {
        n.func.attr if isinstance(n.func, ast.Attribute) else n.func.id if isinstance(n.func, ast.Name) else ""
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
    }
    if len(divisions) != 1 or named & {"div", "div_", "true_divide", "divide"}:
        return None
    right = divisions[0].right
    if _plain_number(right):
        return None  # a constant or a Python number (math.sqrt(2)): no tensor denominator to guard
    top, bottom = ast.get_source_segment(text, divisions[0].left), ast.get_source_segment(text, right)
    return (top, bottom) if top and bottom else None


def _plain_number(node: ast.AST) -> bool:
    """An expression of constants and `math.*` calls only: a Python number, not a tensor."""
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and not (
            isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name) and n.func.value.id == "math"
        ):
            return False
        if isinstance(n, ast.Name) and n.id != "math":
            return False
    return True


# x / t with t a Python number (a temperature, a scale): no denominator that can be 0, the quotient grows
_DIV_BY_CONSTANT = (
    "the division by a constant grew the values past the format's range: divide in fp32 (x.float() / t, the "
    "result cast back where it fits) or scale down what is divided"
)
_LOG = "clamp the argument (torch.log(x.clamp_min(torch.finfo(x.dtype).tiny)))"
_MATMUL = "the matmul overflowed: scale its inputs down or keep it in fp32"
# a power written with a positive exponent (re ** 2, x.pow(2) of raw audio or pixel values) overflows by its base
_POW_OVERFLOW = (
    "a power of a large base overflows (x ** 2 of values past 256 in fp16, raw audio or pixel units): a smaller base "
    "(standardise the input) or this op in fp32"
)
_NEGATIVE_POWER = re.compile(r"\*\*\s*\(?\s*-|pow\([^,]*,\s*-|pow\(\s*-")  # a negative exponent written on the line
# Keyed by the exact overload packet name (`aten.<name>.<overload>`): `_log_softmax` is not `log`.
OP_ADVICE: dict[str, str] = {
    "div": _DIV,
    "div_": _DIV,
    "reciprocal": "guard against zero before the reciprocal (x.clamp_min(torch.finfo(x.dtype).tiny).reciprocal())",
    "log": _LOG,
    "log_": _LOG,
    "log2": _LOG,
    "log10": _LOG,
    "log1p": "clamp the argument above -1 (torch.log1p(x.clamp_min(-1 + torch.finfo(x.dtype).eps)))",
    "sqrt": "clamp the argument at zero and add the format's eps "
    "(torch.sqrt(x.clamp_min(0) + torch.finfo(x.dtype).eps))",
    "rsqrt": "add an eps the format holds before rsqrt (torch.finfo(x.dtype).eps, not a literal it rounds to 0), and "
    "compute the sum of squares under it in fp32",
    "exp": "where the exp feeds a normalisation (a softmax, a log of a sum), subtract the max first (torch.softmax, "
    "torch.logsumexp); where its value is used itself (a rate, a scale), bound its argument, or compute it in fp32",
    "exp2": "where the exp2 feeds a normalisation, subtract the max first; where its value is used itself, bound its "
    "argument, or compute it in fp32",
    "pow": "x ** p with p < 0 is Inf at x = 0 (a node of degree 0 in deg ** -0.5, an empty count): keep those "
    "out of it, torch.where(x > 0, x, 1) ** p with the result masked (or .masked_fill(x == 0, 0)), or make them "
    "non-zero where they are made (self-loops, a count of at least 1); a power that overflows wants a smaller base "
    "or fp32",
    # an alignment that cannot exist (an input shorter than its target, counting the blanks repeats need) has
    # probability 0: log 0 = -inf, the loss +inf, in any precision
    "_ctc_loss": "ctc_loss is +inf for a sample whose input is too short for its target (input_lengths below "
    "target_lengths plus the blanks between repeated labels): pass zero_infinity=True to F.ctc_loss / nn.CTCLoss, "
    "or drop those samples",
    "_softmax": "check for rows that are entirely masked (-inf) and for overflowing scores; compute softmax in fp32",
    "_log_softmax": "check for rows that are entirely masked (-inf) and for overflowing logits; compute "
    "log_softmax in fp32 (F.cross_entropy on fp32 logits)",
    "mm": _MATMUL,
    "bmm": "the batched matmul overflowed: scale the scores (1/sqrt(d) before the product), or keep it in fp32",
    "baddbmm": "the batched matmul overflowed: scale the scores (1/sqrt(d) before the product), or keep it in fp32",
    "addmm": "the linear layer overflowed: keep it in fp32 or rescale its input",
    "_scaled_dot_product_flash_attention_for_cpu": "the attention overflowed: keep it in fp32 or rescale q and k",
    "_to_copy": "a cast to a narrower dtype overflowed: rescale before the cast or keep the tensor in fp32",
    "sum": "the sum overflowed: accumulate in fp32 (x.sum(dtype=torch.float32)) or take a mean and rescale what "
    "reads it (for a norm, sqrt((x * x).sum(dim)), torch.linalg.vector_norm(x, dim=dim), which does not overflow "
    "before its result does)",
    "mul": "the product overflowed: rescale a factor or keep it in fp32",
}


# A backward op that made NaN/Inf from finite values, keyed by its forward op: an op whose gradient is
# infinite at a finite input (torch's norms and cdist give 0 at a zero vector, not 0/0). Where that
# input's value is discarded later (torch.where, a mask), its zero gradient still goes through the
# op's backward: 0 x inf is NaN (the torch.where trap).
_MASKED = (
    ", and masking its result afterwards (torch.where, a multiply by a mask) does not help: the zero gradient "
    "of what the mask discards still goes through it, 0 x inf = NaN. Keep those inputs out of it before the op: "
)
BACKWARD_ADVICE: dict[str, str] = {
    "sqrt": "sqrt's gradient at 0 is infinite (1 / (2 sqrt(0)))"
    + _MASKED
    + "torch.sqrt(x.clamp_min(eps)) (an eps the dtype holds: 1e-12 in fp32, 1e-4 in fp16), or the mask applied to "
    "what it reads (torch.sqrt(torch.where(mask, 1.0, x)), the same mask as after it)",
    "pow": "x ** p with 0 < p < 1 has an infinite gradient at 0"
    + _MASKED
    + "x.clamp_min(eps) ** p, or the mask applied to x before the power",
    "acos": "acos' gradient at 1 and -1 is infinite (a cosine of a vector with itself is 1)"
    + _MASKED
    + "x.clamp(-1 + eps, 1 - eps) before it",
    "asin": "asin's gradient at 1 and -1 is infinite" + _MASKED + "x.clamp(-1 + eps, 1 - eps) before it",
}


_OPTIMIZER = (
    "the optimizer update made it: a learning rate too large for these gradients, a gradient that should have "
    "been clipped (torch.nn.utils.clip_grad_norm_), or an update dividing by ~0 (Adam's eps rounds to 0 in fp16: "
    "eps=1e-4, or fp32 parameters under autocast)"
)


_IMPOSSIBLE = (
    "Suspect the device or the library, not this code (silent data corruption): the output is outside what its "
    "inputs allow, so no epsilon, clamp or precision change is the fix. Next: replay the step (fpdoctor.Sentinel "
    "replays bad steps for you), run the same step on another GPU, and check this GPU with `fpdoctor health` "
    "(Xid errors, ECC, GEMM fingerprints)."
)


def _guard_checked(r: Record, experiment: Experiment) -> bool:
    """The backward of a singular op whose guard was checked, where the walk found no fix in the user's
    own terms (a constant the format holds as 0, a stable form, a draw): only a precision, or none."""
    specific = experiment.literal is not None or experiment.stable is not None or experiment.draw is not None
    singular = _by_forward_op(r) and _packet(r.forward_op or "") in SINGULAR
    return experiment.guard is not None and singular and not specific


def _guarded(r: Record, experiment: Experiment, advice: str) -> tuple[str, Trial]:
    """The guard before a singular op, checked; a higher precision upstream that also cured this step
    is said as what it is: the point moved, not kept out."""
    eps, after = experiment.guard or (0.0, 0.0)
    forward = r.forward_op or r.op
    dtype = experiment.dtype
    fix = (
        f"{advice.rstrip('. ')} (checked, eps = {eps:g}: the gradient of {forward} at the clamp's bound is "
        f"{after:.3g} in {dtype}, finite, and smaller past it)."
    )
    if experiment.verdict == "the-math":
        fix += " Not a precision change: in fp64 it is non-finite too."
    elif experiment.verdict == "origin" and experiment.checked_in:
        fix += (
            f" Raising {experiment.lines} to {experiment.checked_in} also cleared this step, but only "
            "moves the point where the values round onto it: values that keep growing reach it again."
        )
    trial = Trial.checked(
        f"the input of {forward} clamped at its bound, eps = {eps:g}",
        metric=f"the gradient of {forward} at that bound, in {dtype}",
        before="non-finite",
        after=f"finite, {after:.3g}",
        on="the dtype the backward ran in",
    )
    return fix, trial


# a second origin is said where the skipped steps it starts on are at least this share of those whose first
# non-finite op was seen (each such step the first origin's fix leaves skipped, and their skips sink the scale)
OTHER_ORIGIN = 0.1


def _line_of(r: Record) -> str:
    """The record's source line (file:line), or its op where no line is known."""
    return f"{r.location[0]}:{r.location[1]}" if r.location else r.op


def _unexperimented(fed: list[Any], experiments: Mapping[int, Any]) -> str:
    """Why a producer's advice went untried: the experiments run at the first producers only."""
    if fed:
        return "its inputs were already non-finite: the op that made them is where the experiment runs"
    if experiments:
        return "the experiments ran at the first producers of this trace, not at this one"
    return "the op was not re-run: its inputs were no longer held (or the experiments' time budget was spent)"


def _advice(r: Record) -> str:
    """What to change for the op `r`: a backward op by its forward op's advice (the op on the user's
    line), else its own."""
    forward = _packet(r.forward_op or "")
    own = (BACKWARD_ADVICE.get(forward) or OP_ADVICE.get(forward)) if _by_forward_op(r) else None
    return own or _fix_for(r)


def _by_forward_op(r: Record) -> bool:
    """A backward op told by its forward op's advice; not the cast of a gradient back to an input's
    dtype (autocast's ToCopyBackward, a DivBackward's cast): a value past that dtype's range there is
    the gradient's size, whatever the forward op computes."""
    return r.phase == "backward" and bool(r.forward_op) and _packet(r.op) not in ("_to_copy", "copy_")


def _fix_for(r: Record) -> str:
    if r.phase == "optimizer":
        return _OPTIMIZER
    if _by_forward_op(r) and (own := BACKWARD_ADVICE.get(_packet(r.forward_op or ""))):
        return own  # the forward op on the user's line: its gradient is the singular one
    if not transparent_op(r.op):  # a custom kernel's NaN is not an epsilon's to fix
        return custom_op_fix(r.op, None)
    packet = _packet(r.op)
    text = OP_ADVICE.get(packet, catalog.get("nonfinite-produced").fix)
    line = linecache.getline(*r.location[:2]) if packet == "pow" and r.location else ""
    if line and not _NEGATIVE_POWER.search(line):
        text = _POW_OVERFLOW  # x ** 2 of raw values, as written: the base, not a zero
    if packet in ("div", "div_") and len(r.inputs) == 1:
        text = _DIV_BY_CONSTANT  # no tensor denominator to guard: a constant one, the quotient past the range
    elif packet == "div" and r.location and (parts := _division(linecache.getline(*r.location[:2]))):
        top, bottom = parts  # the guard written with the line's own expressions
        dtype = r.outputs[0].dtype if r.outputs else "torch.float32"
        text = (
            f"guard the denominator `{bottom}` at line {r.location[1]}: ({top}) / ({bottom} + "
            f"torch.finfo({dtype}).eps), or torch.where({bottom} != 0, ..., 0) with the division masked too"
        )
    rng = range_cause(r)
    if rng is not None:
        return f"{text}; {rng}"
    dtypes = {o.dtype for o in r.outputs}
    if dtypes & {"torch.float16", "torch.bfloat16"}:
        text += f"; this op ran in {', '.join(sorted(dtypes))}: keeping it (or its module) in fp32 is the quickest test"
    return text
