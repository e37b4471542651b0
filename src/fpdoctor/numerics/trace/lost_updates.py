"""In-place running updates that a low-precision tensor rounds away, outside the model's training.

An EMA of the weights kept in bf16 (`ema.mul_(0.998).add_(w, alpha=0.002)`), a running mean or
statistic accumulated in fp16, an accumulator with a small step: each update is below half the
spacing of the values it is added to, so the tensor keeps its values (or moves by whole spacings
in the wrong direction) and nothing goes NaN. The optimizer's own updates of low-precision weights
are TRN010's (updates/); this watches the other in-place updates: on a narrow-dtype tensor that
wants no gradient, outside optimizer.step, calls of each op at each source line spread over the run
are redone exactly (fp64) and in fp32 from the same values, and the update the tensor kept is
compared with the exact one. Where it keeps less than half of it on every call checked, the line
is TRN010 with the tensor's dtype and shape, the update's lost share, and the fix checked: the same
op on an fp32 copy from the same values, against the exact (fp64) update.

Libraries write the same update in other forms, each judged the same way: the op written out= the
tensor itself (torch.lerp(ema, w, 1 - d, out=ema)), as its in-place form, or out= a tensor its
statement reads (torch.add(ema * d, w, alpha=1 - d, out=ema)), as a copy_ of it; a foreach op on a list of
tensors (torch._foreach_lerp_, swa_utils' multi-tensor EMA), each tensor of the list; a copy_ of
what a statement at its line computed from the tensor itself (timm's ModelEmaV2,
ema.copy_(d * ema + (1 - d) * w)), the statement's ops found in the trace's window and redone; and
a tensor bound again to what its line computes from its previous value (shadow[n] = shadow[n] * d +
p * (1 - d), no in-place op), which the trace finds by the line reading what its previous visit made
(`rebound`). Calls are counted per line and shape: a loop over the parameters calls one line per
tensor, and checks spread by count alone would all land on the same one.

BatchNorm's running statistics are such updates too, made inside the norm's own op (NORMS) in
training mode: running = (1 - momentum) * running + momentum * batch statistic. A model cast whole
to bf16 keeps them in bf16; near a feature mean of 300 (raw readings) bf16's spacing is 2, so every
update of the running mean is lost, and in eval mode the model normalises with a mean that never
followed its data. The op is redone from the same inputs with the statistics in fp64 and in fp32,
and each buffer's kept update compared as above; the buffers lost are one finding.
"""

from __future__ import annotations

import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.report.model import Finding, Severity, Trial
from fpdoctor.userframes import user_location

ACCUMULATES = frozenset({"add_", "sub_", "mul_", "lerp_", "addcmul_", "addcdiv_"})
# the same updates written out of place into the tensor itself (torch.lerp(ema, w, 1 - d, out=ema))
OUT_FORMS = frozenset(name.removesuffix("_") for name in ACCUMULATES)
# the same updates on a list of tensors at once (torch._foreach_lerp_: swa_utils' multi-tensor EMA)
FOREACH = frozenset("_foreach_" + name for name in ACCUMULATES)
# a tensor rewritten whole from a statement that reads it (timm's ModelEmaV2:
# ema.copy_(decay * ema + (1 - decay) * w)): the statement is redone, the copy_ is where it lands
COPY = "copy_"
# lerp takes one dtype: an fp32 tensor updated from bf16 values by lerp_ (torch._foreach_lerp_, swa_utils'
# multi-tensor EMA) raises, so keeping the tensor in fp32 needs what it reads cast too
ONE_DTYPE = frozenset({"lerp_", "lerp", "_foreach_lerp_"})
# a tensor bound again to what its line computes from its previous value (shadow[n] = shadow[n] * d +
# p * (1 - d)): no in-place op; the trace finds it by the line reading what its previous visit made
REBOUND = "rebound"
# batch norm ops that update the running statistics (arguments 3 and 4) in training mode (argument 5;
# _batch_norm_with_update always does)
NORMS = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_batch_norm_with_update", "cudnn_batch_norm",
                   "miopen_batch_norm"})  # fmt: skip
WATCHED = ACCUMULATES | FOREACH | NORMS | {COPY}
SPREAD_CALLS = 1 << 16  # the calls of a line (a norm's statistic) checked: the powers of two up to here,
STRIDE = 256  # and every 256th past the 256th: a statistic that stalls after call 256 of 1200 is judged at
# 512, 768 and 1024, not on 256, 512, 1024 of which the first still climbed
CHECKED = 3  # the latest calls checked of a norm's statistic that are judged
RECENT = 2  # and of a line's in-place update
LOST = 0.5  # an update is lost where what the tensor kept is off by half of it or more
FROZEN = 0.9  # a tensor that keeps no more than a tenth of its updates: it stands still
_NARROW = (torch.bfloat16, torch.float16)


def _checked(count: int) -> bool:
    """Whether the call after `count` calls of a line is checked: the 1st, 2nd, 4th, ..., and every
    STRIDE-th past the STRIDE-th, up to SPREAD_CALLS."""
    call = count + 1
    return call <= SPREAD_CALLS and (not call & (call - 1) or (call >= STRIDE and not call % STRIDE))


# A statement's ops redone from the same values: (function, arguments, keyword arguments, and per
# tensor argument the position in the list of the op that made it there, or None: a value read)
Statement = list[tuple[Any, tuple[Any, ...], dict[str, Any], dict[int, int]]]
_SMALLEST = 1  # values: a scalar too (a loss summed into a bf16 total for the epoch's printed mean stops at 256)
# and at most this many: the check's fp64 and fp32 copies of a larger one (a big embedding) would cost
# the job memory; the line's smaller tensors (an EMA updates every parameter at the same line) are checked
_LARGEST = 1 << 22


@dataclass
class _Line:
    op: str
    dtype: str
    shape: list[int]
    target: str | None = None  # the buffer's name (a norm's running statistic), where the model names it
    # the tensor first judged (a weak reference), to tell an optimizer's weight from an EMA's copy; and
    # whether it had a gradient (a weight a step by hand updates has one, an EMA's copy never)
    tensor: Any = None
    graded: bool = False
    lost: list[float] = field(default_factory=list)  # per call checked: ||kept - exact|| / ||exact update||
    kept_fp32: list[float] = field(default_factory=list)  # the same for the update kept in an fp32 tensor


@dataclass
class _Visit:
    """The latest in-place update checked, for an op that continues it (`after`)."""

    where: tuple[str, int]
    op: str
    count: int  # which call of its op at the line it was
    target: torch.Tensor
    after: torch.Tensor  # its value after the update
    start: torch.Tensor  # its value before the first op of the chain
    ops: list[tuple[Any, Any, Any]]  # (func, args, kwargs) of each op of the chain
    record: tuple[Any, ...]  # where the last op's check was recorded (LostUpdates.lines)


class LostUpdates:
    """Per (op, source line), what the first calls kept of their update (see the module docstring)."""

    def __init__(self) -> None:
        self.lines: dict[tuple[Any, ...], _Line] = {}  # (file, line, op, buffer names..., argument)
        self._counts: dict[tuple[Any, ...], int] = {}
        self._visit: _Visit | None = None

    def before(
        self, name: str, args: Any, phase: Callable[[], str], named: Callable[[torch.Tensor], str | None],
        made: Callable[..., Statement | None] | None = None, *, written: tuple[Any, dict[str, Any]] | None = None,
    ) -> Any:  # fmt: skip
        """What to keep before the op runs (its targets' values, by argument and list position), or
        None: not such an update. `made(t, line, target)`: the ops at that line that made `t` (a
        copy_'s source) from what they read, the target among it, for a statement a copy_ writes back."""
        foreach = name in FOREACH
        final = None
        # a trainable weight updated in place under no_grad, outside optimizer.step: a weight decay or
        # an update written by hand (p.mul_(1 - lr * wd)), which the weights' format rounds away too
        grad = torch.is_grad_enabled()
        if name in OUT_FORMS:  # an op written out= a tensor (`written`: the op and its keyword arguments)
            if written is None:
                return None
            func, kwargs = written
            out = kwargs.get("out")
            if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
                return None
            if same_memory(out, args[0]):  # into its first argument: the in-place update by another name
                name = name + "_"
            else:  # into a tensor its statement reads (torch.add(ema * d, w, out=ema)): judged as a copy_ of it
                rest = {k: v for k, v in kwargs.items() if k != "out"}
                final = (func.overloadpacket, tuple(args), rest)  # the packet: the functional overload
                args, name = (out, out), COPY
        if name in ACCUMULATES or name == COPY or foreach:
            targets: tuple[int, ...] = (0,)
            smallest = _SMALLEST
        elif name in NORMS and (name == "_batch_norm_with_update" or (len(args) > 5 and args[5] is True)):
            targets, smallest = (3, 4), 1  # a norm's statistics are running states at any size
        else:
            return None
        if foreach:  # every tensor of the list (the update is redone on all of them), each judged alone
            listed = args[0] if args and isinstance(args[0], (list, tuple)) else []
            picked: list[tuple[tuple[int, int | None], torch.Tensor]] = [
                ((0, j), t) for j, t in enumerate(listed) if isinstance(t, torch.Tensor)
            ]
            if not picked or len(picked) != len(listed) or any(
                t.dtype not in _NARROW or (t.requires_grad and grad) or t.numel() > _LARGEST for _, t in picked
            ):  # fmt: skip
                return None
        else:
            picked = [
                ((i, None), args[i])
                for i in targets
                if i < len(args) and isinstance(args[i], torch.Tensor) and args[i].dtype in _NARROW
                and not (args[i].requires_grad and grad) and smallest <= args[i].numel() <= _LARGEST
            ]  # fmt: skip
        if not picked:
            return None
        if name == COPY and (len(args) < 2 or not isinstance(args[1], torch.Tensor) or args[1].shape != args[0].shape):
            return None
        if phase() in ("optimizer", "backward"):  # the optimizer's updates are TRN010's, .grad sums TRN011's
            return None
        where = user_location(sys._getframe())
        if where is None:
            return None
        norm = name in NORMS
        # a norm's statistics by their buffers (one line calls every norm of a model); an EMA's updates by line
        names = [named(t) if norm else None for _, t in picked]
        # an EMA's updates by line and shape: a loop over parameters calls the line once per tensor, and
        # calls spread by count alone would all fall on the same one (the last bias, too small to judge)
        shape = () if foreach else tuple(picked[0][1].shape)
        key = (where[0], where[1], name, *names) if norm else (where[0], where[1], name, shape)
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        # a running state starts far from where it settles (a norm's statistics at 0 and 1, an EMA of
        # readings at 0) and takes large steps toward it first: the calls checked are spread over the
        # run (the 1st, 2nd, 4th, 8th, ..., and every STRIDE-th), and the latest judged
        if not _checked(count):
            return None
        statement = None
        if name == COPY:  # only a copy of what a statement at its line made from the target itself
            source = None if final is not None else args[1]
            statement = made(source, (where[0], where[1]), args[0], final=final) if made is not None else None
            if not statement or not any(same_memory(x, args[0]) for _, a, kw, _ in statement for x in _flat(a, kw)):
                return None
        olds = [(i, t.detach().clone(), n) for (i, t), n in zip(picked, names, strict=True)]
        return key, olds, count, statement, picked[0][1]

    def after(self, kept: Any, func: Any, args: Any, kwargs: Any) -> None:
        """The update each target kept, and the one an fp32 target keeps, against the update made
        exactly (in fp64) from the same values. `ema.mul_(d).add_(x, alpha=1 - d)` is one update made
        by two ops: where an op continues the one checked just before it (the same tensor, at the
        same line, from the value that op left), both are redone from the first one's values, and the
        pair is judged in place of the first alone (each op alone may move a state near 1000 by 10;
        together they move it by 0.1, which fp16 loses). A copy_ is judged by the statement it
        writes back, redone from the same values; a foreach update by each tensor of its list."""
        key, olds, count, statement, target = kept
        if statement is not None:  # a copy_'s target (or an out= op's), as the statement left it
            start = olds[0][1]
            redone = (_redo(statement, target, start, torch.float64), _redo(statement, target, start, torch.float32))
            self._judge(key, (0, None), target, start, redone)
            return
        if key[2] in FOREACH:
            r64s, r32s = (self._foreach(func, args, kwargs, olds, dtype) for dtype in (torch.float64, torch.float32))
            for (i, old, _), r64, r32 in zip(olds, r64s, r32s, strict=True):
                if old.numel() >= _SMALLEST:
                    self._judge(key, i, args[0][i[1]], old, (r64, r32))
            return
        visit = self._visit if key[2] in ACCUMULATES else None
        t0 = args[0]
        # the next op of the same statement: another op, its call of the same number (the same visit
        # of the line), on the same tensor, from the value the first left
        chained = (
            visit is not None and visit.where == key[:2] and visit.count == count and visit.op != key[2]
            and visit.target is t0 and torch.equal(visit.after, olds[0][1])
        )  # fmt: skip
        ops = [*visit.ops, (func, args, kwargs)] if chained and visit is not None else [(func, args, kwargs)]
        starts = {i[0]: (visit.start if chained and visit is not None and i[0] == 0 else old) for i, old, _ in olds}
        made: dict[torch.dtype, dict[int, torch.Tensor]] = {}
        for dtype in (torch.float64, torch.float32):
            copies = {i: start.to(dtype) for i, start in starts.items()}
            for f, a, kw in ops:
                wide = [copies[j] if j in copies else _widened(x, dtype) for j, x in enumerate(a)]
                # in place on the copies (an out= form written into the first one's copy)
                f(*wide, **{k: copies[0] if k == "out" else v for k, v in (kw or {}).items()})
            made[dtype] = {i: c.double() for i, c in copies.items()}
        if chained and visit is not None:  # the first op's own record is replaced by the pair's
            first = self.lines.get(visit.record)
            if first is not None and first.lost:
                first.lost.pop()
                first.kept_fp32.pop()
        for i, _, target in olds:
            redone = (made[torch.float64][i[0]], made[torch.float32][i[0]])
            self._judge(key, i, args[i[0]], starts[i[0]], redone, target=target)
        if key[2] in ACCUMULATES:
            self._visit = _Visit(key[:2], key[2], count, t0, t0.detach().clone(), starts[0], ops, (*key, 0))

    def rebound(
        self, where: tuple[str, int], value: torch.Tensor, statement: Statement,
        previous: Callable[[torch.Tensor], bool],
    ) -> None:  # fmt: skip
        """A tensor a line made from its own previous value (`previous(t)`: `t` is that value), judged
        as a copy_'s statement: the statement redone from the same values exactly and in fp32 (calls
        of the line spread over the run, as every update here)."""
        key = (where[0], where[1], REBOUND, tuple(value.shape))  # by shape, as in `before`
        count = self._counts.get(key, 0)
        self._counts[key] = count + 1
        if not _checked(count) or not _SMALLEST <= value.numel() <= _LARGEST:
            return
        old = next((x for _, a, kw, _ in statement for x in _flat(a, kw) if previous(x)), None)
        if old is None or old.shape != value.shape or old.dtype != value.dtype:
            return
        redone = (_redo(statement, old, old, torch.float64), _redo(statement, old, old, torch.float32))
        self._judge(key, (0, None), value, old, redone)

    def _judge(
        self, key: tuple[Any, ...], i: tuple[int, int | None], t: torch.Tensor, start: torch.Tensor,
        made: tuple[torch.Tensor, torch.Tensor], *, target: str | None = None,
    ) -> None:  # fmt: skip
        """One target's check: what it kept, and what an fp32 copy keeps (`made`: the update redone
        in fp64 and in fp32), against the exact update."""
        exact, fp32 = made[0].double(), made[1].double()
        size = float((exact - start.double()).norm())
        if size == 0.0:
            return
        record = (*key, i[0]) if i[1] is None else (*key, i[0], i[1])
        dtype = str(t.dtype).removeprefix("torch.")
        line = self.lines.get(record)
        if line is None:
            line = self.lines[record] = _Line(
                key[2], dtype, list(t.shape), target, weakref.ref(t), t.requires_grad and t.grad is not None
            )
        line.lost.append(float((t.detach().double() - exact).norm()) / size)
        line.kept_fp32.append(float((fp32 - exact).norm()) / size)

    @staticmethod
    def _foreach(func: Any, args: Any, kwargs: Any, olds: list[Any], dtype: torch.dtype) -> list[torch.Tensor]:
        """A foreach update redone on `dtype` copies of its list's values before it ran."""
        copies = [old.to(dtype) for _, old, _ in olds]
        wide = [
            copies
            if j == 0
            else [_widened(x, dtype) for x in a]
            if isinstance(a, (list, tuple))
            else _widened(a, dtype)
            for j, a in enumerate(args)
        ]
        func(*wide, **(kwargs or {}))  # in place on the copies
        return copies

    def findings(self, trained: Callable[[torch.Tensor], bool] | None = None) -> list[Finding]:
        """One finding per source line whose updates were lost on its latest checks (its ops together:
        `ema.mul_(decay).add_(w, alpha=1 - decay)` is one running update), and one for the norms'.
        `trained(t)`: whether an optimizer steps `t` (a weight decay or a step by hand, not an EMA's
        copy that kept requires_grad)."""
        self._visit = None  # the last tensor checked and its op's arguments: not kept past the trace
        by_line: dict[tuple[str, int], list[_Line]] = {}
        norms: list[_Line] = []
        for (file, number, *_), line in self.lines.items():
            if line.op in NORMS:
                norms.append(line)
            else:
                by_line.setdefault((file, number), []).append(line)
        out: list[Finding | None] = [self._norms_finding(norms)]
        for (file, number), found in by_line.items():
            # the latest two checks, where the state has settled (a slow EMA keeps its early updates and
            # loses them as it nears its target): half lost on average, the latest too; fp32 must keep them
            lost = [x for line in found for x in line.lost[-RECENT:]]
            kept_fp32 = [x for line in found for x in line.kept_fp32[-RECENT:]]
            latest = max((line.lost[-1] for line in found if line.lost), default=0.0)
            if len(lost) < RECENT or sum(lost) / len(lost) < LOST or latest < LOST or max(kept_fp32) >= LOST:
                continue
            line = found[0]
            weights = any(
                x.graded
                or (
                    trained is not None
                    and (t := x.tensor() if x.tensor is not None else None) is not None
                    and trained(t)
                )
                for x in found
            )
            decay = weights and all(x.op == "mul_" for x in found)  # a decay by hand: the optimizer's own is one
            ops = " and ".join(dict.fromkeys(f"aten.{x.op}" for x in found))  # each op once, as the line runs them
            shapes = list(dict.fromkeys(str(x.shape) for x in found))
            total = not weights and all(math.prod(x.shape) == 1 for x in found)  # one value: a running total
            if line.op == COPY:  # judged by the statement it writes back
                ops = "what the line computes from that tensor, written back into it (copy_ or out=),"
            elif line.op == REBOUND:
                ops = "what the line computes from the tensor's previous value, bound to it again,"
            where = f"{file}:{number}"
            # what the check measured in fp32, never more: an EMA near its weights (decay 0.999) can lose part of
            # its update to fp32's own rounding of ema * decay
            worst = max(kept_fp32)
            kept = "keeps all of it (checked)" if worst < 0.005 else f"loses at most {worst:.0%} of it (checked)"
            share = (
                f"{min(lost):.0%}" if f"{min(lost):.0%}" == f"{max(lost):.0%}" else f"{min(lost):.0%}-{max(lost):.0%}"
            )
            out.append(
                catalog.make(
                    "update-rounded-away",
                    title=f"A running update in {line.dtype} is rounded away: the tensor it updates stops following",
                    message=(
                        f"{ops} at {where} update{'s' if ' and ' not in ops else ''} "
                        + (
                            f"a {line.dtype} tensor of shape {line.shape}"
                            if len(shapes) == 1
                            else f"{line.dtype} tensors of {len(shapes)} shapes ({', '.join(shapes[:3])}"
                            f"{', ...' if len(shapes) > 3 else ''})"
                        )
                        + f"{'' if line.op == REBOUND else ' in place'} "
                        + (
                            "(trainable weights, under no_grad, outside the optimizer step: a weight decay or an "
                            "update written by hand), and "
                            if weights
                            else "(one value, no gradient: a running total or a counter, a loss summed for the "
                            "epoch's printed mean, a step count a learning-rate warm-up reads), and "
                            if total
                            else "(no gradient, outside the optimizer step: an EMA of weights, a hand-written "
                            "optimizer's moments, a running mean or statistic), and "
                        )
                        + f"on the latest {len(lost)} calls checked (calls spread over the run: the 1st, 2nd, 4th, "
                        f"...) the tensor kept an update off by "
                        f"{share} of the one the op makes exactly from the same values: "
                        f"each step's change is below half the spacing of {line.dtype} at those values, so the "
                        "tensor stays where it was (or moves by whole spacings). Nothing goes NaN; "
                        + (
                            "the weights train as if the line were not there."
                            if weights
                            else "what reads it stops with it: a printed epoch loss looks flat while the model "
                            "trains on, a warm-up computed from a step count stops raising the learning rate."
                            if total
                            else "what reads it (an EMA model's evaluation) does not improve."
                        )
                    ),
                    # a state (weights, an EMA) whose every update is lost is frozen: what reads it never improves,
                    # the run's result is wrong, an error; a running total or counter only misleads what it prints
                    severity=Severity.ERROR if min(lost) >= FROZEN and not total else None,
                    where={"module": None, "op": f"aten.{line.op}", "phase": "other"},
                    evidence={
                        "kind": "running-update",
                        "location": where,
                        "dtype": line.dtype,
                        "shape": line.shape,
                        "lost": lost,
                        "count": len(lost),
                        "numel": None,
                    },
                    fix=(
                        f"make this update on fp32 weights: keep fp32 master copies of the {line.dtype} parameters "
                        f"(or the model in fp32 under autocast), apply the line at {where} to the fp32 copies, not "
                        f"to the {line.dtype} ones, then copy them into the model"
                        + (
                            "; or drop the line and give the optimizer the decay (torch.optim.AdamW(params, "
                            "weight_decay=...)) over fp32 parameters"
                            if decay
                            else ""
                        )
                        + f". In fp32 the update at {where} {kept}"
                        if weights
                        else f"keep the total or counter in fp32: create it with dtype=torch.float32 (torch.zeros((), "
                        f"dtype=torch.float32)), or keep it a Python number (loss.item(), step += 1); in fp32 its "
                        f"update at {where} {kept}"
                        if total
                        else f"keep that tensor in fp32: create it with dtype=torch.float32 (torch.zeros_like(p, "
                        "dtype=torch.float32) for a state kept per parameter); an EMA copy of the weights is a "
                        f"deepcopy of the model left in fp32, evaluated through a {line.dtype} copy of it "
                        f"(copy.deepcopy(ema).to(torch.{line.dtype}): `.to` on the module itself casts it in place)"
                        + (_one_dtype(line.dtype) if any(x.op in ONE_DTYPE for x in found) else "")
                        + f". In fp32 its update at {where} {kept}"
                    ),
                    trial=Trial.checked(
                        f"the tensor in fp32, {ops} at {where} run on it from the same values",
                        metric="share of the exact update lost",
                        before=share,
                        after=f"{max(kept_fp32):.2%} at most",
                        on=f"the latest {len(lost)} calls checked of the line",
                    ),
                )
            )
        return [f for f in out if f is not None]

    def _norms_finding(self, norms: list[_Line]) -> Finding | None:
        """One finding for the norms' running statistics whose updates were lost on every call checked."""
        # judged on each statistic's latest checks: where it settled
        lost = [
            x for x in norms
            if len(x.lost) >= CHECKED and min(x.lost[-CHECKED:]) >= LOST and max(x.kept_fp32[-CHECKED:]) < LOST
        ]  # fmt: skip
        if not lost:
            return None
        dtype = lost[0].dtype
        for x in lost:
            x.lost, x.kept_fp32 = x.lost[-CHECKED:], x.kept_fp32[-CHECKED:]
        named = [
            f"{x.target or 'a running statistic of shape ' + str(x.shape)} (off by {min(x.lost):.0%}"
            + (f"-{max(x.lost):.0%}" if f"{max(x.lost):.0%}" != f"{min(x.lost):.0%}" else "")
            + ")"
            for x in lost
        ]
        shares = [v for x in lost for v in x.lost]
        kept_fp32 = max(v for x in lost for v in x.kept_fp32)
        calls = CHECKED
        return catalog.make(
            "update-rounded-away",
            title=f"BatchNorm's running statistics in {dtype} are rounded away: eval mode normalises with stale ones",
            message=(
                f"BatchNorm's running statistics are kept in {dtype} (the model cast to {dtype} whole), and on each "
                f"of the latest {calls} training calls checked (calls spread over the run: the 1st, 2nd, 4th, "
                f"8th, ...) their update was lost: {', '.join(named[:6])}"
                f"{f' and {len(named) - 6} more' if len(named) > 6 else ''}, against the update the norm makes "
                f"exactly from the same batch. Each update (momentum times the batch statistic's distance from "
                f"the running one) is below half the spacing of {dtype} at those values (a feature mean far from "
                "zero), so the statistics stay where they were. Training normalises with each batch's own "
                "statistics and looks fine; in eval mode (model.eval()) the model normalises with these, and its "
                "evaluation is far from its training."
            ),
            where={"module": None, "op": f"aten.{lost[0].op}", "phase": "forward"},
            evidence={
                "kind": "running-update",
                "buffers": [x.target for x in lost],
                "dtype": dtype,
                "lost": shares,
                "count": len(shares),
                "numel": None,
            },
            fix=(
                f"keep the BatchNorm layers in fp32 after casting the model: for m in model.modules(): "
                "if isinstance(m, torch.nn.modules.batchnorm._BatchNorm): m.float() (they take "
                f"{dtype} inputs as they are and return {dtype}); under autocast the norms already run in fp32"
            ),
            trial=Trial.checked(
                "the running statistics in fp32, the norm's op run on them from the same inputs",
                metric="share of the exact update lost",
                before=f"{min(shares):.0%} at least",
                after=f"{kept_fp32:.2%} at most",
                on=f"the latest {calls} training calls checked of each norm",
            ),
        )


def _widened(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _flat(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """An op's tensor arguments (elementwise ops: no lists)."""
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same values in memory: `p.data` is a new object on every read."""
    if a is b:
        return True
    return (
        a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    )  # fmt: skip


def _redo(statement: Statement, target: torch.Tensor, start: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A statement's ops redone in `dtype` from the values they read: the target's as they were
    before its copy_ (`start`), every other tensor cast; the last op's result."""
    made: list[torch.Tensor] = []

    def value(j: int, x: Any, sources: dict[int, int]) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if j in sources:
            return made[sources[j]]
        if same_memory(x, target):
            return start.to(dtype)
        return _widened(x, dtype)

    for func, args, kwargs, sources in statement:
        wide = [value(j, x, sources) for j, x in enumerate(args)]
        kw = {k: value(-1 - n, x, sources) for n, (k, x) in enumerate(kwargs.items())}
        made.append(func(*wide, **kw))
    return made[-1]


def _one_dtype(dtype: str) -> str:
    """The rest of an fp32 state's fix whose update is a lerp (ONE_DTYPE): what it reads cast to fp32."""
    return (
        f"; lerp takes one dtype, so the fp32 tensor's update reads the {dtype} values cast to fp32 "
        "(ema_p.lerp_(p.float(), 1 - decay); torch._foreach_lerp_(ema_params, [p.float() for p in params], "
        "1 - decay)); with torch.optim.swa_utils.AveragedModel, AveragedModel(model, "
        "avg_fn=get_ema_avg_fn(decay)).float(), whose avg_fn updates each parameter from its value as it is "
        "(get_ema_multi_avg_fn's foreach lerp raises on an fp32 EMA of bf16 weights)"
    )
