"""Training-recipe diagnoses: what the precision recipe around the ops gets wrong.

The trace blames an op; some failures are the recipe's, and the op is only where it shows:
  range        an Inf produced from finite fp16 inputs is fp16's range; bf16 has fp32's range
               with the same 16 bits. Said only when the evidence shows range, never as a reflex
               (0/0, log(0) and sqrt(<0) are not fixed by bf16).
  adam-eps     Adam/AdamW with fp16 parameters and eps below what fp16 can hold: eps rounds to 0
               (1e-8 is under fp16's smallest subnormal, 6e-8), so the update divides by ~0.
  no-scaler    fp16 autocast training without a GradScaler: small gradients flush to zero in
               fp16 before they reach the fp32 master weights.
  blew-up      one optimizer update multiplied the largest weight by `BLOWUP` or more: a learning
               rate too large for these gradients; the NaN/Inf that follows is its consequence.
`RecipeWatch` sees the optimizers stepped inside the traced block (a global optimizer hook,
removed on exit: nothing stays on the user's optimizer). Each diagnosis is a function of data
(records, optimizer settings, gradient counts), so the training sentinel can call it too.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.formats import FORMATS
from fpdoctor.numerics.engine.reruns import autocasts
from fpdoctor.numerics.observe import lr_schedule
from fpdoctor.numerics.trace.tracer import Record
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import DisableTorchDispatch

FP16_MAX = FORMATS["fp16"].max
# fp16's smallest subnormal is 2**-24 ~ 6e-8: anything below half of it rounds to 0. The fix
# asks for an eps whose square root term stays a normal number in fp16 (1e-4 > 6.1e-5 = 2**-14),
# the value fp16 recipes without master weights use.
FP16_SAFE_EPS = 1e-4

# Ops whose Inf from finite inputs can be a pole (x/0, log(0), rsqrt(0), 0**-1) rather than range,
# with the operand that would hold the zero: a pole is ruled out when that operand's range
# excludes zero, or when an input is already near the fp16 max (one doubling from Inf).
_POLES = {"div": 1, "div_": 1, "reciprocal": 0, "log": 0, "log2": 0, "log10": 0, "log1p": 0, "rsqrt": 0}
_POLES |= {"sqrt": 0, "pow": 0, "xlogy": 1}
_NEAR_MAX = 0.5
# A healthy update moves a weight by a small fraction of it (lr * O(1) for Adam); one that
# multiplies the largest weight a hundredfold in a step is not training, it is diverging. So are
# updates that do it over a few steps (momentum at a rate too high: x2 to x20 a step): a hundredfold
# within BLOWUP_STEPS steps, from a level the weights had held since the first step (half of it at
# least: weights grown from zero (a zero-initialised layer) are not measured from that zero), is
# faster than any training moves them.
BLOWUP = 100.0
BLOWUP_STEPS = 20
WEIGHT_STEPS = 1024  # the steps whose largest weight is kept (a 0-dim tensor each, read after the trace)


def range_cause(record: Record) -> str | None:
    """Why bf16 would help this Inf, when the evidence says the cause is fp16's range; else None.

    Evidence: an Inf produced from finite inputs in an fp16 output, by an op that overflows
    (matmul, exp, sum, a cast), or by a pole op whose input already reached half the fp16 max."""
    out = next((o for o in record.outputs if o.kind in ("+inf", "-inf")), None)
    if out is None or out.dtype != "torch.float16" or record.kind == "nan":
        return None
    if record.phase == "optimizer":
        return None  # an update that blows up is the step size or a zero denominator (eps), not range
    stats = [s or {} for s in record.input_stats or []]  # {}: written in place, values before unknown here
    if any(s.get("nonfinite") for s in stats):
        return None  # an Inf passed on, not produced here
    magnitudes = [max(abs(s["min"]), abs(s["max"])) for s in stats if s.get("min") is not None]
    largest = max((m for m in magnitudes if math.isfinite(m)), default=None)
    name = record.op.split(".")[1] if record.op.startswith("aten.") else record.op
    if name in _POLES and (largest is None or largest < _NEAR_MAX * FP16_MAX):
        operand = stats[_POLES[name]] if len(stats) > _POLES[name] else None
        if operand is None or operand.get("min") is None or operand["min"] <= 0 <= operand["max"]:
            return None  # a zero may be in there: a pole, which bf16 does not fix
    seen = f" (largest input magnitude {largest:.4g})" if largest is not None else ""
    return (
        f"this is fp16's range: {record.op} made Inf from finite fp16 inputs{seen}, past fp16's max of "
        f"{FP16_MAX:g}. bf16 has fp32's range (max 3.4e38) in the same 16 bits: "
        "torch.autocast(device, dtype=torch.bfloat16) instead of float16 (or model.to(torch.bfloat16)) removes "
        "the overflow; keeping this op in fp32 does too"
    )


@dataclass
class OptimizerSeen:
    """What a step pre-hook saw of one optimizer: its class, eps per group, parameter dtypes."""

    name: str
    eps: list[float]
    param_dtypes: dict[str, int]  # dtype -> parameter count
    with_scaler: bool  # stepped through GradScaler.step
    grads: dict[str, int] = field(default_factory=dict)  # counts over fp32 grads of fp16-run parameters
    lr: float | None = None  # the largest learning rate of its groups, at its first step
    weights: list[Any] = field(default_factory=list)  # the largest |weight| before each of its steps (0-dim)
    # the trace's record count at each of those (where the step is in the trace's step numbering),
    # and after its last step (None)
    positions: list[int | None] = field(default_factory=list)
    lrs: list[float | None] = field(default_factory=list)  # the largest learning rate at each of those steps
    dropped: int = 0  # steps past WEIGHT_STEPS, whose weights were not kept
    ref: Any = None  # a weak reference to the optimizer: its scheduler, where a finding asks (lr_schedule.py)


def _stepped_by_scaler() -> bool:
    """The pre-hook runs under an enabled GradScaler's step: it calls optimizer.step from
    `_maybe_opt_step`, or itself for optimizers that skip on the device (fused Adam/AdamW/SGD get
    `found_inf`). A disabled scaler (`enabled=False`) calls optimizer.step unscaled: no scaler."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name in ("_maybe_opt_step", "step") and code.co_filename.endswith("grad_scaler.py"):
            scaler = frame.f_locals.get("self")
            return scaler is None or bool(getattr(scaler, "is_enabled", lambda: True)())
        frame = frame.f_back  # type: ignore[assignment]
    return False


def grad_zero_counts(grads: list[torch.Tensor]) -> dict[str, int]:
    """How many gradient values are exactly 0, and how many are below fp16's smallest normal."""
    zeros = subnormal = numel = 0
    tiny = FORMATS["fp16"].smallest_normal
    # inside a trace these reductions are ours, not the user's: keep them out of its records
    with torch.no_grad(), DisableTorchDispatch():
        for grad in grads:
            g = grad.detach()
            # three kernels: non-zeros, then everything below the smallest normal (zeros too)
            zero = g.numel() - int(torch.count_nonzero(g))
            zeros += zero
            subnormal += int((g.abs() < tiny).sum()) - zero
            numel += g.numel()
    return {"zero": zeros, "subnormal": subnormal, "numel": numel}


class RecipeWatch:
    """Sees every optimizer step inside the block (context manager), keeps facts, not objects.

    `source_of(tensor)` is the trace's record of a tensor (("op"|"leaf", index), ...) or None:
    with it the parameters are known by the records that made them, so a model built inside the
    traced block (its weights made by traced init ops, then written by the optimizer) is seen
    being cast to fp16 as well as one built before the block (whose weights are leaves)."""

    def __init__(self, max_steps: int = 4, source_of: Any = None, position: Callable[[], int] | None = None) -> None:
        self.optimizers: dict[int, OptimizerSeen] = {}
        self._position = position  # the index the trace's next record gets
        self._trained: dict[int, weakref.ref[Any]] = {}  # the parameters the optimizers step, by id
        self.params: set[tuple[str, int]] = set()  # the trace's sources of the parameters stepped
        self._source_of = source_of
        self.steps = 0
        self.errors: list[str] = []
        self._max_steps = max_steps  # gradient counts of the first steps are evidence enough
        self._refs: list[weakref.ref[Any]] = []
        self._handle: Any = None
        self._thread: int | None = None
        self.elsewhere: dict[str, int] = {}  # optimizer steps taken in other threads, by thread name

    def __enter__(self) -> RecipeWatch:
        from torch.optim import optimizer as optimizer_mod

        # the trace records the ops of the thread it runs in: a step in another thread is one whose forward and
        # backward it never saw (its updates are not judged; `elsewhere` counts them by thread, for the report)
        self._thread = threading.get_ident()
        self._handle = optimizer_mod.register_optimizer_step_pre_hook(self._pre)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        # the weights after each optimizer's last step: a run whose later steps a GradScaler skipped
        # grew them last in that step, which no step after it saw
        for key, ref in enumerate(self._refs):
            optimizer, seen = ref(), self.optimizers.get(key)
            if optimizer is not None and seen is not None and not seen.dropped:
                try:
                    seen.weights.append(largest_weight([p for g in optimizer.param_groups for p in g["params"]]))
                    seen.positions.append(None)
                except Exception as error:  # the observer never kills the job
                    self.errors.append(f"optimizer weights: {type(error).__name__}: {error}")

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            name = threading.current_thread().name
            self.elsewhere[name] = self.elsewhere.get(name, 0) + 1
            return
        try:
            self._observe(optimizer)
        except Exception as exc:  # the observer never kills the job
            if len(self.errors) < 5:
                self.errors.append(f"optimizer hook: {type(exc).__name__}: {exc}")

    def _observe(self, optimizer: Any) -> None:
        self.steps += 1
        key = next((i for i, r in enumerate(self._refs) if r() is optimizer), None)
        if key is None:
            key = len(self._refs)
            self._refs.append(weakref.ref(optimizer))
        params = [p for group in optimizer.param_groups for p in group["params"]]
        dtypes: dict[str, int] = {}
        for p in params:
            dtypes[str(p.dtype)] = dtypes.get(str(p.dtype), 0) + 1
        seen = self.optimizers.get(key)
        if seen is None:
            self._trained.update((id(p), weakref.ref(p)) for p in params)
            eps = [float(g["eps"]) for g in optimizer.param_groups if isinstance(g.get("eps"), (int, float))]
            seen = self.optimizers[key] = OptimizerSeen(type(optimizer).__name__, eps, dtypes, _stepped_by_scaler())
            seen.ref = self._refs[key]
            lrs = [float(g["lr"]) for g in optimizer.param_groups if isinstance(g.get("lr"), (int, float))]
            seen.lr = max(lrs) if lrs else None
        if len(seen.weights) < WEIGHT_STEPS:
            seen.weights.append(largest_weight(params))
            seen.positions.append(self._position() if self._position is not None else None)
            lrs = [float(g["lr"]) for g in optimizer.param_groups if isinstance(g.get("lr"), (int, float))]
            seen.lrs.append(max(lrs) if lrs else None)
        else:  # the weights after the last step would be paired with those before step WEIGHT_STEPS
            seen.dropped += 1
        if self._source_of is not None and self.steps <= self._max_steps:
            # what the forward before this step cast: the parameters are unchanged since
            for p in params:
                entry = self._source_of(p)
                if entry is not None:
                    self.params.add(entry[0])
        if self.steps <= self._max_steps and not seen.with_scaler:  # the counts only matter without one
            grads = [p.grad for p in params if p.grad is not None and p.grad.dtype == torch.float32]
            counts = grad_zero_counts(grads)
            for k, v in counts.items():
                seen.grads[k] = seen.grads.get(k, 0) + v

    def trains(self, t: torch.Tensor) -> bool:
        """Whether an optimizer seen in the block steps `t` (its parameters at its first step)."""
        ref = self._trained.get(id(t))
        return ref is not None and ref() is t

    def findings(self, records: list[Record], step_of: Callable[[int], int | None] | None = None) -> list[Finding]:
        """`step_of(record index)`: the trace's optimizer step a record belongs to, which counts the
        steps a GradScaler skipped (the optimizer's own count does not)."""
        found: list[Finding] = []
        for seen in self.optimizers.values():
            f = adam_eps_finding(seen)
            if f is not None:
                found.append(f)
        for seen in self.optimizers.values():
            f = blowup_finding(seen, step_of)
            if f is not None:
                found.append(f)
        scaler = no_scaler_finding(records, list(self.optimizers.values()), frozenset(self.params))
        if scaler is not None:
            found.append(scaler)
        return found


def largest_weight(params: list[torch.Tensor]) -> Any:
    """max |weight| over `params`, a 0-dim tensor on their device, read once after the trace (no
    host sync per step); kept out of the trace's records."""
    floats = [p.detach() for p in params if p.is_floating_point() and p.numel()]
    if not floats:
        return None
    with torch.no_grad(), DisableTorchDispatch():
        return torch.stack([t.abs().amax().float().to(floats[0].device) for t in floats]).amax()


def blowup_finding(seen: OptimizerSeen, step_of: Callable[[int], int | None] | None = None) -> Finding | None:
    """The first update that multiplied the largest weight by BLOWUP or more (before one step and
    the next of the same optimizer), or that brought its growth over the last BLOWUP_STEPS steps to
    BLOWUP, with its learning rate; steps as the trace counts them where `step_of` maps them."""
    found = _blowup(seen.weights)
    if found is None:
        return None
    start, end, before, after = found
    # the updates between value `start` and value `end` are the optimizer's steps start + 1 .. end
    first, step = start + 1, end
    if step_of is not None:
        at = [None if p is None else step_of(p) for p in seen.positions[start:end]]
        if at and at[0] is not None and at[-1] is not None:
            first, step = at[0], at[-1]
    grown = after / before if math.isfinite(after) else math.inf
    # the rate of the updates that grew them (a schedule or warm-up changes it), else the first step's
    rates = [r for r in seen.lrs[start:end] if r is not None]
    rate = max(rates) if rates else seen.lr
    lr = f" (lr={rate:g})" if rate is not None else ""
    size = (
        f"made the largest weight {_said(after)} ({before:.3g} -> {_said(after)})"
        if not math.isfinite(after)
        else f"multiplied the largest weight by {grown:.3g} ({before:.3g} -> {after:.3g})"
    )
    if end - start == 1:
        what = f"{seen.name}'s update{lr} at step {step} {size} in one step."
    else:
        what = (
            f"{seen.name}'s updates{lr} of steps {first} to {step} {size} in {end - start} updates: the weights "
            "diverge, step after step."
        )
    # the scheduler that raised the rate, where one did: the rate to cap is the schedule's
    schedule = lr_schedule.find(seen.ref() if seen.ref is not None else None, rate)
    lower = (  # by the growth factor at least, rounded up to a power of ten
        f"{10 ** math.ceil(math.log10(grown)):,}x lower (the weights grew {grown:.3g}x: by that factor at least)"
        if math.isfinite(grown) and grown > 1
        else "10x-100x lower"
    )
    fix = (
        f"lower the learning rate: start {lower}, with warmup, and clip the gradients "
        "(torch.nn.utils.clip_grad_norm_(params, 1.0)) before the step"
    )
    if schedule is not None and rate is not None:
        fix = (
            schedule.fix(rate / 10, " (10x below the rate at which the weights blew up)") + ", and clip the gradients "
            "(torch.nn.utils.clip_grad_norm_(params, 1.0)) before the step"
        )
    return catalog.make(
        "update-blew-up",
        message=(
            what + (schedule.text() if schedule is not None else "") + " The "
            "next forward and backward run on those weights: any NaN/Inf reported after this is their "
            "consequence, not a cause of its own."
        ),
        where={"module": None, "phase": "optimizer"},
        evidence={
            "optimizer": f"torch.optim.{seen.name}",
            "optimizer_step": step,
            "from_step": first,
            "lr": rate,
            "largest_weight_before": before,
            "largest_weight_after": after,
            "growth": grown if math.isfinite(grown) else None,
        },
        fix=fix,
        trial=Trial.untried(
            "the trace saw this update once and cannot repeat the step at another rate (fpdoctor.Sentinel and "
            "`fpdoctor watch` try a lower rate from the step that climbed)"
        ),
    )
    return None


def _blowup(weights: list[Any]) -> tuple[int, int, float, float] | None:
    """(the step before the growth, the step that completed it, the largest weight before, after) of
    the first update that multiplied the largest weight by BLOWUP (before step 1 is index 0): in one
    step, or with the BLOWUP_STEPS - 1 updates before it from a level of half the first's at least."""
    values = [None if w is None else float(w) for w in weights]
    first = next((v for v in values if v is not None), None)
    for step in range(1, len(values)):
        after, prior = values[step], values[step - 1]
        if after is None:
            continue
        if prior is not None and 0 < prior < math.inf and not after / prior < BLOWUP:  # NaN counts
            return step - 1, step, prior, after
        window = [(v, i) for i in range(max(0, step - BLOWUP_STEPS), step) if (v := values[i]) is not None]
        if first is None or not first > 0 or not window:
            continue
        low = min(v for v, _ in window)
        if low >= 0.5 * first and after / low >= BLOWUP:
            # where the growth started: the last value within a quarter of the window's low
            before, start = next((v, i) for v, i in reversed(window) if v <= 1.25 * low)
            return start, step, before, after
    return None


def adam_eps_finding(seen: OptimizerSeen) -> Finding | None:
    """Adam-family eps that fp16 parameters (and so fp16 optimizer state) cannot hold."""
    half = seen.param_dtypes.get("torch.float16", 0)
    if not half or "Adam" not in seen.name or not seen.eps:
        return None
    eps = min(seen.eps)
    flush = FORMATS["fp16"].flush_threshold
    if eps >= FP16_SAFE_EPS:
        return None
    as_fp16 = float(torch.tensor(eps, dtype=torch.float16))
    return catalog.make(
        "fp16-adam-eps",
        message=(
            f"{seen.name}(eps={eps:g}) steps {half} fp16 parameter(s): its state is fp16 too, and eps "
            + (
                f"rounds to {as_fp16:g} in fp16 (below half its smallest subnormal, {flush:.3g})"
                if as_fp16 == 0
                else f"is {as_fp16:.3g} in fp16, a subnormal with almost no precision"
            )
            + ". Where the second moment is small, the update divides by ~0 and jumps to Inf or huge values."
        ),
        # no single aten op is at fault (where.op names aten overloads): the optimizer is evidence
        where={"module": None, "phase": "optimizer"},
        evidence={
            "optimizer": f"torch.optim.{seen.name}",
            "kind": "underflow",
            "count": half,
            "numel": sum(seen.param_dtypes.values()),
            "dtype": "torch.float16",
            "eps": eps,
            "eps_in_fp16": as_fp16,
        },
        fix=(
            f"torch.optim.{seen.name}(params, eps={FP16_SAFE_EPS:g})   # pure fp16 parameters\n"
            "# better: keep the parameters fp32 and run the forward under "
            "torch.autocast(device, dtype=torch.float16) with a GradScaler"
        ),
    )


def _autocast_fp16_params(records: list[Record], params: frozenset[tuple[str, int]] = frozenset()) -> int:
    """Forward casts of parameters to fp16: autocast's copies of the weights it runs in fp16. A
    parameter is a leaf (made before the trace), or the record that made the value an optimizer
    stepped (`params`: a model built inside the trace, its weights made by traced ops)."""
    return sum(
        1
        for r in records
        if r.phase == "forward"
        and r.op == "aten._to_copy.default"
        and r.outputs
        and r.outputs[0].dtype == "torch.float16"
        and r.inputs[:1]
        and (r.inputs[0][0] == "leaf" or r.inputs[0] in params)
        and autocasts(r)  # a line that writes the cast (model.half() for an evaluation, .to(fp16)) is the code's
    )


def no_scaler_finding(
    records: list[Record], optimizers: list[OptimizerSeen], params: frozenset[tuple[str, int]] = frozenset()
) -> Finding | None:
    """fp16 autocast forward, backward ran, an optimizer stepped, and no GradScaler stepped it."""
    if not optimizers or any(o.with_scaler for o in optimizers):
        return None
    if not any(r.phase == "backward" for r in records):
        return None
    casts = _autocast_fp16_params(records, params)
    if not casts or any(o.param_dtypes.get("torch.float16") for o in optimizers):
        return None  # pure fp16 parameters are the adam-eps / master-weights story
    grads: dict[str, int] = {}
    for o in optimizers:
        for k, v in o.grads.items():
            grads[k] = grads.get(k, 0) + v
    numel = grads.get("numel", 0)
    lost = grads.get("zero", 0) + grads.get("subnormal", 0)
    share = lost / numel if numel else 0.0
    measured = (
        f" In the steps seen, {share:.1%} of the gradient values were 0 or below fp16's smallest normal "
        f"({FORMATS['fp16'].smallest_normal:.3g}), where fp16 keeps few or no bits."
        if numel
        else ""
    )
    if numel and any(r.phase == "forward" and r.kind for r in records):
        # an Inf the forward made and an op zeroed (rsqrt(Inf) = 0) zeroes the gradients behind it too
        measured += (
            " Those steps' forwards also made NaN/Inf (the finding about it comes first): the zeros include what "
            "that wiped out; fix it first, then judge the underflow again."
        )
    return catalog.make(
        "fp16-without-grad-scaler",
        message=(
            f"The forward ran under fp16 autocast ({casts} cast(s) of fp32 parameters to fp16), backward ran and "
            "the optimizer stepped without a GradScaler: gradients smaller than 6e-8 flush to zero in fp16." + measured
        ),
        # the gradients flush in backward; no single aten op is at fault
        where={"module": None, "phase": "backward"},
        evidence={
            "kind": "underflow",
            "count": lost,
            "numel": numel,
            "dtype": "torch.float16",
            "share": share,
            "zero": grads.get("zero", 0),
            "subnormal": grads.get("subnormal", 0),
        },
        fix=(
            "scaler = torch.amp.GradScaler(device)\n"
            "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()\n"
            "# or autocast to torch.bfloat16, which has fp32's range and needs no scaler"
        ),
    )


def _said(value: float) -> str:
    """'NaN', 'Inf' or '-Inf', as a weight the update made."""
    return "NaN" if math.isnan(value) else "Inf" if value > 0 else "-Inf"
