"""The sentinel's semantics at the points where a framework's training loop lets a callback look.

A framework runs forward, backward and the optimizer step itself. `StepWatch` is told what happens
at the points its callbacks see - a micro-batch starts (its inputs, the RNG state), its loss was
computed, the gradients are complete - and decides each optimizer step before the framework takes
it, as `fpdoctor.Sentinel` does for a loop of the user's own:

- one fused finite check of the gradients on the device; a few numbers read back once per
  optimizer step (that flag, each micro-batch's loss, the loss scale), the losses judged on the host;
- a non-finite step is skipped: every gradient is set to None before `optimizer.step()`, which
  torch's optimizers (foreach and fused alike) then leave untouched, state and weights. Under a
  GradScaler an overflowing step is the scaler's to skip (it found the Inf itself): counted as an
  AMP skip, not reported as a fault, never touched;
- a bad step is replayed under `trace` from its own inputs, RNG states, weights and buffers, its
  gradients put back afterwards, and classified with the sentinel's verdicts;
- under DDP a communication hook notes each rank's local gradient before the all-reduce; the
  flags are agreed across ranks, so every rank skips the same steps and names the same rank.

Findings are the sentinel's own builders (`sentinel_findings`): the same names and evidence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from fpdoctor.numerics import amp, distributed
from fpdoctor.numerics import sentinel_findings as findings
from fpdoctor.numerics.control import ControlResult, run_control, wants_control
from fpdoctor.numerics.gradcheck import FlagRead, bad_parameters, grads_of, kind_of, nonfinite_flag, tensor_kind
from fpdoctor.numerics.replay import MicroBatch, ReplayResult, replay
from fpdoctor.numerics.sentinel import SPIKE_MIN_HISTORY, SPIKE_RATIO, SPIKE_SIGMAS, SPIKE_WINDOW, StepOutcome
from fpdoctor.preserve import BufferSnapshot, RngState, preserved
from fpdoctor.report.model import Finding

# the numbers read back per optimizer step, in this order, then each micro-batch's loss
_LOSS, _GRAD, _SCALE, _DIVISOR, _LOSSES = range(5)

SPREAD_NOTE = (
    " The gradients were read after a gradient-norm computation that multiplies every gradient by the "
    "non-finite norm, so every parameter shows NaN here: the replay names the op that produced it."
)


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def guarded(doing: str) -> Callable[[_Hook], _Hook]:
    """A callback method that never raises into the framework's loop: a failure becomes the watch's
    `sentinel-error` finding, or before there is a watch, a line through the callback's logger."""

    def wrap(method: _Hook) -> _Hook:
        @functools.wraps(method)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                watch = getattr(self, "_watch", None)
                if isinstance(watch, StepWatch):
                    watch.error(doing, exc)
                else:
                    self._logger().error(f"fpdoctor: {doing} failed ({type(exc).__name__}: {exc}); training goes on")
                return None

        return hook  # type: ignore[return-value]

    return wrap


@dataclass
class _Micro:
    """One micro-batch: what a replay needs (references, not copies) and its loss on the device."""

    rng: RngState
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] | None = None
    loss: torch.Tensor | None = None  # float32, 0-d, on the device: as the framework computed it


@dataclass
class Check:
    """One optimizer step's flags, read on the host, and what a bad step needs for its report."""

    step: int
    bad_loss: bool  # agreed across ranks
    bad_grad: bool  # agreed across ranks
    local_loss: bool  # this rank's own loss
    loss_value: float
    scale: float  # the GradScaler's scale for this step (nan without one)
    micro: int | None = None  # the first micro-batch whose loss was bad, from 1
    parameters: list[tuple[str, str]] = field(default_factory=list)
    faults: list[dict[str, Any]] | None = None
    spread: bool = False  # read after a gradient-norm computation that spread a NaN to every gradient

    @property
    def finite(self) -> bool:
        return not (self.bad_loss or self.bad_grad)


class StepWatch:
    """The sentinel's state for one training run, fed by a framework's callback.

    `step_fn(*args, **kwargs)` runs one micro-batch's forward and backward as the framework does
    (autocast, loss scaling) and returns the loss: the replay calls it with each micro-batch's
    recorded inputs. Every public method catches its own failures (a `sentinel-error` finding):
    the observer never kills the job.
    """

    def __init__(
        self,
        model: nn.Module,
        step_fn: Callable[..., Any],
        *,
        replay: bool = True,
        scaler: Any = None,
        ddp: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        replay_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        gpu_health: bool = True,
    ) -> None:
        self.model = model
        self.replay = replay
        self.scaler = scaler if amp.enabled(scaler) else None
        self.steps = 0
        self.micro_batches = 0
        self.skipped = 0
        self.findings: list[Finding] = []
        self.history: list[StepOutcome] = []
        self.last_good_step: int | None = None
        self.not_replayed: dict[int, str] = {}
        self.sum_losses = False  # a step's loss is the sum of its micro-batches' (else their mean)
        self.cannot_replay_any: str | None = None  # why no step of this run can be replayed
        self._step_fn = step_fn
        self._replay_context = replay_context
        self._params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._zero = torch.zeros((), device=self._device)
        self._one = torch.ones((), device=self._device)
        self._nan = torch.full((), float("nan"), device=self._device)
        self._loss_scale: torch.Tensor | None = None  # what the window's losses were multiplied by
        self._loss_times = 1.0  # and divided by
        self._buffers = BufferSnapshot(model)
        self._micros: list[_Micro] = []
        self._why_not: str | None = None  # why the current window cannot be replayed
        self._checked: Check | None = None
        self._errors: set[tuple[str, str]] = set()
        self._amp = amp.ScaleWatch()
        self._weights_bad = False
        self._here: dict[str, Any] = {}
        self._ddp = ddp
        self._watch: distributed.BucketWatch | None = None
        self._distributed = False
        try:
            self._distributed = distributed.active()
            if ddp is not None:
                self._watch = distributed.BucketWatch.install(ddp)
            if self._distributed:
                self._here = findings.place(distributed.describe(self._device))
        except Exception as exc:
            self._error("setting up under torch.distributed", exc)
        # on a GPU, its health now: a fault that does not reproduce says what changed on it since (Xid, ECC)
        self._health: Any = None
        if gpu_health and self._device.type == "cuda":
            try:
                from fpdoctor.health import watch

                uuid = distributed.describe(self._device).get("uuid")
                self._health = watch.start(uuid) if uuid else None
            except Exception as exc:
                self._error("reading the GPU's health", exc)
        try:
            eps = findings.optimizer_eps_finding(optimizer, with_scaler=self.scaler is not None, here=self._here)
            if eps is not None:
                self.findings.append(eps)
        except Exception as exc:
            self._error("looking at the optimizer's settings", exc)

    @property
    def attributes_ranks(self) -> bool:
        """True when a DDP hook sees each rank's gradients before the all-reduce."""
        return self._watch is not None

    @property
    def amp_watch(self) -> amp.ScaleWatch:
        """The GradScaler's skips and scale, as seen by the checks."""
        return self._amp

    @property
    def checked(self) -> bool:
        """True when this window's flags were read already (before the optimizer hook)."""
        return self._checked is not None

    # -- what the callback reports -------------------------------------------------------------
    def start_micro(self) -> None:
        """A micro-batch starts, before its forward: its RNG state; at a window's first, its buffers."""
        try:
            if not self._micros:
                self._buffers.capture()
                if self._watch is not None:
                    self._watch.begin()
            self._micros.append(_Micro(RngState.capture()))
        except Exception as exc:
            self._error("preparing the step", exc)

    def has_inputs(self) -> bool:
        return bool(self._micros) and self._micros[-1].args is not None

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The current micro-batch's inputs, as the replay will pass them to `step_fn`."""
        if self._micros:
            self._micros[-1].args, self._micros[-1].kwargs = tuple(args), dict(kwargs)

    def cannot_replay(self, why: str) -> None:
        """The current window cannot be replayed faithfully; a bad step says why instead of a verdict."""
        self._why_not = self._why_not or why

    def loss(self, loss: Any, *, scale: torch.Tensor | None = None, times: float = 1.0) -> None:
        """The current micro-batch's loss, as the framework computed it: divided by `scale` (a loss
        scaled for backward) and multiplied by `times` (a loss divided for accumulation) for the
        loss curve. Kept by reference: the few ops that judge it run once per step, in `check`."""
        if not self._micros:
            return
        micro = self._micros[-1]
        try:
            t = loss.detach() if isinstance(loss, torch.Tensor) else torch.as_tensor(loss)
            if t.numel() != 1:  # its mean, or NaN when an element is NaN/Inf but the mean is not
                with torch.no_grad():
                    mean = t.float().mean()
                    t = torch.where(torch.isfinite(t).all() | ~torch.isfinite(mean), mean, self._nan)
            if t.dim() != 0:
                t = t.reshape(())
            if t.dtype != torch.float32 or t.device != self._device:
                t = t.to(self._device, torch.float32)  # float32 holds every fp16/bf16 value, and NaN/Inf
            if micro.loss is not None:  # a second loss in one micro-batch: either bad makes it bad
                t = micro.loss + t
            micro.loss = t
            self._loss_scale, self._loss_times = scale, times
        except Exception as exc:
            self._error("reading the loss", exc)

    def check(self, step: int, *, spread: bool = False) -> None:
        """Read the window's flags (the one host read of an optimizer step); on a bad step, note
        which parameters and buckets held it while the gradients still show it."""
        if self._checked is not None:
            return
        try:
            self._checked = self._read(step, spread)
        except Exception as exc:
            self._error("checking the step", exc, step)

    def decide(self, step: int, params: list[torch.Tensor] | None = None, *, spread: bool = False) -> Check | None:
        """Decide the optimizer step about to be taken. Finite: nothing. Non-finite: reported,
        replayed and skipped (the gradients of `params`, default every trainable parameter, set
        to None) - unless a GradScaler skips it itself. `spread`: the gradients, if not read yet,
        are read after a gradient-norm computation. The check's result, None if it failed."""
        skip = False
        checked: Check | None = None
        try:
            self.check(step, spread=spread)
            checked = self._checked
            if checked is not None:
                skip = self._decide(checked)
        except Exception as exc:
            self._error("deciding the step", exc, step)
        finally:
            if checked is None:  # counted whether or not the check worked; the step goes on unguarded
                self.steps += 1
                self.micro_batches += len(self._micros)
            self._micros, self._checked, self._why_not = [], None, None
            if skip:  # whatever failed after the verdict, a bad step is not applied
                for p in params if params is not None else self._params:
                    p.grad = None
        return checked

    # -- the decision ----------------------------------------------------------------------------
    def _read(self, step: int, spread: bool) -> Check:
        micros = self._micros
        seen = [(i, m.loss) for i, m in enumerate(micros, start=1) if m.loss is not None]
        with torch.no_grad():
            grad = nonfinite_flag(grads_of(self._params), self._device)
            # the losses themselves come back and are judged on the host: NaN/Inf survive the trip
            raw = torch.stack([loss for _, loss in seen]) if seen else self._zero.new_empty(0)
            scale = amp.scale_tensor(self.scaler, self._device) if self.scaler is not None else self._nan
            divisor = self._loss_scale.reshape(()).float() if self._loss_scale is not None else self._one
            head = [grad, grad, scale, divisor]
            if self._distributed:  # every rank skips, or none: replicas stay equal
                local = torch.isfinite(raw).all().logical_not().float()
                head[:2] = distributed.all_max(torch.stack([local, grad])).unbind()
            values = FlagRead(torch.cat([torch.stack(head), raw])).values()
        losses = values[_LOSSES:]
        curve = [v / values[_DIVISOR] * self._loss_times for v in losses]
        local_bad = [i for (i, _), v in zip(seen, losses, strict=True) if not math.isfinite(v)]
        loss_value = (sum(curve) if self.sum_losses else sum(curve) / len(curve)) if curve else math.nan
        checked = Check(
            step,
            bad_loss=values[_LOSS] > 0 if self._distributed else bool(local_bad),
            bad_grad=values[_GRAD] > 0,
            local_loss=bool(local_bad),
            loss_value=loss_value,
            scale=values[_SCALE],
            spread=spread,
        )
        if not checked.finite:  # host reads from here on: bad steps only
            checked.micro = local_bad[0] if local_bad else None
            checked.faults = self._watch.local_faults() if self._watch is not None else None
            checked.parameters = [] if self._watch is not None else self._bad_parameters()
        return checked

    def _decide(self, c: Check) -> bool:
        """The sentinel's verdict for the step; True when the step must be skipped by us."""
        window = self._micros
        self.steps += 1
        self.micro_batches += len(window)
        outcome = StepOutcome(c.step, c.loss_value, finite=c.finite, skipped=False)
        outcome.scale = c.scale if self.scaler is not None else None  # for the timeline
        self.history.append(outcome)
        scaler = self.scaler
        if scaler is not None and c.bad_grad and not c.bad_loss:  # an overflow the scaler skips: AMP's business
            outcome.skipped, outcome.verdict = True, "amp-skip"
            next_scale = c.scale * float(scaler.get_backoff_factor())  # what its update() makes of an overflow
            if self._amp.observe(True, next_scale):
                self._collapse(c, window, next_scale)
            self._spike(c.step, c.loss_value)
            return False
        if scaler is not None and not c.bad_grad:
            self._amp.observe(False, c.scale)
        elif scaler is not None:
            self._amp.scale = c.scale
        if c.finite:
            self.last_good_step = c.step
            self._spike(c.step, c.loss_value)
            return False
        outcome.skipped = True
        self.skipped += 1
        # an Inf gradient under a GradScaler: its step() finds it and skips; ours would hide it from the scaler
        skip = not (scaler is not None and c.bad_grad)
        try:
            self._buffers.restore()  # the bad forward's buffer writes (BatchNorm statistics) undone
            if self._weights_bad or self._weights_went_bad(c.step):  # said once; no replay can change it
                return skip
            faulty, kind = self._attribute(c, len(window))
            if self.replay:
                outcome.verdict = self._replay_or_say_why(c, window, kind, faulty)
        except Exception as exc:
            self._error("reporting the step", exc, c.step)
        return skip

    def _replay_or_say_why(self, c: Check, window: list[_Micro], kind: str | None, faulty: bool) -> str:
        why = self.cannot_replay_any or self._why_not
        if why is None and any(m.args is None for m in window):
            why = "the inputs of a micro-batch were not seen"
        if self._distributed:  # every rank replays, or none: a replay issues collectives
            flag = torch.tensor([float(why is not None)], device=self._device)
            if distributed.all_max(flag).item() and why is None:
                why = "another rank could not replay its part of the step"
        if why is None:
            return self._replay(c, window, kind, faulty)
        self.not_replayed[c.step] = why
        self._annotate(c.step, f" Not replayed: {why}.", {"replay": f"not replayed: {why}"})
        return "not-replayed"

    def _annotate(self, step: int, text: str, evidence: dict[str, Any]) -> None:
        """Add to this step's nonfinite-loss/-gradient findings what the callback knows besides."""
        for i, f in enumerate(self.findings):
            if f.name in ("nonfinite-loss", "nonfinite-gradient") and f.evidence.get("step") == step:
                self.findings[i] = dataclasses.replace(f, message=f.message + text, evidence={**f.evidence, **evidence})

    def _attribute(self, c: Check, window: int) -> tuple[bool, str | None]:
        """Report the bad step; whether this rank holds (or may hold) the fault, and its kind."""
        step = c.step
        me = distributed.describe(self._device)
        local = {
            **me,
            "loss_bad": c.local_loss,
            "loss_kind": kind_of(c.loss_value) if c.local_loss and not math.isfinite(c.loss_value) else None,
            "micro_batch": c.micro,
            "faults": c.faults,
            "parameters": c.parameters,
        }
        kind = findings.step_kind(local)
        ranks = distributed.agree(local) if self._distributed else [local]
        attributed = [r for r in ranks if r.get("loss_bad") or r.get("faults")]
        for r in attributed or ([] if self._distributed else ranks):
            finding = findings.rank_finding(
                step, r, micro_batches=window > 1, scaled=self.scaler is not None, numel=len(self._params)
            )
            if c.spread and finding.name == "nonfinite-gradient" and not r.get("faults"):
                finding = dataclasses.replace(
                    finding, message=finding.message + SPREAD_NOTE, evidence={**finding.evidence, "spread": True}
                )
            self.findings.append(finding)
        if self._distributed and not attributed:
            if kind is None:
                kind = findings.step_kind({"parameters": self._bad_parameters()})
            views = "FSDP, a communication hook of your own, or a DDP wrapper the callback could not find"
            self.findings.append(
                findings.unattributed_finding(step, kind, len(self._params), views=views, here=self._here)
            )
            return True, kind
        if not self._distributed:
            return True, kind
        return any(r.get("rank") == me.get("rank") for r in attributed), kind

    def _replay(self, c: Check, window: list[_Micro], kind: str | None, faulty: bool) -> str:
        """Replay the window (every rank, under torch.distributed); gradients put back after."""
        micro_batches = [MicroBatch(m.rng, m.args or (), m.kwargs or {}) for m in window]
        saved = [(p, p.grad) for p in self._params]
        control: ControlResult | None = None
        try:
            result = replay(
                self.model, self._params, self._step_fn, micro_batches, self._contexts(), whole=self._distributed
            )
            if faulty and not self._distributed and result.verdict == "deterministic-nonfinite":
                culprit = result.culprit
                dtype = (culprit.evidence.get("dtype") if culprit else None) or result.evidence.get("dtype")
                if wants_control(dtype, self.model):
                    control = run_control(self.model, self._params, self._step_fn, micro_batches, self._contexts())
        finally:
            for p, g in saved:
                p.grad = g
        mine = self._verdict_findings(c.step, result, kind, len(window), control) if faulty else []
        if not self._distributed:
            self.findings.extend(mine)
            return result.verdict
        everyone = distributed.agree({"verdict": result.verdict if faulty else None, "findings": mine})
        for entry in everyone:
            self.findings.extend(entry.get("findings") or [])
        verdicts = [e.get("verdict") for e in everyone if e.get("verdict") is not None]
        return result.verdict if faulty else str(verdicts[0]) if verdicts else "not-replayed"

    def _contexts(self) -> list[contextlib.AbstractContextManager[Any]]:
        contexts: list[contextlib.AbstractContextManager[Any]] = [
            distributed.local_replay(self._ddp if self._ddp is not None else self.model)
        ]
        if self._replay_context is not None:
            contexts.append(self._replay_context())
        return contexts

    def _verdict_findings(
        self, step: int, result: ReplayResult, kind: str | None, window: int, control: ControlResult | None = None
    ) -> list[Finding]:
        if result.verdict == "replay-failed":
            self._error("replaying the step", RuntimeError(result.error or "unknown"), step=step)
            return []
        me = distributed.describe(self._device)
        health = None
        if result.verdict == "transient-fault-suspected" and self._health is not None:
            from fpdoctor.health import watch

            health = watch.since(self._health)
        return findings.verdict_findings(
            step, result, me, micro_batches=window > 1, kind=kind, control=control, health=health
        )

    def _collapse(self, c: Check, window: list[_Micro], next_scale: float) -> None:
        self.findings.append(
            findings.collapse_finding(c.step, self._amp, self.steps, c.scale, next_scale, here=self._here)
        )
        replayable = (
            self.cannot_replay_any is None and self._why_not is None and all(m.args is not None for m in window)
        )
        if not (self.replay and replayable and not self._distributed):
            return
        micro_batches = [MicroBatch(m.rng, m.args or (), m.kwargs or {}) for m in window]
        saved = [(p, p.grad) for p in self._params]
        try:  # name the op that overflows, once per collapse, from the step's own buffers
            with preserved(self.model):
                self._buffers.restore()
                result = replay(self.model, self._params, self._step_fn, micro_batches, self._contexts())
        finally:
            for p, g in saved:
                p.grad = g
        self.findings.extend(self._verdict_findings(c.step, result, "+inf", len(window)))

    def _weights_went_bad(self, step: int) -> bool:
        """Are the parameters themselves non-finite (an earlier update put NaN/Inf in them)? Then
        one finding names the last applied step, and no step is replayed after."""
        bad = [
            (name, kind, p)
            for name, p in self.model.named_parameters()
            if (kind := tensor_kind(p.detach())) is not None
        ]
        anywhere = bool(bad)
        if self._distributed:
            flag = torch.tensor([float(anywhere)], device=self._device)
            anywhere = bool(distributed.all_max(flag).item())
        if not anywhere:
            return False
        self._weights_bad = True
        if bad:
            self.findings.append(
                findings.weights_finding(step, self.last_good_step, bad, len(self._params), here=self._here)
            )
        return True

    def _bad_parameters(self) -> list[tuple[str, str]]:
        return bad_parameters(self.model)

    def _spike(self, step: int, loss_value: float) -> None:
        if not math.isfinite(loss_value):  # a NaN in the history would switch spike detection off
            return
        history = self._losses
        if len(history) >= SPIKE_MIN_HISTORY:
            # floats, not statistics.pstdev's exact fractions: 32 values, every step, within 1e-15
            mean = math.fsum(history) / len(history)
            spread = math.sqrt(math.fsum((v - mean) ** 2 for v in history) / len(history))
            if loss_value > mean + SPIKE_SIGMAS * spread and loss_value > SPIKE_RATIO * abs(mean):
                self.findings.append(
                    findings.spike_finding(step, loss_value, mean, spread, len(history), here=self._here)
                )
        history.append(loss_value)

    def _error(self, doing: str, exc: BaseException, step: int | None = None) -> None:
        """A failure of our own: a finding once per distinct error, never raised."""
        text = f"{type(exc).__name__}: {exc}"
        if (doing, text) in self._errors:
            return
        self._errors.add((doing, text))
        self.findings.append(
            findings.error_finding(doing, text, step if step is not None else self.steps, here=self._here)
        )

    def error(self, doing: str, exc: BaseException) -> None:
        """A failure in the callback around this watch: reported like the watch's own."""
        self._error(doing, exc)
