"""A fix checked on the step's loss, not only on the op that showed the symptom.

An experiment (reruns.py) checks its fix where the symptom appeared: exp at line 20 in fp32 is
finite. What the user sees is the loss, and the fix as printed may not reach it: the same overflow
on another line, a value cast back to fp16 where it overflows again, a log of a probability that
underflowed on the way. So when the step's backward begins (the forward is complete), the ops from
the fix's first change down to the loss are re-run with every change the step's experiments print
in place, the rest as they ran:

  a stable form   the form's last op gives the stable form's value of what its first op read;
  a constant      the op runs with the value the dtype holds in place of the constant;
  a precision     each op at the fix's lines runs in the checked precision, its result left there
                  for what reads it (x.float() on the line: torch's type promotion carries it on).

Every other op that reads a changed value runs as it ran, on the changed values. The loss is the
op of one value the backward starts from (a figure logged after it is not), before a GradScaler's
scale(loss) multiplies it. Its value then is the fix's figure on the loss, set beside the same ops
as written run in fp64: a loss that is still non-finite says the fix is not the whole fix, and one
that is finite but far from that value says the change alters what the loss computes (a guard's
replacement that clips). Where the loss was finite and its backward was not, the gradients a
backward from it sends out of the re-run ops are checked instead, once autograd is done with the
step's own backward (inside it, no op records a graph).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.numerics.engine import stable
from fpdoctor.numerics.engine.reruns import (
    _REDUCTIONS,
    Experiment,
    Lookup,
    OnLoss,
    Step,
    _kind,
    _lines,
    _run,
    _with_constant,
    op_packet,
)

EXACT_BYTES = 256 * 2**20  # the fp64 reference replay holds at most this much (every op's output kept)


@dataclass
class _Changes:
    """The changes the step's fixes print, as the replay puts them in place."""

    forms: dict[int, tuple[stable.Form, Step, Any]] = field(default_factory=dict)  # last op -> form, first op, dim
    constants: dict[int, tuple[float, float]] = field(default_factory=dict)  # origin op -> constant, value tried
    raised: dict[tuple[str, int], torch.dtype] = field(default_factory=dict)  # source line -> its precision
    said: list[str] = field(default_factory=list)  # each, as the fix says it


def check(
    experiments: list[Experiment], steps: list[Step], lookup: Lookup | None, root: tuple[str, Any] | None = None
) -> OnLoss | None:
    """The loss re-run with the fixes of `experiments` (one step's, origin verdicts) in place; None
    where no loss that was non-finite depends on them, or a change cannot be re-run (a check that
    cannot run says nothing). Runs inside the dispatch of the step's first backward op: no autograd."""
    prepared = _prepared(experiments, steps)
    if prepared is None:
        return None
    changes, start = prepared
    try:
        found = _replayed(steps, start, changes, lookup, root=root)
    except Exception:  # _Skip: an op that draws random numbers, an input written in place since
        return None
    if found is None or found[0].record.kind is None:
        return None
    exact = None
    try:  # the same ops as written, in fp64: what the loss is meant to be (a fix that is finite but
        # clips, a log(p + 1e-3) for a log(p + 1e-8), moves it); a dropout between says nothing of it
        if _fp64_bytes(steps, start, found[0]) <= EXACT_BYTES:
            exact = _replayed(steps, start, changes, lookup, as_ran=True, dtype=torch.float64, every=found[0])
    except Exception:
        exact = None
    loss, value = found
    left = _kind(value)
    reference = float(exact[1].double()) if exact is not None and _kind(exact[1]) is None else None
    before = str(loss.record.kind)
    return OnLoss(_named(loss), before, None if left else float(value.double()), _said(changes), left, exact=reference)


def check_gradients(
    experiments: list[Experiment], steps: list[Step], lookup: Lookup | None, root: tuple[str, Any] | None = None
) -> OnLoss | None:
    """Where the loss was finite as it ran and its backward was not (a norm's sum past the range: the
    cosine is 0, its gradient NaN): the gradients a backward from the loss sends out of the re-run ops,
    as they ran and with the changes. Runs once the step's backward is done (autograd is needed)."""
    prepared = _prepared(experiments, steps)
    if prepared is None:
        return None
    changes, start = prepared
    try:
        if _gradients(steps, start, changes, lookup, root, as_ran=True) != "non-finite":
            return None
        left = _gradients(steps, start, changes, lookup, root)
        found = _replayed(steps, start, changes, lookup, root=root)
    except Exception:  # as check's
        return None
    if found is None or left is None:
        return None
    loss, value = found
    after = float(value.double()) if left == "finite" else None
    return OnLoss(_named(loss), "finite", after, _said(changes), None if after is not None else "nan", "gradients")


def gradients_left(
    experiments: list[Experiment], steps: list[Step], lookup: Lookup | None, root: tuple[str, Any] | None = None
) -> bool | None:
    """Where the changes made the loss finite: whether the gradients a backward from it sends out of the
    re-run ops are still non-finite (None: it cannot be re-run). From the loss itself, not its scaled
    value: non-finite here is non-finite at every loss scale. Runs once the step's backward is done."""
    prepared = _prepared(experiments, steps)
    if prepared is None:
        return None
    changes, start = prepared
    try:
        left = _gradients(steps, start, changes, lookup, root)
    except Exception:  # as check's
        return None
    return None if left is None else left == "non-finite"


def _fp64_bytes(steps: list[Step], start: int, loss: Step) -> int:
    """What the fp64 replay from `start` to the loss holds at most: every output of the ops between, in fp64."""
    return sum(
        8 * math.prod(o.shape)
        for s in steps if start <= s.record.index <= loss.record.index and s.record.phase == "forward"
        for o in s.record.outputs
    )  # fmt: skip


def _prepared(experiments: list[Experiment], steps: list[Step]) -> tuple[_Changes, int] | None:
    """The changes and the first op they change; None where there is nothing to re-run."""
    by_index = {s.record.index: s for s in steps}
    changes = _changes(experiments, by_index)
    if changes is None or not changes.said:
        return None
    # a form from its first op, and from every op its last one reads (x.exp() / x.exp().sum(): two exps)
    begins = [first.record.index for _, first, _ in changes.forms.values()] + [*changes.constants]
    begins += [
        i for last in changes.forms for kind, i in by_index[last].record.inputs if kind == "op" and i in by_index
    ]
    begins += [s.record.index for s in steps if _line(s) in changes.raised and s.record.phase == "forward"]
    return (changes, min(begins)) if begins else None


def _named(loss: Step) -> str:
    at = loss.record.location
    return f"{loss.record.op}" + (f" at {at[0]}:{at[1]}" if at else "")


def _said(changes: _Changes) -> str:
    return said_once(changes.said)


_LINES_IN_FP32 = re.compile(r"^lines? ([\d, ]+(?: and \d+)?) of (.+) in fp32$")


def said_once(said: list[str]) -> str:
    """The changes of one run, each once; the lines of one file raised to fp32 as one set ("line 48 in fp32;
    lines 48 and 50 in fp32; line 51 in fp32" is lines 48, 50 and 51 in fp32), where the first of them was."""
    out: list[str] = []
    lines: dict[str, set[int]] = {}
    for text in dict.fromkeys(said):
        found = _LINES_IN_FP32.match(text)
        if found is None:
            out.append(text)
            continue
        file = found.group(2)
        if file not in lines:
            out.append(f"\0{file}")  # where the file's set goes, spelled at the end
            lines[file] = set()
        lines[file].update(int(n) for n in re.findall(r"\d+", found.group(1)))
    for file, numbers in lines.items():
        ordered = sorted(numbers)
        listed = str(ordered[0]) if len(ordered) == 1 else f"{', '.join(map(str, ordered[:-1]))} and {ordered[-1]}"
        out[out.index(f"\0{file}")] = f"line{'s' if len(ordered) > 1 else ''} {listed} of {file} in fp32"
    return "; ".join(out)


def _gradients(
    steps: list[Step],
    start: int,
    changes: _Changes,
    lookup: Lookup | None,
    root: tuple[str, Any] | None,
    *,
    as_ran: bool = False,
) -> str | None:
    """'finite' or 'non-finite': the gradients a backward from the loss sends out of the re-run ops
    (into the tensors they read that want one, read as new leaves: never the program's graph), with
    the changes in place or (`as_ran`) the same ops as they ran."""
    leaves: list[torch.Tensor] = []
    with torch.enable_grad():
        found = _replayed(steps, start, changes, lookup, leaves=leaves, as_ran=as_ran, root=root)
        if found is None or not found[1].requires_grad or not leaves:
            return None
        grads = torch.autograd.grad(found[1], leaves, allow_unused=True)
    made = [g for g in grads if g is not None]
    if not made:
        return None
    return "finite" if all(bool(torch.isfinite(g).all()) for g in made) else "non-finite"


def _changes(experiments: list[Experiment], by_index: dict[int, Step]) -> _Changes | None:
    """What each experiment's printed fix changes; None where one is a fix the replay cannot put in
    place (a cast held at its limit, a fresh random draw)."""
    changes = _Changes()
    # the forms a fix writes, whole (a prefix form's later ops re-run: not put in place here)
    forms = [
        e.form_records for e in experiments if e.stable is not None and e.stable.scaled and not e.stable.form.prefix
    ]
    # a stable form's lines are the form's: another experiment's precision fix there is the same change
    formed = {(r.location[0], r.location[1]) for ran in forms for r in ran if r.location}
    # a form inside a longer one (the softmax of the log-softmax another experiment completed) is that one
    inner = {r.index for ran in forms for r in ran[:-1]}
    for e in experiments:
        if e.verdict != "origin" or e.origin is None or e.origin.index not in by_index:
            continue
        # in the order Experiment._word_origin_at_op prints them: the fix checked is the fix printed
        if e.literal is not None and e.literal_fix is not None:
            changes.constants[e.origin.index] = (e.literal[0], e.literal_fix[0])
            changes.said.append(f"the constant {e.literal[0]:g} as {e.literal_fix[0]:g}")
        elif e.saturated_fix is not None or (e.stable is not None and e.stable.scaled and e.stable.form.prefix):
            return None  # a cast held at its limit, a form whose later ops re-run: not put in place here
        elif e.stable is not None and e.stable.scaled:
            ran = e.form_records
            if ran[-1].index in inner:
                continue
            first = by_index.get(ran[0].index)
            reduction = next((by_index.get(r.index) for r in ran if op_packet(r.op) in _REDUCTIONS), None)
            # a form over a dim takes it from its reduction; a sigmoid's (F.logsigmoid) takes none
            elementwise = e.stable.form.ops[0] == "sigmoid"
            if first is None or (reduction is None and not elementwise):
                return None
            changes.forms[ran[-1].index] = (e.stable.form, first, reduction.args if reduction is not None else ())
            changes.said.append(f"{e.stable.form.stable} at {_lines(ran)}")
        elif e.checked_in in ("fp32", "fp64"):
            located = [(r.location[0], r.location[1]) for r in e.chain if r.location]
            if not located:
                return None
            if all(at in formed for at in located):
                continue
            dtype = torch.float32 if e.checked_in == "fp32" else torch.float64
            changes.raised.update(dict.fromkeys(located, dtype))
            changes.said.append(f"{_lines(e.chain)} in {e.checked_in}")
        else:
            return None
    return changes


def _replayed(
    steps: list[Step], start: int, changes: _Changes, lookup: Lookup | None,
    leaves: list[torch.Tensor] | None = None, *, as_ran: bool = False, dtype: torch.dtype | None = None,
    every: Step | None = None, root: tuple[str, Any] | None = None,
) -> tuple[Step, torch.Tensor] | None:  # fmt: skip
    """The forward from `start` with the changes in place (see check), or the same ops as they ran
    (`as_ran`), each op in `dtype` where given: the loss and its value then. The ops re-run are the
    changed ones and those that read what a re-run op made, or (`every`: the loss found so) each op
    from `start` down to that loss. `leaves` as reruns._run's."""
    values: dict[int, list[torch.Tensor]] = {}
    losses: list[Step] = []
    for step in steps:
        r = step.record
        if r.index < start or r.phase != "forward" or (every is not None and r.index > every.record.index):
            continue
        changed = r.index in changes.forms or r.index in changes.constants or _line(step) in changes.raised
        if as_ran and changed:
            out = _run(step, dtype, values, lookup, strict=True, leaves=leaves)
        elif r.index in changes.forms:
            form, first, dim = changes.forms[r.index]
            x = _operand(form, first, values)
            if x is None:
                return None
            if leaves is not None and x.requires_grad and not any(x is v for vs in values.values() for v in vs):
                x = x.detach().requires_grad_(True)  # the program's tensor: a leaf of the re-run, as _run reads it
                leaves.append(x)
            extra = stable._dim(first.args) if form.ops[0] == "_softmax" else stable._dim(dim)
            value = form.call(x, extra)
            shape = tuple(r.outputs[0].shape) if r.outputs else value.shape
            # the reduction's keepdim: logsumexp(x, dim) where the code kept the dim (.sum(-1, keepdim=True))
            out = [value.reshape(shape) if value.numel() == math.prod(shape) else value]
        elif r.index in changes.constants:
            old, new = changes.constants[r.index]
            (changed_step,) = _with_constant(old, new, step, [step])
            out = _run(changed_step, None, values, lookup, strict=True, leaves=leaves)
        elif (at := _line(step)) is not None and at in changes.raised:
            out = _run(step, changes.raised[at], values, lookup, strict=True, leaves=leaves)
        elif every is not None or r.index == start or any(src[0] == "op" and src[1] in values for src in r.inputs):
            out = _run(step, dtype, values, lookup, strict=True, leaves=leaves)
        else:
            continue
        values[r.index] = out
        if every is not None and r.index == every.record.index:
            return every, out[0]
        if r.outputs and math.prod(r.outputs[0].shape) == 1 and out and out[0].is_floating_point():
            losses.append(step)
    loss = _unscaled(losses, values, root)
    return None if loss is None else (loss, values[loss.record.index][0])


def _unscaled(losses: list[Step], values: dict[int, list[torch.Tensor]], root: tuple[str, Any] | None) -> Step | None:
    """The loss: the op of one value that reads a change and that the backward started from (`root`:
    its op and source line; else the last such op: a metric computed after the loss from the same
    logits is not it), before a GradScaler's scale(loss) multiplies it by the scale (a one-value
    tensor no change reaches)."""
    if root is not None:  # cut at the root: the scaled loss's mul stays last, for the rule below
        at = [i for i, s in enumerate(losses) if (s.record.op, s.record.location) == root]
        losses = losses[: at[-1] + 1] if at else losses
    if not losses:
        return None
    last = losses[-1]
    if op_packet(last.record.op) == "mul" and len(last.record.inputs) == 2:
        read = {("op", s.record.index): s for s in losses[:-1]}
        scaled = next((src for src in last.record.inputs if src in read), None)
        other = next((src for src in last.record.inputs if src != scaled), None)
        if scaled is not None and other is not None and not (other[0] == "op" and other[1] in values):
            return read[scaled]
    return last


def _line(step: Step) -> tuple[str, int] | None:
    at = step.record.location
    return (at[0], at[1]) if at else None


def _operand(form: stable.Form, first: Step, values: dict[int, list[torch.Tensor]]) -> torch.Tensor | None:
    """What the form's first op read, recomputed where a change made it."""
    x = form.operand(first.args)
    if x is None or not first.record.inputs:
        return x
    src = first.record.inputs[0]
    if src[0] == "op" and src[1] in values:
        return next((o for o in values[src[1]] if o.shape == x.shape), x)
    return x
