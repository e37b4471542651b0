"""The reference step's update stages: the update the optimizer made of the gradients it received,
and the update the weights kept, against the update the same optimizer makes of the reference
step's gradients in fp32.

Where the gradients agree with the reference's (reference.py), the step can still lose its update
after them: a bf16 weight or optimizer state that rounds it away, a decay applied again after the
optimizer's, an update clipped or zeroed by code that writes the weights. Two more stages locate it:

  intended  the optimizer's update of the gradients it receives: a copy of it (its class,
            hyperparameters and state, each tensor at its own dtype) over copies of the weights at
            their own dtypes, stepped once; its change of them
  kept      what the user's weights hold when the next step begins, against what they held before
            this one: the optimizer's step and whatever ran after it (its hooks, the loop's code)

Both against the reference's update: a copy of the same optimizer over fp32 copies of the weights,
its state in fp32, stepped once on the reference step's gradients (as step_fn handed them on). Per
parameter: the norm ratio and cosine of the updates and the update-to-weight ratio of each.

Between the optimizer's step and the next step a profile function (`sys.setprofile`, this thread,
only while no other is set) notes the calls made from the user's code that write a parameter or its
gradient in place (`p.mul_`, `p.data.clamp_`, `torch._foreach_mul_`): when the weights keep another
update than the optimizer made, the finding names them with their lines. The copies are stepped out
of torch's global optimizer hooks and never touch the user's tensors, state or RNG.

A write that holds the weights within bounds (`clamp_`, `clip_`, `clamp_min_`, `clamp_max_`: a
WGAN critic's weight clipping, a range constraint) is part of the recipe, as the user's gradient
clipping is: the reference's weights are held by the same bounds (read from the kept weights, which
touch them) before the two updates are compared, so a constraint applied as intended is no
departure. A write that changes the update itself (a decay applied again, a copy back, a scaled
gradient) is not replayed: it is what the kept stage is there to find.

Cost, on reference steps only: two optimizer steps on copies (the weights and the optimizer's state
copied twice), a copy of the weights until the next step begins, and the profile function over the
code between the two steps.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.training.reference import (
    NEGLIGIBLE,
    RATIO,
    SHOWN,
    STRAY,
    TINY,
    Comparison,
    Departure,
    _badness,
)
from fpdoctor.numerics.updates.measure import no_global_optimizer_hooks, ours
from fpdoctor.numerics.updates.whatif import same_class
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import foreach_norm, named_parameters
from fpdoctor.userframes import CASEBOOK_DIR, OWN_DIR, is_user_file

UPDATE_STAGES = ("intended", "kept")
# the profile function takes itself off after this many C calls or seconds: a loop that never steps again
EVENTS = 2_000_000
SECONDS = 120.0
CALLS = 8  # calls the evidence names, most frequent first
_UNDERFLOW = 1e-15  # a norm this small: its elements' squares (~1e-38 and below) leave fp32's normal range
# in-place calls that hold a weight within bounds, each with the bounds it sets (lower, upper)
BOUNDS = {"clamp_": (True, True), "clip_": (True, True), "clamp_min_": (True, False), "clamp_max_": (False, True)}


def _copy_optimizer(optimizer: torch.optim.Optimizer, stand_in: dict[int, torch.Tensor], *, fp32: bool) -> Any:
    """The same optimizer class, hyperparameters and state over `stand_in` (by the id of the user's
    tensor; every parameter of the optimizer has one, so that a step of the copy never reaches the
    user's). The state is cloned at its own dtype (a bf16 state stays bf16), or in fp32."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [stand_in[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    new = same_class(optimizer, groups)  # a torch.optim class takes its groups alone
    for p, state in optimizer.state.items():
        if id(p) not in stand_in:
            continue
        new.state[stand_in[id(p)]] = {
            key: _state_copy(value, fp32=fp32 and key != "step") for key, value in state.items()
        }
    return new


def _state_copy(value: Any, *, fp32: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if fp32 and value.is_floating_point():
        return value.detach().to(torch.float32, copy=True)
    return value.detach().clone()


def step_on_copies(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    grads: dict[str, torch.Tensor],
    *,
    fp32: bool,
    described: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """One step of a copy of `optimizer` over copies of the model's weights (fp32, or each at its own
    dtype) whose gradients are `grads` (by parameter name): each named weight's change, in fp32.
    `described`: gets the copy after its step, in words (its state exists from the first step on)."""
    names = {id(p): n for n, p in named_parameters(model)}
    stand_in: dict[int, torch.Tensor] = {}
    before: dict[str, torch.Tensor] = {}
    rng = RngState.capture()  # no torch optimizer draws; a user's subclass might
    try:
        with ours(), no_global_optimizer_hooks():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    copy = p.detach().to(torch.float32 if fp32 else p.dtype, copy=True)
                    name = names.get(id(p))
                    if name is not None and name in grads:
                        copy.grad = grads[name].to(copy.dtype, copy=True)  # an optimizer may write into it
                        before[name] = copy.detach().to(torch.float32, copy=True)  # never the copy itself
                    stand_in[id(p)] = copy
            copied = _copy_optimizer(optimizer, stand_in, fp32=fp32)
            copied.step()
            if described is not None:
                described.append(_describe(copied))
            by_name = {names[i]: t for i, t in stand_in.items() if i in names}
            return {n: by_name[n].detach().float() - w for n, w in before.items()}
    finally:
        rng.restore()


def _update_rows(
    stage: str, ours_: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]
) -> list[Departure]:
    """Each parameter's update against the reference's, worst first, with the update-to-weight
    ratio each implies; a parameter whose reference update is negligible beside the model's is
    judged only when its own is not (reference._rows's rule). Reductions that read each tensor once
    and make no copy of it (norms over the whole list at once, a dot product per tensor), one host
    read; a parameter whose norms are small enough for fp32's squares to underflow is taken again
    in fp64 (a converged run's updates of 1e-20)."""
    names = [n for n in ours_ if n in ref and n in weights and ours_[n].shape == ref[n].shape]
    if not names:
        return []
    with ours():
        got = [ours_[n].reshape(-1) for n in names]
        want = [ref[n].reshape(-1) for n in names]
        columns = [
            torch.stack(foreach_norm(got, torch.float32)),
            torch.stack(foreach_norm(want, torch.float32)),
            torch.stack(foreach_norm([weights[n].reshape(-1) for n in names], torch.float32)),
            torch.stack([torch.dot(a, b) for a, b in zip(got, want, strict=True)]),
            torch.stack([torch.count_nonzero(b.ne(0) & a.eq(0)) for a, b in zip(got, want, strict=True)]).float(),
            torch.stack([torch.count_nonzero(b) for b in want]).float(),
        ]
        read = torch.cat(columns).tolist()
    k = len(names)
    got_norms, ref_norms, w_norms, dots, zeroed, lives = (read[i * k : (i + 1) * k] for i in range(6))
    for i, (g, r) in enumerate(zip(got_norms, ref_norms, strict=True)):
        if 0 < r < _UNDERFLOW or 0 < g < _UNDERFLOW:  # fp32's squares lose these: fp64, this tensor only
            a, b = got[i].double(), want[i].double()
            got_norms[i], ref_norms[i], dots[i] = float(a.norm()), float(b.norm()), float(a @ b)
    sizes = [t.numel() for t in want]
    rms = math.sqrt(sum(r * r for r in ref_norms) / max(sum(sizes), 1))
    out = []
    for i, name in enumerate(names):
        ref_norm, got_norm, weight = ref_norms[i], got_norms[i], w_norms[i]
        if not (math.isfinite(got_norm) and math.isfinite(ref_norm)) or ref_norm < TINY:
            continue  # a non-finite update is the step judge's own finding
        if ref_norm / math.sqrt(sizes[i]) < NEGLIGIBLE * rms and got_norm / math.sqrt(sizes[i]) < STRAY * rms:
            continue
        cosine = dots[i] / (got_norm * ref_norm) if got_norm > 0 else 0.0
        out.append(
            Departure(
                name,
                stage,
                got_norm / ref_norm,
                cosine,
                zeroed[i] / max(lives[i], 1.0),
                to_weight=got_norm / weight if weight > TINY else None,
                ref_to_weight=ref_norm / weight if weight > TINY else None,
            )
        )
    return sorted(out, key=_badness, reverse=True)


@dataclass
class Written:
    """Calls seen writing a parameter (or its gradient) from one line of the user's code."""

    call: str
    targets: list[str]
    file: str
    line: int
    function: str
    count: int = 0

    def text(self) -> str:
        on = f" on {', '.join(f'`{t}`' for t in self.targets[:3])}" if self.targets else ""
        more = "..." if len(self.targets) > 3 else ""
        times = f" ({self.count} calls)" if self.count > 1 else ""
        return f"`{self.call}`{on}{more} at {self.file}:{self.line} (in {self.function}){times}"


class WriteWatch:
    """The calls from the user's code that write the model's parameters or their gradients in place,
    between the optimizer's step and the next step: a profile function, this thread only, set only
    while no other is (a profiler, a debugger's) and never left behind (`stop`, or after EVENTS)."""

    def __init__(self, model: nn.Module) -> None:
        self._names: dict[int, str] = {}
        self._storages: dict[int, str] = {}
        for name, p in named_parameters(model):
            for t, label in ((p, name), (p.grad, f"{name}.grad")):
                if t is not None:
                    self._names[id(t)] = label
                    self._storages[t.untyped_storage().data_ptr()] = label
        self.seen: dict[tuple[str, str, int], Written] = {}
        self.unnamed = 0  # writes seen on tensors that are not the model's parameters: not kept
        self._events = 0
        self._fn: Callable[[FrameType, str, Any], None] = self._event
        self._until = 0.0
        self.on = False
        self.started = False  # False: another profile function was set (a profiler's): nothing watched

    def start(self) -> None:
        for other in _WATCHING:  # another judge's, whose loop did not step again: this step is the one looked at
            other.stop()
        _WATCHING.clear()
        if sys.getprofile() is None:
            self._until = time.monotonic() + SECONDS
            sys.setprofile(self._fn)
            self.on = self.started = True
            _WATCHING.append(self)

    def stop(self) -> None:
        """Off now in this thread; from another thread (a report read there), at the training
        thread's next call, by the profile function itself."""
        if self.on and sys.getprofile() == self._fn:  # never someone else's, set since
            sys.setprofile(None)
        self.on = False

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        # a profile function that raises is taken off and the exception reaches the user: never
        try:
            if not self.on:
                sys.setprofile(None)  # stopped from another thread: this thread's profile function is this one
                return
            if event != "c_call":
                return
            self._events += 1
            if self._events > EVENTS or (self._events % 4096 == 0 and time.monotonic() > self._until):
                self.stop()
                return
            name = getattr(arg, "__name__", "")
            if not name.endswith("_") or (name.startswith("_") and not name.startswith("_foreach_")):
                return  # not an in-place write
            if name in _NOT_WRITES:
                return
            target = getattr(arg, "__self__", None)
            label: str | None = None
            if isinstance(target, torch.Tensor):
                label = self._names.get(id(target)) or self._storages.get(target.untyped_storage().data_ptr())
                if label is None:
                    self.unnamed += 1
                    return
            elif target is not None and not isinstance(target, type(sys)):
                return  # a method of some other object
            where = _user_caller(frame)
            if where is None:
                return
            key = (name, where[0], where[1])
            written = self.seen.get(key)
            if written is None:
                if len(self.seen) >= 256:
                    return
                written = self.seen[key] = Written(name, [], where[0], where[1], where[2])
            written.count += 1
            if label is not None and label not in written.targets and len(written.targets) < 16:
                written.targets.append(label)
        except Exception:
            return

    def calls(self) -> tuple[str, list[Written]]:
        """The most telling calls seen, most calls first, and what they wrote: the weights, else their
        gradients (a step pre-hook that rescales them), else tensors not known (a torch function given
        the parameters, `torch._foreach_mul_(params, ...)`); ("", []) when none was seen."""
        seen = sorted(self.seen.values(), key=lambda w: -w.count)
        weights = [w for w in seen if any(not t.endswith(".grad") for t in w.targets)]
        grads = [w for w in seen if w.targets and w not in weights]
        unknown = [w for w in seen if not w.targets]
        if weights:
            return "weights", weights
        if grads:
            return "gradients", grads
        return ("unknown", unknown) if unknown else ("", [])


# in-place by name, but they change no value
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "retain_grad_", "record_stream_"})
_WATCHING: list[WriteWatch] = []  # the watch whose profile function is set, if any


def _user_caller(frame: FrameType | None) -> tuple[str, int, str] | None:
    """The user's line that made the call, unless fpdoctor's own code is met first on the way out
    (the optimizer's own writes, made inside the step fpdoctor asked of it, are the step's)."""
    f = frame
    while f is not None:
        filename = f.f_code.co_filename
        if filename.startswith(OWN_DIR) and not filename.startswith(CASEBOOK_DIR):
            return None
        if is_user_file(filename):
            return filename, f.f_lineno, f.f_code.co_name
        f = f.f_back
    return None


@dataclass
class Pending:
    """A reference step whose weights are judged when the next step begins (`finish`)."""

    comparison: Comparison
    recipe: str
    before: dict[str, torch.Tensor]  # the weights before the step, at their own dtype
    reference: dict[str, torch.Tensor]  # the reference's update
    intended: dict[str, torch.Tensor]  # the optimizer's own update, on copies
    watch: WriteWatch


def start(
    comparison: Comparison,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    live: dict[str, torch.Tensor],
    reference_grads: dict[str, torch.Tensor],
    divide: float,
    recipe: str,
    watch_now: bool = True,
) -> Pending | None:
    """The intended stage now (before the user's optimizer steps); the kept stage pending. `live`:
    the step's gradients at their own dtype, `divide`: the loss scale the optimizer will divide out
    (1 where step_fn unscaled them). None: the step's gradients are not finite (the scaler skips it).
    `watch_now` False: the writes are watched from `Pending.watch.start()`, called once the
    optimizer has stepped (watch judges a step before the user's optimizer steps it, and the
    optimizer's own writes are no writes between the steps)."""
    grads = {n: g.float() / divide if divide != 1.0 else g for n, g in live.items()}
    if grads and not math.isfinite(float(torch.stack(foreach_norm(list(grads.values()), torch.float32)).sum())):
        comparison.update_not_compared = "the step's gradients are not finite: the optimizer is not given them"
        return None
    params = dict(named_parameters(model))
    # the parameters whose gradients were judged: one whose reference gradient is rounding only (a bias
    # before a normalisation) has an update made of that rounding too, and Adam's, divided by its own
    # size, is as large as any other's: judging it would judge the rounding's sign
    judged = {d.name for d in comparison.rows.get("optimizer") or comparison.rows.get("backward", [])}
    weights = {n: params[n].detach().float() for n in grads if n in params and n in judged}
    reference = step_on_copies(optimizer, model, reference_grads, fp32=True)
    described: list[str] = []
    intended = step_on_copies(optimizer, model, grads, fp32=False, described=described)
    comparison.rows["intended"] = _update_rows("intended", intended, reference, weights)
    comparison.optimizer = described[0]
    if comparison.departed("intended"):
        # the what-if: the same optimizer over fp32 copies of the same weights and state, on the same gradients
        fp32 = step_on_copies(optimizer, model, grads, fp32=True)
        comparison.at_fp32 = [d for d in _update_rows("intended", fp32, reference, weights) if d.departs()]
        return None
    before = {n: params[n].detach().clone() for n in weights}
    watch = WriteWatch(model)
    if watch_now:
        watch.start()
    return Pending(comparison, recipe, before, reference, intended, watch)


def finish(pending: Pending, model: nn.Module, *, applied: bool, why: str = "") -> None:
    """The kept stage: the weights now against those before the step; rows into the comparison."""
    pending.watch.stop()
    comparison = pending.comparison
    if not applied:
        comparison.update_not_compared = why or "the step was not applied"
        return
    params = dict(named_parameters(model))
    kept = {n: params[n].detach().float() - w.float() for n, w in pending.before.items() if n in params}
    weights = {n: w.float() for n, w in pending.before.items()}
    reference, comparison.constrained = _held(pending, kept, pending.watch.seen.values())
    comparison.rows["kept"] = _update_rows("kept", kept, reference, weights)
    # how much what ran after the optimizer's step changed its update, per departed parameter
    comparison.kept_vs_intended = {
        d.name: _against(kept[d.name], pending.intended[d.name]) for d in comparison.departed("kept")
    }
    comparison.written_kind, comparison.written = pending.watch.calls()
    if not pending.watch.started:
        comparison.written_kind = "unwatched"
    pending.before.clear()


def _held(
    pending: Pending, kept: dict[str, torch.Tensor], written: Any
) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The reference's update with the user's bounds applied to its weights too, for each parameter
    that only bounding calls wrote between the steps; and those parameters, with the calls' places."""
    calls: dict[str, set[str]] = {}
    places: dict[str, list[str]] = {}
    for w in written:
        for target in w.targets:
            calls.setdefault(target, set()).add(w.call)
            places.setdefault(target, []).append(f"`{w.call}` at {w.file}:{w.line}")
    reference = dict(pending.reference)
    held: dict[str, list[str]] = {}
    with ours():
        for name, used in calls.items():
            if name not in kept or name not in reference or not used <= BOUNDS.keys():
                continue
            lower = any(BOUNDS[c][0] for c in used)
            upper = any(BOUNDS[c][1] for c in used)
            before = pending.before[name].float()
            now = before + kept[name]  # the weights as the bounds left them: they touch the bounds
            bounded = (before + reference[name]).clamp(
                float(now.min()) if lower else None, float(now.max()) if upper else None
            )
            reference[name] = bounded - before
            held[name] = places[name]
    return reference, held


def _against(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(norm ratio, cosine) of one update against another."""
    ref_norm, got_norm = float(ref.norm()), float(got.norm())
    if ref_norm < TINY:
        return (math.inf if got_norm > TINY else 1.0), (1.0 if got_norm <= TINY else 0.0)
    cosine = float((got.double() * ref.double()).sum()) / (got_norm * ref_norm) if got_norm > 0 else 0.0
    return got_norm / ref_norm, cosine


def _describe(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer and the dtypes of its weights and state: what does its arithmetic."""
    weights = sorted({str(p.dtype).removeprefix("torch.") for g in optimizer.param_groups for p in g["params"]})
    state = sorted(
        {
            f"{k}: {str(v.dtype).removeprefix('torch.')}"
            for s in optimizer.state.values()
            for k, v in s.items()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step"
        }
    )
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    how = next((k for k in ("fused", "foreach") if group.get(k)), None)
    text = f"{type(optimizer).__name__}{f' ({how})' if how else ''} over {'/'.join(weights)} weights"
    return text + (f", its state {', '.join(state)}" if state else "")


def finding(comparison: Comparison, *, recipe: str, here: dict[str, Any]) -> Finding | None:
    """`update-departs-from-reference` where the updates part while the gradients agree."""
    stage = comparison.first_stage()
    if stage not in UPDATE_STAGES:
        return None
    departed = comparison.departed(stage)
    compared = len(comparison.rows[stage])
    worst = "; ".join(_text(d) for d in departed[:3]) + ("; ..." if len(departed) > 3 else "")
    step = comparison.step
    of = (
        "of your step's own gradients over fp32 copies of the weights and its state"
        if comparison.update_reference == "own"
        else "of the reference's gradients in fp32"
    )
    head = (
        f"At step {step}, the gradients agree with the reference step's (the same step from the same weights, "
        f"batch and RNG in fp32, no autocast, no loss scaling), but the update of {len(departed)} of {compared} "
        f"parameters departs from the update the same optimizer makes {of}"
    )
    trial: Trial
    if stage == "intended":
        message = (
            f"{head}, already in the optimizer's own step ({comparison.optimizer}): {worst}. Your recipe is "
            f"{recipe}; its rounding alone keeps an update within a factor {RATIO:g} of the reference's."
        )
        left = comparison.at_fp32
        rounded = [d for d in departed if d.zeros >= 0.5]
        if rounded:
            message += (
                f" {len(rounded)} of them kept no change in most elements the reference moves: "
                "the update is rounded away in the weights' format."
            )
        if left is not None:
            trial = Trial.checked(
                "the same optimizer over fp32 copies of your weights and state, on your step's own gradients",
                metric="parameters whose update departs from the reference's", before=len(departed),
                after=len(left), on=f"step {step}",
            )  # fmt: skip
        else:
            trial = Trial.untried("the optimizer could not be stepped on fp32 copies")
        if left is not None and not left:
            fix = (
                "Keep the weights the optimizer steps and its state in fp32 (master weights: the optimizer over "
                "fp32 copies, cast into the model's low-precision weights after each step), or raise the "
                "learning rate where the updates are below the weights' spacing"
            )
        else:
            fix = (
                "The optimizer computes another update than its fp32 twin from the same gradients: check its "
                "hyperparameters and state (a learning rate or decay scaled twice) with `fpdoctor trace` on "
                "this step"
            )
    else:
        between = comparison.written
        seen = [w.text() for w in between[:CALLS]]
        message = (
            f"{head} in what the weights kept by the time step {step + 1} began, while the optimizer's own "
            f"step agrees ({comparison.optimizer}): {worst}."
        )
        changed = [
            f"`{n}` kept {r:.3g}x the optimizer's update (cosine {c:.3f})"
            for n, (r, c) in list(comparison.kept_vs_intended.items())[:3]
        ]
        if changed:
            message += f" What ran after the optimizer's step changed it: {'; '.join(changed)}."
        kind = comparison.written_kind
        if kind == "weights":
            message += f" Calls from your code that wrote the weights between the two steps: {'; '.join(seen)}."
        elif kind == "gradients":
            message += (
                " No call from your code wrote the weights in place; these wrote their gradients during the "
                f"optimizer's step or after it (a step hook's): {'; '.join(seen)}."
            )
        elif kind == "unknown":
            message += (
                " Calls from your code between the two steps that write tensors in place, given them as "
                f"arguments (which ones is not seen): {'; '.join(seen)}."
            )
        elif kind == "unwatched":
            message += (
                " The calls between the two steps were not watched: another profile function (a profiler's) was set."
            )
        else:
            message += (
                " No call from your code was seen writing them in place: an assignment (`p.data = ...`, "
                "`p.data[...] = ...`), a copy not written back into the model's weights, or another thread."
            )
        first = f" ({between[0].file}:{between[0].line})" if between else ""
        fix = (
            f"Remove or correct the code that changes the weights after the optimizer's step{first}: the "
            "optimizer already applies its update (and its weight decay); anything after it must keep that update"
        )
        trial = Trial.checked(
            "the optimizer's own step, without what ran after it (the intended stage, on copies)",
            metric="parameters whose update departs from the reference's", before=len(departed),
            after=len(comparison.departed("intended")), on=f"step {step}",
        )  # fmt: skip
    return catalog.make(
        "update-departs-from-reference",
        message=message,
        fix=fix,
        where={"module": None, "op": None, "phase": stage, "step": step, **here},
        evidence={
            "stage": stage,
            "step": step,
            "optimizer": comparison.optimizer,
            "departed": [
                {
                    "parameter": d.name,
                    "norm_ratio": d.ratio,
                    "cosine": d.cosine,
                    "zeros": d.zeros,
                    "update_to_weight": d.to_weight,
                    "reference_update_to_weight": d.ref_to_weight,
                }
                for d in departed[:SHOWN]
            ],
            "departed_count": len(departed),
            "compared": compared,
            **(_between(comparison) if stage == "kept" else {}),  # what ran between the steps: the kept stage's
        },
        trial=trial,
    )


def _between(comparison: Comparison) -> dict[str, Any]:
    """The kept stage's evidence of what ran between the two steps, and what it did to the update."""
    return {
        "kept_vs_intended": {n: {"norm_ratio": r, "cosine": c} for n, (r, c) in comparison.kept_vs_intended.items()},
        "written_kind": comparison.written_kind,
        "written_by": [
            {"call": w.call, "targets": w.targets, "file": w.file, "line": w.line, "count": w.count}
            for w in comparison.written[:CALLS]
        ],
    }


def _text(d: Departure) -> str:
    flushed = f", {d.zeros:.0%} of its elements unchanged where the reference's move" if d.zeros >= 0.01 else ""
    ratios = ""
    if d.to_weight is not None and d.ref_to_weight is not None:
        ratios = f", update/weight {d.to_weight:.2g} against {d.ref_to_weight:.2g}"
    return f"`{d.name}` {d.ratio:.3g}x the reference's update, cosine {d.cosine:.3f}{ratios}{flushed}"
