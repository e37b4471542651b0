"""The sentinel's semantics at the points where a framework's training loop lets a callback look.

A framework runs forward, backward and the optimizer step itself. `StepWatch` is told what happens
at the points its callbacks see - a micro-batch starts (its inputs, the RNG state), its loss was
computed, the gradients are complete - reads the step's flags once, and hands them to the step
judge (`fpdoctor.numerics.training.judge`), which decides each optimizer step before the framework
takes it, as it does for `fpdoctor.Sentinel`:

- one fused finite check of the gradients on the device; a few numbers read back once per
  optimizer step (that flag, each micro-batch's loss, the loss scale), the losses judged on the host;
- a non-finite step is skipped: every gradient is set to None before `optimizer.step()`, which
  torch's optimizers (foreach and fused alike) then leave untouched, state and weights. Under a
  GradScaler an overflowing step is the scaler's to skip (it found the Inf itself): counted as an
  AMP skip, not reported as a fault, never touched;
- a bad step is replayed under `trace` from its own inputs, RNG states, weights and buffers, under
  the framework's own autocast and loss scale, and classified with the sentinel's verdicts;
- under DDP a communication hook notes each rank's local gradient before the all-reduce; the
  flags are agreed across ranks, so every rank skips the same steps and names the same rank.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from fpdoctor.integrations._outputs import KeptGradients
from fpdoctor.numerics.observe import amp, dynamo
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.observe.gradcheck import FlagRead, grads_of, nonfinite_flag
from fpdoctor.numerics.observe.loader import LoaderBatches, rows_kept, set_step_rows
from fpdoctor.numerics.training import distributed, reference
from fpdoctor.numerics.training.coarse_output import ModelOutputs
from fpdoctor.numerics.training.judge import JudgedSteps, StepFacts, StepJudge
from fpdoctor.numerics.training.live import Live
from fpdoctor.numerics.updates.measure import UpdateProbe, UpdateStats
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Report

# the numbers read back per optimizer step, in this order, then each micro-batch's loss
_LOSS, _GRAD, _SCALE, _DIVISOR, _LOSSES = range(5)
# DataLoader batches kept (shapes, a few values, dataset indices) to find a replayed step's among: a
# framework fetches one or two ahead, a gradient-accumulation window's micro-batches before its first
RECENT_BATCHES = 64


# The watches of the framework callbacks alive in this process: `fpdoctor watch` leaves the
# optimizers of their models to them (one judge per step, never two) and adds their findings.
ACTIVE: weakref.WeakSet[StepWatch] = weakref.WeakSet()

_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def guarded(doing: str) -> Callable[[_Hook], _Hook]:
    """A callback method that never raises into the framework's loop: a failure becomes the watch's
    `sentinel-error` finding, or before there is a watch, a line through the callback's logger."""

    def wrap(method: _Hook) -> _Hook:
        @functools.wraps(method)
        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            if dynamo.compiling():  # a model hook traced by Dynamo: inlined as nothing (numerics/observe/dynamo.py)
                return None
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
    seen: tuple[list[dict[str, Any]] | None, list[tuple[str, str]]] | None = None  # bad gradients, where
    spread: bool = False  # read after a gradient-norm computation that spread a NaN to every gradient

    @property
    def finite(self) -> bool:
        return not (self.bad_loss or self.bad_grad)


class StepWatch(JudgedSteps):
    """What a framework's callback sees of one training run, collected for the step judge.

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
        reference_every: int = reference.EVERY,
        scaler: Any = None,
        ddp: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        replay_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        gpu_health: bool = True,
        live: Live | None = None,
        loader_rows: bool = False,
        hook_outputs: bool = False,
        framework: str | None = None,
    ) -> None:
        self.model = model
        self.scaler = scaler if amp.enabled(scaler) else None
        self.sum_losses = False  # a step's loss is the sum of its micro-batches' (else their mean)
        self.cannot_replay_any: str | None = None  # why no step of this run can be replayed
        self.file_error: str | None = None  # why the report file could not be written while training ran
        self._judge = StepJudge(
            model,
            hooked=ddp,
            optimizer=optimizer,
            replay=replay,
            with_scaler=self.scaler is not None,
            views="FSDP, a communication hook of your own, or a DDP wrapper the callback could not find",
            gpu_health=gpu_health,
            live=live,
        )
        self._judge.reference_every = reference_every  # steps 1, 1 + N, ...: the backward against an fp32 step
        self._judge.framework = framework  # the fixes in the framework's own terms where it steps the optimizer
        # the gradients the callback sees are those the optimizer takes (the framework clips before its
        # hook, or not at all): the reference step's update stages are compared too, on those gradients
        self.final_gradients = False
        self._step_fn = step_fn
        self._replay_context = replay_context
        # `loader_rows`: the DataLoader's batches followed, so that a replayed step's bad rows are named
        # as the dataset items of its own batch (observe/loader.py), not of the one fetched after it
        self._loader: LoaderBatches | None = None
        if loader_rows:
            try:
                self._loader = LoaderBatches(recent=RECENT_BATCHES).__enter__()
            except Exception as exc:
                self._error("following the DataLoader's batches", exc)
        # `hook_outputs`: a callback that runs the user's whole step sees the loss alone; the model's outputs,
        # on the steps their format is checked (coarse_output.py), come from hooks put on for that step
        self._outputs = ModelOutputs(model) if hook_outputs and not self._judge.is_compiled else None
        self._hooked: list[torch.Tensor] = []  # what it kept over the window's micro-batches
        self._ddp = ddp
        self._params = self._judge.params
        self._device = self._judge.device
        self._zero = torch.zeros((), device=self._device)
        self._one = torch.ones((), device=self._device)
        self._nan = torch.full((), float("nan"), device=self._device)
        self._loss_scale: torch.Tensor | None = None  # what the window's losses were multiplied by
        self._loss_times = 1.0  # and divided by
        self._micros: list[_Micro] = []
        self._why_not: str | None = None  # why the current window cannot be replayed
        self._checked: Check | None = None
        self._loss_unseen = False  # a micro-batch of the window computed its loss where no hook sees it
        self.stop_step: int | None = None  # the step after which the run was asked to stop (`stop_due`)
        # low-precision weights: every probe.every-th applied step measured for updates rounded away
        self._probe: UpdateProbe | None = None
        self._sample: Any = None
        if optimizer is not None:
            try:
                probe = UpdateProbe(model, optimizer)
                if probe.low_precision:
                    if probe.why_not is None:
                        self._probe = probe
                        self._judge.expects_updates = True  # the last finite window kept for the what-if
                    else:
                        self._judge.updates(UpdateStats(0, type(optimizer).__name__, why_not=probe.why_not))
            except Exception as exc:
                self._error("preparing the update check", exc)
        ACTIVE.add(self)

    @property
    def not_replayed(self) -> dict[int, str]:
        return self._judge.not_replayed

    @property
    def attributes_ranks(self) -> bool:
        """True when a DDP hook sees each rank's gradients before the all-reduce."""
        return self._judge.bucket_watch is not None

    @property
    def amp_watch(self) -> amp.ScaleWatch:
        """The GradScaler's skips and scale, as seen by the checks."""
        return self._judge.amp

    @property
    def checked(self) -> bool:
        """True when this window's flags were read already (before the optimizer hook)."""
        return self._checked is not None

    def report(self, framework: str) -> Report:
        """The run so far, in the sentinel's shape, with the framework named."""
        data: dict[str, Any] = {"framework": framework}
        if self.file_error is not None:  # not a step the sentinel failed to check: the run was judged
            data["not_checked"] = {"report file": self.file_error}
        return self._judge.report(scaled=self.scaler is not None, lines=[("framework", framework)], data=data)

    @property
    def live(self) -> Live:
        """Where each finding goes as it is decided: its line, the report file, a stop."""
        return self._judge.live

    def write_live(self, writer: Callable[[], None]) -> None:
        """Rewrite the report file through `writer` as findings arrive (`Live`), and once now: a run
        killed before its first finding leaves a readable report too."""
        live = self._judge.live
        try:  # outside `Live`'s count of the rewrites' time: the first finding is written when decided
            writer()
        except Exception as exc:  # the file, not the steps: one line, no finding (a stop_on must not fire)
            self.file_error = f"the report file could not be written while training ran: {type(exc).__name__}: {exc}"
            live.note(f"fpdoctor: {self.file_error}; the steps are judged all the same")
            return
        live.writer = writer

    def stop_due(self, *, agree: bool = True) -> bool:
        """After a step is decided: True once, when a finding at the `stop_on` level asks the run to
        end; the report file is brought up to date first. Under torch.distributed every rank stops
        when any rank's finding asks it (one tiny all-reduce per step, with `stop_on` only), so that
        no rank waits in a collective for ranks that stopped; `agree=False` (a second look within
        a step) leaves that to the next step's look there."""
        live = self._judge.live
        if live.stop_on is None or self.stop_step is not None:
            return False
        try:
            stop = live.stopped is not None
            if self._judge.distributed:
                if not agree:
                    return False
                flag = torch.tensor(float(stop), device=self._device)
                stop = bool(distributed.all_max(flag).item() > 0)
            if not stop:
                return False
            self.stop_step = self._judge.steps
            live.settle(now=True)
        except Exception as exc:
            self._error("deciding whether to stop", exc)
            return False
        return True

    def close(self) -> None:
        """Training ended: the compiled-graph checks and the DataLoader's follower come off (the
        report stays readable)."""
        loader, self._loader = self._loader, None
        try:
            self.forward_done()
            self._hooked = []
            if loader is not None:
                loader.close()
        finally:
            self._judge.close()

    # -- what the callback reports -------------------------------------------------------------
    def start_micro(self) -> None:
        """A micro-batch starts, before its forward: its RNG state; at a window's first, its buffers."""
        try:
            self.forward_done()  # a batch the framework skipped left its hooks on: off before another begins
            if not self._micros:
                self._judge.begin_window()
                self._hooked = []
            if self._outputs is not None and self._judge.outputs_due(self._judge.steps + 1):
                self._outputs.start()  # off again once the forward is done (`forward_done`)
            self._micros.append(_Micro(RngState.capture()))
        except Exception as exc:
            self._error("preparing the step", exc)

    def forward_done(self) -> None:
        """The micro-batch's forward has run (its loss is computed): the model's outputs hooked for it, kept."""
        if self._outputs is not None:
            self._hooked += self._outputs.take()

    def has_inputs(self) -> bool:
        return bool(self._micros) and self._micros[-1].args is not None

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The current micro-batch's inputs, as the replay will pass them to `step_fn`."""
        if self._micros:
            self._micros[-1].args, self._micros[-1].kwargs = tuple(args), dict(kwargs)

    def loss_unseen(self) -> None:
        """The current micro-batch's loss is computed where the callback cannot see it."""
        self._loss_unseen = True

    @property
    def last_check_finite(self) -> bool:
        """The window's flags, read by `check`, show a finite step."""
        return self._checked is not None and self._checked.finite

    def window_args(self, kind: type) -> list[Any]:
        """The current window's recorded arguments of type `kind` (what the callback passed in)."""
        return [a for m in self._micros for a in (m.args or ()) if isinstance(a, kind)]

    def no_update_check(self, why: str) -> None:
        """The framework changes the update after the callback sees the gradients: not measured."""
        if self._probe is not None:
            self._probe = None
            self._judge.expects_updates = False
            self._judge.updates(UpdateStats(0, type(self._probe_optimizer()).__name__, why_not=why))

    def _probe_optimizer(self) -> Any:
        return self._judge.optimizer

    def after_step(self) -> None:
        """The optimizer has stepped: the writes to the weights after a reference step are watched
        from here on (what they kept of its update is judged when the next window begins); a step
        measured for its updates is read and judged."""
        try:
            self._judge.watch_update_writes()
        except Exception as exc:
            self._error("watching the writes after a reference step", exc)
        probe, sample, self._sample = self._probe, self._sample, None
        if probe is None or sample is None:
            return
        try:
            probe.after(sample)
            self._judge.updates(probe.read(sample), every=probe.every)
        except Exception as exc:
            self._error("measuring the optimizer's updates", exc)

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
        checked: Check | None = None
        judge = self._judge
        self.forward_done()  # the hooks off before anything else, whatever hook the framework skipped
        hooked, self._hooked = self._hooked, []
        try:
            self.check(step, spread=spread)
            checked = self._checked
            if judge.recipe is not None:  # the optimizer's recipe (numerics/training/recipe.py): a few floats a step
                try:
                    judge.recipe.step(judge.steps, self._params, judge.model, sys._getframe())
                except Exception as exc:
                    self._error("reading the optimizer's recipe", exc, step)
            judge.steps += 1  # counted whether or not the check worked (then the step goes on unguarded)
            judge.micro_batches += len(self._micros)
            if checked is not None:
                facts = self._facts(checked)
                outcome = judge.judge(facts)
                kept = self.window_args(KeptGradients)  # a callback that replays from its outputs' gradients
                if outcome.finite and (kept or hooked):  # the outputs' format: what a replay cannot see
                    outputs = [t for k in kept for t in k.originals]
                    judge.outputs_read(judge.steps, outputs or hooked, replayed=bool(outputs))
                if outcome.finite and facts.why_not is None and judge.reference_due(judge.steps):
                    self._reference(facts)
                probe = self._probe
                if probe is not None and outcome.finite and probe.due(judge.steps):
                    try:  # the sample and the intended update in fp32, before the framework steps
                        self._sample = probe.before(judge.steps)
                    except Exception as exc:
                        self._error("measuring the optimizer's updates", exc, step)
        except Exception as exc:
            self._error("deciding the step", exc, step)
        finally:
            # a step with a non-finite gradient is not applied, whatever failed after its check; under a
            # GradScaler it is the scaler's to skip (its step() finds it; ours would hide it from it).
            # A non-finite loss whose gradients are finite is applied, as the user's code would
            skip = checked is not None and checked.bad_grad and self.scaler is None
            self._micros, self._checked, self._why_not, self._loss_unseen = [], None, None, False
            if skip:
                for p in params if params is not None else self._params:
                    p.grad = None
        return checked

    # -- the step's facts ------------------------------------------------------------------------
    def _read(self, step: int, spread: bool) -> Check:
        micros = self._micros
        seen = [(i, m.loss) for i, m in enumerate(micros, start=1) if m.loss is not None]
        distributed_ = self._judge.distributed
        with torch.no_grad():
            grad = nonfinite_flag(grads_of(self._params), self._device)
            # the losses themselves come back and are judged on the host: NaN/Inf survive the trip
            raw = torch.stack([loss for _, loss in seen]) if seen else self._zero.new_empty(0)
            scale = amp.scale_tensor(self.scaler, self._device) if self.scaler is not None else self._nan
            divisor = self._loss_scale.reshape(()).float() if self._loss_scale is not None else self._one
            head = [grad, grad, scale, divisor]
            if distributed_:  # every rank skips, or none: replicas stay equal
                local = torch.isfinite(raw).all().logical_not().float()
                head[:2] = self._judge.corruption.exchange(torch.stack([local, grad]), step).unbind()
            values = FlagRead(torch.cat([torch.stack(head), raw])).values()
        losses = values[_LOSSES:]
        curve = [v / values[_DIVISOR] * self._loss_times for v in losses]
        local_bad = [i for (i, _), v in zip(seen, losses, strict=True) if not math.isfinite(v)]
        loss_value = (sum(curve) if self.sum_losses else sum(curve) / len(curve)) if curve else math.nan
        checked = Check(
            step,
            bad_loss=values[_LOSS] > 0 if distributed_ else bool(local_bad),
            bad_grad=values[_GRAD] > 0,
            local_loss=bool(local_bad),
            loss_value=loss_value,
            scale=values[_SCALE],
            spread=spread,
        )
        if not checked.finite:  # host reads from here on: bad steps only
            checked.micro = local_bad[0] if local_bad else None
            checked.seen = self._judge.gradient_view()  # while the gradients still show it
        return checked

    def _facts(self, c: Check) -> StepFacts:
        window, scaler = self._micros, self.scaler
        scaled = scaler is not None
        overflow = scaler is not None and c.bad_grad and not c.bad_loss
        why = self.cannot_replay_any or self._why_not
        if why is None and any(m.args is None for m in window):
            why = "the inputs of a micro-batch were not seen"
        return StepFacts(
            c.step,
            bad_loss=c.bad_loss,
            bad_grad=c.bad_grad,
            local_loss=c.local_loss,
            loss_value=c.loss_value,
            window=[MicroBatch(m.rng, m.args or (), m.kwargs or {}) for m in window],
            step_fn=self._step_fn if self._loader is None else self._on_its_rows,
            contexts=self._contexts,
            scale=c.scale if scaled else None,
            # what the scaler's update() makes of an overflow; judged before it runs
            next_scale=c.scale * float(scaler.get_backoff_factor()) if overflow and scaler is not None else None,
            micro=c.micro,
            micro_batches=len(window),
            why_not=why,
            spread=c.spread,
            loss_seen=not self._loss_unseen,
            seen=c.seen,
        )

    def _reference(self, facts: StepFacts) -> None:
        """The step against the reference step, before the framework's optimizer takes it: the
        backward stage (step_fn is the framework's forward and backward), and, where the gradients
        seen are final (`final_gradients`), the update stages on them."""
        judge = self._judge
        if judge.optimizer is None:
            return
        try:
            judge.reference(facts.step, optimizer=judge.optimizer, scaler=self.scaler, step_fn=self._step_fn,
                            window=facts.window, contexts=self._contexts, backward_only=True,
                            final_gradients=self.final_gradients)  # fmt: skip
        except Exception as exc:  # the observer's own failure: a finding, the step goes on
            self._error("comparing the step with the reference step", exc, facts.step)

    def _on_its_rows(self, *args: Any, **kwargs: Any) -> Any:
        """`step_fn`, the batch's dataset indices said first: found by its values among the batches
        the DataLoader handed out (or why not), for a replay's tracer to name its bad rows by (it
        reads them until it ends; `_contexts` puts the thread's back after the window)."""
        loader = self._loader
        if loader is not None:
            try:
                set_step_rows(loader.rows_of((args, kwargs)))
            except Exception as exc:  # the rows go unnamed; the replay runs
                set_step_rows((None, f"the step's batch could not be read ({type(exc).__name__}: {exc})"))
        return self._step_fn(*args, **kwargs)

    def _contexts(self) -> list[contextlib.AbstractContextManager[Any]]:
        contexts: list[contextlib.AbstractContextManager[Any]] = [
            distributed.local_replay(self._ddp if self._ddp is not None else self.model)
        ]
        if self._loader is not None:
            contexts.append(rows_kept())
        if self._replay_context is not None:
            contexts.append(self._replay_context())
        return contexts

    def _error(self, doing: str, exc: BaseException, step: int | None = None) -> None:
        self._judge.error(doing, exc, step)

    def error(self, doing: str, exc: BaseException) -> None:
        """A failure in the callback around this watch: reported like the watch's own."""
        self._judge.error(doing, exc)
