"""The decisions of a training step, made once for every front end that watches training.

A front end (`Sentinel` for a loop of the user's own, the Lightning and Hugging Face callbacks'
`StepWatch`) collects what happened in one optimizer step - the flags it read on the device, the
loss, the loss scale, the micro-batches a replay needs - into `StepFacts`, and hands them to
`StepJudge.judge`. The judge decides and reports, in one place:

- the step's outcome (finite, skipped, an AMP overflow the GradScaler skips itself), counted;
- the GradScaler's scale collapsing (and the op that overflows, by replaying the step);
- which rank held a bad step (its pre-reduce gradients, agreed across ranks);
- the step replayed as it ran (`replay`) and classified: reproduced -> a numerical bug at the op
  the trace names, with an fp32 control where it is a low-precision step; not reproduced -> a
  transient fault, joined with what changed in the GPU's health;
- parameters that became non-finite (no replay can recover those), and loss spikes;
- what a measured optimizer step did to low-precision weights (`updates`, `update_judge`), with
  the fix tried once by a what-if run of the last finite step's window, on stand-ins, for every
  front end alike;
- failures of the observer's own, as findings, never raised.

What the judge leaves to the front end is how the step is taken: applying it (`apply`), dropping
a skipped step's gradients, checkpoints, and how its facts were read. The gradient contract
around a replay is explicit: every replay leaves each parameter's `.grad` as it found it.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.compiled import step as compiled
from fpdoctor.numerics.observe import amp, dynamo
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.observe.grad_clears import Cleared, Where
from fpdoctor.numerics.observe.gradcheck import bad_parameters, kind_of, tensor_kind
from fpdoctor.numerics.observe.scaler_order import Mixed
from fpdoctor.numerics.training import (
    between,
    coarse_output,
    corruption,
    distributed,
    findings,
    loss_factors,
    progress,
    reference,
    reference_update,
    transient,
    unscaled_twice,
)
from fpdoctor.numerics.training.control import ControlResult, run_control, wants_control
from fpdoctor.numerics.training.live import FindingLog, Live
from fpdoctor.numerics.training.lr_whatif import LrTrial, Snapshot, snapshot, try_lower_lr, window_runner
from fpdoctor.numerics.training.recipe import RecipeChecks
from fpdoctor.numerics.training.reference import Comparison
from fpdoctor.numerics.training.replay import ReplayResult, replay
from fpdoctor.numerics.updates.causes import Causes, annotated, cause_of
from fpdoctor.numerics.updates.judge import UpdateJudge
from fpdoctor.numerics.updates.measure import EVERY, UpdateStats, UpdateSummary
from fpdoctor.numerics.updates.whatif import WHAT_IF_STEPS, WhatIf, what_if
from fpdoctor.preserve import BufferSnapshot, preserved
from fpdoctor.report.model import Finding, Report
from fpdoctor.torchprivate import named_parameters

SPIKE_WINDOW = 32
TIMELINE_POINTS = 2000  # loss points a report keeps for its plot (events are always kept)
SPIKE_MIN_HISTORY = 8
# A loss more than SPIKE_SIGMAS standard deviations above the recent mean, and at least
# SPIKE_RATIO times it, is a spike: both, so that a flat loss curve's tiny noise does not count.
SPIKE_SIGMAS = 6.0
SPIKE_RATIO = 1.5
# A climb still going when a step goes non-finite: the last finite loss this many times the level
# before the climb's first spike (the learning rate's divergence grows it by orders of magnitude)
CLIMBING = 10.0
# A spike rises to at least this share of the run's first loss, or SPIKE_FAR times its recent mean: on a
# loss that has converged far below where it started (2e-4 against a start of 2.4), a jump to 8x its
# recent mean is the batches' noise; one to 100x is not, whatever the start (unscaled targets at 1e4)
SPIKE_OF_START = 0.05
SPIKE_FAR = 16.0
# Before SPIKE_MIN_HISTORY steps, a loss this many times the first step's is a spike (divergence).
SPIKE_EARLY_RATIO = 100.0
# A spike is judged SPIKE_RECOVERY finite steps after its episode's last: where the median loss of
# those steps is back within 2 standard deviations of the mean before it, the spike was the batches'
# noise (a mini-batch MSE near convergence is heavy-tailed: 6 sigma jumps that come right back), and
# is counted in one info finding, not warned. One that does not come back, or that a non-finite step
# or the end of the run follows first, is a warning as before.
SPIKE_RECOVERY = 8

# A cause that reproduced on replay this many times is not replayed again: the next bad steps with
# the same symptoms are counted under it (a replay costs a traced step; forty of them say nothing new).
REPLAYS_PER_CAUSE = 2
# Training is not progressing when STALL_SKIPS of the last STALL_WINDOW optimizer steps were skipped
# (by the judge or by the GradScaler), or every step so far once there are STALL_FIRST of them.
STALL_WINDOW = 10
STALL_SKIPS = 8
STALL_FIRST = 3

SPREAD_NOTE = (
    " The gradients were read after a gradient-norm computation that multiplies every gradient by the "
    "non-finite norm, so every parameter shows NaN here: the replay names the op that produced it."
)

_Contexts = Callable[[], list[contextlib.AbstractContextManager[Any]]]


@dataclass
class StepOutcome:
    step: int
    loss: float
    finite: bool
    skipped: bool
    verdict: str | None = None  # "deterministic-nonfinite" / "transient-fault-suspected" / "amp-skip" / ...
    grad_norm: float | None = None  # of the unscaled gradients, where the front end took it
    scale: float | None = None  # GradScaler's loss scale this step used


# A GradScaler scale below this has a reciprocal past fp32's range: unscale_ multiplies every gradient by Inf
# (0 x Inf = NaN) and its own check, which reads the scaled gradients, finds nothing: the step goes ahead
UNSCALABLE = 1.0 / float(torch.finfo(torch.float32).max)


@dataclass
class StepFacts:
    """What happened in one optimizer step, as a front end saw it (host values, read once).

    `bad_loss`/`bad_grad` are agreed across ranks (every rank skips, or none); `local_loss` is
    this rank's own. `scale` is the GradScaler's scale the step used (None: no scaler judged the
    step) and `next_scale` what its update makes of it. `skippable`: a bad step can still be kept
    from the weights (False where the optimizer or scaler was already given it and applies a
    finite-gradient step). `applied`: the user's code applied the step itself; it is reported,
    never replayed (its weights are gone). `window`, `step_fn` and `contexts` are what a replay
    runs (the local-replay context under DDP, the loss scale the step used, a framework's
    autocast); `why_not` says why it cannot be replayed faithfully."""

    step: int
    bad_loss: bool
    bad_grad: bool
    local_loss: bool
    loss_value: float
    window: list[MicroBatch]
    step_fn: Callable[..., Any]
    contexts: _Contexts  # what a replay runs under, made anew for each replay (each is entered once)
    scale: float | None = None
    next_scale: float | None = None
    grad_norm: float | None = None
    micro: int | None = None  # the first micro-batch whose loss was bad, from 1
    micro_batches: int = 1  # in this optimizer step's window
    skippable: bool = True
    applied: bool = False
    # the optimizer had already been given the step when it is judged (decided on the device a step
    # later, or a GradScaler's step): a finite step's update is made, the state it started from gone
    stepped: bool = False
    why_not: str | None = None
    spread: bool = False  # gradients read after a norm computation that spread a NaN to all of them
    loss_seen: bool = True  # False: the loss is computed where the front end cannot see it
    # the what-if run's micro-batch (None: `step_fn`), returning the loss that `what_if_loss` names
    what_if_fn: Callable[..., Any] | None = None
    what_if_loss: str = "the loss"
    # which buckets / parameters held the bad gradients, read while they still showed it
    # (`StepJudge.gradient_view`); None: read when the step is judged
    seen: tuple[list[dict[str, Any]] | None, list[tuple[str, str]]] | None = None
    # the step whose non-finite gradients were still in .grad when this step began (step_fn did not
    # zero them), with the loss scale it ran at; and the replay's contexts at another loss scale
    carried: tuple[int, float | None] | None = None
    contexts_at: Callable[[float | None], list[contextlib.AbstractContextManager[Any]]] | None = None
    # the loss reads gradients of a GradScaler-scaled output (a gradient penalty): where they overflow at
    # a scale, the loss does too, and the scaler backs off as from any overflow
    penalty: bool = False
    # the replay runs the loss code (step_fn), under trace: it tells a penalty read scaled (NUM023) from
    # the scaler's calibration itself; the watch's replay of the model alone cannot (its traced step does)
    replays_penalty: bool = False

    @property
    def finite(self) -> bool:
        return not (self.bad_loss or self.bad_grad)

    @property
    def scaled(self) -> bool:
        return self.scale is not None


class StepJudge:
    """One training run's verdicts, counts and findings, fed one `StepFacts` per optimizer step.

    `model`: whose parameters, buffers and weights a step reads and a replay runs. `hooked`: the
    module a DDP communication hook goes on to see each rank's gradients before the all-reduce
    (the DDP wrapper; None: no pre-reduce attribution). `views`: what may hide a rank's
    gradients, for the finding that cannot name it. `what_if_steps`: the length of the what-if run
    that tries the fix for updates rounded away (0: none)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        hooked: nn.Module | None,
        optimizer: torch.optim.Optimizer | None,
        replay: bool,
        with_scaler: bool,
        views: str,
        gpu_health: bool = True,
        what_if_steps: int = WHAT_IF_STEPS,
        live: Live | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        # the optimizer's recipe (numerics/training/recipe.py), fed by the front end at each step
        self.recipe = RecipeChecks(optimizer) if optimizer is not None else None
        self.replay = replay
        self.what_if_steps = what_if_steps
        # set by a front end whose probe measures updates: the last finite step's facts are then kept
        # (references, until the next step is judged) for the what-if run that tries the fix
        self.expects_updates = False
        self._last_finite: StepFacts | None = None
        self.steps = 0  # counted by the front end, when it counts a step as taken
        self.micro_batches = 0
        self.skipped = 0
        # every finding is added here, and said as it is (`live`: its line, the report file, a stop)
        self.live = live if live is not None else Live()
        self.findings: list[Finding] = FindingLog(self.live)
        self.causes = Causes(self.findings)  # findings of a bad step go through it: one per cause
        self._reproduced: dict[tuple[Any, ...], int] = {}  # a bad step's symptoms -> replays that reproduced
        self.transients = transient.Experiments()  # a step that does not reproduce: its cause, by experiment
        self._stall: int | None = None  # the stalled episode's finding, by index, while it lasts
        self._stall_windowed = False  # that episode held over a whole window, not the first steps alone
        # the stalled episodes told so far, each (its first skip, the fix it printed): a later episode of the
        # same cause is the same finding, its episodes counted, not one finding per episode
        self._episodes: list[tuple[int, str]] = []
        self._spike_at: tuple[int, tuple[Any, ...]] | None = None  # the last spike's step and its episode
        # the spike episode waiting for SPIKE_RECOVERY steps (its findings, whose evidence holds the
        # mean and spread before it) and the finite losses since its last step; then the spikes that
        # came back
        self._held: list[tuple[Finding, tuple[Any, ...]]] = []
        self._since_spike: list[float] = []
        self._transient: list[dict[str, Any]] = []
        # the state the latest climb's first step started from (or why none is kept), and what lowering
        # the learning rate from there gave, once per stalled episode
        self._climb: Snapshot | str | None = None
        self._lr_trial: LrTrial | None = None
        self.history: list[StepOutcome] = []
        # the run's skipped steps so far and the first of them, counted as the history grows (_progress)
        self._skips: tuple[int, int | None, int] = (0, None, 0)  # (count, first step, history read)
        self.last_good_step: int | None = None
        self.not_replayed: dict[int, str] = {}
        self.decided: int | None = None  # the step whose verdict (apply or skip) is taken
        self.amp = amp.ScaleWatch()
        self.params: list[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = BufferSnapshot(model)
        # torch.compile: fpdoctor stays out of what Dynamo compiles; findings say where they were seen
        self.is_compiled = dynamo.is_compiled(model)
        dynamo.keep_out(dynamo.fpdoctor_modules())
        self.outputs = compiled.OutputCheck(model) if self.is_compiled else None
        # its checks patch Dynamo's class for the whole process: taken off by `close`, or when the
        # judge is collected where its front end has no end of its own (the Sentinel)
        self._closer = weakref.finalize(self, _close_outputs, self.outputs)
        self.compiled_graphs: dict[int, dict[str, Any]] = {}  # step -> its first non-finite compiled output
        self.first_graphs: dict[int, dict[str, Any]] = {}  # step -> its first Dynamo graph with a non-finite output
        self.repro_dir: str | None = None  # where a compiled-only fault's reproducer goes (None: a new temp dir)
        self._views = views
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._start_loss: float | None = None  # the run's first finite loss
        self._errors: set[tuple[str, str]] = set()
        self._weights_bad = False  # the parameters themselves are non-finite: no step can recover
        self._scale_gone = False  # the GradScaler's scale fell below UNSCALABLE (said once)
        self.here: dict[str, Any] = {}  # where every finding of this rank happened (rank, host, device)
        self.reference_every = 0  # compare every N-th step with the reference step (reference.py); 0: off
        # its pace: the last reference step and its cost, the time between judged steps less ours
        self._reference_last: int | None = None
        # the training outputs' format (outputs_read): the last check's finding, whether it was named
        self._outputs: dict[str, Any] = {"last": None, "named": False}
        self._inputs: dict[str, Any] = {"last": None, "named": False}  # the same for the forward's inputs
        self._reference_at: int | None = None  # the next reference step, once the least period is over
        self._reference_cost = 0.0
        # a flat window asks for a reference step at once: what the code does to the gradients may have
        # changed since the last one (a clip that starts after a warm-up), and a flat loss is when to look
        self._reference_asked = False
        # watch: the first step whose gradients were unscaled before its last backward (scaler_order.py),
        # waiting for the reference step that measures it; then True once said
        self._mixed: tuple[int, Mixed] | None = None
        self._mixed_said = False
        self._clock: float | None = None
        self._spent = 0.0  # seconds of reference work since the last judged step
        self._step_times: deque[float] = deque(maxlen=64)
        self.reference_compared: list[reference.Comparison] = []
        # why no step is compared with the reference in this run (said in the report); None: due ones are
        self.reference_off: str | None = None
        # a reference step whose weights are judged when the next step begins (reference_update.py)
        self._update_pending: reference_update.Pending | None = None
        # progress against the reference (progress.py): the finite steps' losses of the current window,
        # and what each flat window's experiment gave; 0: off
        self.progress_window = progress.WINDOW
        self._window_losses: list[tuple[int, float]] = []
        self.progress_judged: list[dict[str, Any]] = []
        self.progress_windows = 0  # windows whose two halves were compared, flat or not
        self.bucket_watch: distributed.BucketWatch | None = None
        self.distributed = False
        try:
            self.distributed = distributed.active()
            if hooked is not None:
                self.bucket_watch = distributed.BucketWatch.install(hooked)
            if self.distributed:
                self.here = findings.place(distributed.describe(self.device))
                self.live.rank = self.here.get("rank")
        except Exception as exc:
            self.error("setting up under torch.distributed", exc)
        # per-rank gradient norms in the step's all-reduce, for finite wrong numbers (corruption.py)
        self.corruption = corruption.CorruptionWatch(self.model, self.bucket_watch, self.device)
        self._updates = UpdateJudge(self.causes, self.here)
        # The GPU's health now, to say on a transient fault what changed on it since (Xid, ECC):
        # two reads per job, none per step.
        self._health: Any = None
        if gpu_health and self.device.type == "cuda":
            try:
                from fpdoctor.health import watch

                uuid = distributed.describe(self.device).get("uuid")
                self._health = watch.start(uuid) if uuid else None
            except Exception as exc:
                self.error("reading the GPU's health", exc)
        try:
            eps = findings.optimizer_eps_finding(optimizer, with_scaler=with_scaler, here=self.here)
            if eps is not None:
                self.findings.append(eps)
        except Exception as exc:
            self.error("looking at the optimizer's settings", exc)

    def close(self) -> None:
        """The end of training: the compiled-output checks come off (Dynamo's class as torch
        made it, once no other check is open); the findings not yet said are said. Safe to call more than once."""
        self.live.settle()
        self._closer()

    # -- a window starts -----------------------------------------------------------------------
    def begin_window(self, *, finish: bool = True) -> None:
        """Before a window's first forward: its buffers, and the DDP hook's view, start afresh; the
        last reference step's weights are judged (what they kept of its update), unless `finish` is
        False (watch begins a window before the optimizer it judged has stepped: it judges them at
        the next optimizer step instead)."""
        if finish:
            self.finish_update()
        self.buffers.capture()
        if self.outputs is not None:
            self.outputs.begin()
        if self.bucket_watch is not None:
            self.bucket_watch.begin()

    def gradient_view(self) -> tuple[list[dict[str, Any]] | None, list[tuple[str, str]]]:
        """Which DDP buckets (before the all-reduce) and which parameters hold non-finite
        gradients now: host reads, for bad steps only."""
        if self.bucket_watch is not None:
            return self.bucket_watch.local_faults(), []
        return None, bad_parameters(self.model)

    # -- the verdict ---------------------------------------------------------------------------
    def judge(self, f: StepFacts, apply: Callable[[], None] | None = None) -> StepOutcome:
        """Decide one optimizer step (`_decide`), then whether training still progresses."""
        self._last_finite = None
        now = time.perf_counter()  # the steps' time, for the reference step's pace
        if self._clock is not None:
            self._step_times.append(max(now - self._clock - self._spent, 0.0))
        self._clock, self._spent = now, 0.0
        outcome = self._decide(f, apply)
        try:  # every rank judges the same norms: a strike's escalation is collective
            self.corruption.observe(f.step, f.finite, self.causes.add)
        except Exception as exc:
            self.error("comparing the ranks' gradient norms", exc, step=f.step)
        if f.finite and self.expects_updates:
            self._last_finite = f
        self._progress()
        self.live.settle()  # the step decided: its new findings to the report file
        return outcome

    def _decide(self, f: StepFacts, apply: Callable[[], None] | None) -> StepOutcome:
        """Decide one optimizer step. A finite step is applied by `apply` (the front end's own
        way of stepping; None where the framework steps after us). A bad step is counted, its
        buffer writes undone, attributed to its rank, replayed and classified; the front end then
        keeps it from the weights where `outcome.skipped` and `f.skippable` say so."""
        outcome = StepOutcome(f.step, f.loss_value, finite=f.finite, skipped=False, grad_norm=f.grad_norm)
        outcome.scale = f.scale
        self.history.append(outcome)
        gone = f.scale is not None and f.scale < UNSCALABLE  # 1/scale is Inf: the scaler cannot unscale
        if gone and f.bad_grad:  # no replay: the scale, not this step's arithmetic or the machine, made it
            if not self._scale_gone:
                self._scale_gone = True
                self.findings.append(findings.scale_gone_finding(f.step, f.scale or 0.0, self.amp, here=self.here))
            outcome.skipped, outcome.verdict = f.skippable or f.scaled, "amp-scale-collapse"
            if outcome.skipped:
                self.skipped += 1
                self.buffers.restore()
            return outcome
        if f.scale is not None:
            next_scale = f.next_scale if f.next_scale is not None else f.scale
            # an overflow the scaler skips itself: AMP's business; with a penalty on scaled gradients the loss
            # overflows with them (whether the code unscales them is the traced step's to say)
            if f.bad_grad and (not f.bad_loss or (f.penalty and not f.replays_penalty)):
                outcome.skipped, outcome.verdict = True, "amp-skip"
                if self.amp.observe(True, next_scale):
                    self._collapse(f, next_scale)
                self._spike(f.step, f.loss_value)
                return outcome
            if not f.bad_grad:
                self.amp.observe(False, next_scale)
            else:  # a NaN loss the scaler skipped: counted as non-finite, not as an AMP overflow
                self.amp.note(next_scale)
        self.decided = f.step  # from here on a failure of ours never applies this step
        if f.finite:
            self._spike(f.step, f.loss_value, f)  # before the update: a climb's first step is kept as it started
            self._judge_progress(f)  # before the update too: the experiment starts from the step's own state
            if apply is not None:
                apply()
            self.last_good_step = f.step
            return outcome
        self._release_spikes()  # a spike a non-finite step follows is not noise
        if self.outputs is not None:  # torch.compile: the first compiled module that returned NaN/Inf
            graph = self.outputs.first_bad()
            if graph is not None:
                self.compiled_graphs[f.step] = graph
            first = self.outputs.graphs.first_bad()
            if first is not None:
                self.first_graphs[f.step] = first
        if f.applied:  # applied already: reported, not replayed (its weights are gone)
            self._attribute(f)
            return outcome
        # skipped by us, or by the scaler that finds the Inf gradient itself. A non-finite loss whose
        # gradients are all finite makes a finite update: the user's code (a GradScaler too) applies
        # it, and so do we, after its replay (a NaN in a term without gradient, a logged metric)
        outcome.skipped = f.bad_grad and (f.skippable or f.scaled)
        if outcome.skipped:
            self.skipped += 1
            self.buffers.restore()  # the bad forward's buffer writes (BatchNorm statistics) undone
        before = len(self.findings)
        try:
            if not (self._weights_bad or self._weights_went_bad(f.step)):  # said once; no replay can change it
                faulty, kind, symptoms = self._attribute(f)
                if self.replay:
                    outcome.verdict = self._replay_or_say_why(f, kind, faulty, symptoms)
        finally:  # a failure of ours never keeps the user's finite update from the weights
            if not f.bad_grad and f.skippable and apply is not None:
                apply()  # from the weights the replay started from, as the user's step would
        if f.penalty and f.replays_penalty and f.scaled and f.bad_grad and self.replay:
            self._calibration(f, outcome, before)
        return outcome

    def _calibration(self, f: StepFacts, outcome: StepOutcome, before: int) -> None:
        """A scaled step whose loss reads gradients (a penalty) and overflowed: where its replay under
        trace found the penalty unscaled as torch's recipe does (no gradients-still-scaled), the
        overflow was the scaler's calibration, as any overflow at its first scales is: the step's
        findings are withdrawn and it is counted as AMP's."""
        new = self.findings[before:]
        if any(x.name == "gradients-still-scaled" for x in new):  # read scaled: the cause, ahead of its symptoms
            cause = [x for x in new if x.name == "gradients-still-scaled"]
            self.findings[before:] = [*cause, *(x for x in new if x.name != "gradients-still-scaled")]
            return
        del self.findings[before:]
        outcome.verdict = "amp-skip"
        if outcome.skipped:
            self.skipped -= 1
        next_scale = f.next_scale if f.next_scale is not None else f.scale
        if next_scale is not None and self.amp.observe(True, next_scale):
            self._collapse(f, next_scale)

    # -- findings ------------------------------------------------------------------------------
    def _attribute(self, f: StepFacts) -> tuple[bool, str | None, tuple[Any, ...]]:
        """Report the bad step; whether this rank holds (or may hold) the fault, its kind
        (nan / +inf / -inf) as this rank saw it, and its symptoms (the causes of its findings, the
        same on every rank). Host reads: bad steps only."""
        me = distributed.describe(self.device)
        faults, parameters = f.seen if f.seen is not None else self.gradient_view()
        local = {
            **me,
            "loss_bad": f.local_loss,
            "loss_kind": kind_of(f.loss_value) if f.local_loss and not math.isfinite(f.loss_value) else None,
            "micro_batch": f.micro if f.local_loss else None,
            "faults": faults,
            "parameters": parameters,
            "loss_seen": f.loss_seen,
        }
        kind = findings.step_kind(local)
        ranks = distributed.agree(local) if self.distributed else [local]
        attributed = [r for r in ranks if r.get("loss_bad") or r.get("faults")]
        symptoms: list[tuple[Any, ...]] = []
        for r in attributed or ([] if self.distributed else ranks):
            finding = findings.rank_finding(
                f.step,
                r,
                micro_batches=f.micro_batches > 1,
                scaled=f.scaled,
                numel=len(self.params),
                applied=f.applied,
                grads_finite=not f.bad_grad,
            )
            if f.spread and finding.name == "nonfinite-gradient" and not r.get("faults"):
                finding = replace(
                    finding, message=finding.message + SPREAD_NOTE, evidence={**finding.evidence, "spread": True}
                )
            symptoms.append(cause_of(finding))
            self.causes.add(finding)
        if self.distributed and not attributed:
            if kind is None:  # no pre-reduce view: the reduced gradients' kind
                kind = findings.step_kind({"parameters": bad_parameters(self.model)})
            finding = findings.unattributed_finding(f.step, kind, len(self.params), views=self._views, here=self.here)
            self.causes.add(finding)
            return True, kind, (cause_of(finding),)
        if not self.distributed:
            return True, kind, tuple(symptoms)
        return any(r.get("rank") == me.get("rank") for r in attributed), kind, tuple(symptoms)

    def _weights_went_bad(self, step: int) -> bool:
        """On a bad step: are the parameters themselves non-finite (an earlier update put NaN/Inf
        in them)? Then one finding names the last applied step, and no step is replayed after."""
        bad = [
            (name, kind, p) for name, p in named_parameters(self.model) if (kind := tensor_kind(p.detach())) is not None
        ]
        anywhere = bool(bad)
        if self.distributed:  # sharded weights (FSDP) differ by rank: every rank takes the same path
            flag = torch.tensor([float(anywhere)], device=self.device)
            anywhere = bool(distributed.all_max(flag).item())
        if not anywhere:
            return False
        self._weights_bad = True
        if bad:  # else another rank's shard holds them
            self.causes.add(findings.weights_finding(step, self.last_good_step, bad, len(self.params), here=self.here))
        return True

    def _replay_or_say_why(self, f: StepFacts, kind: str | None, faulty: bool, symptoms: tuple[Any, ...]) -> str:
        why = f.why_not
        again = self._reproduced.get(symptoms, 0)
        if why is None and again >= REPLAYS_PER_CAUSE:  # the same on every rank: symptoms and counts are agreed
            why = "the same symptoms as steps that reproduced on replay; counted under their cause"

        if self.distributed:  # every rank replays, or none: a replay issues collectives
            flag = torch.tensor([float(why is not None)], device=self.device)
            if distributed.all_max(flag).item() and why is None:
                why = "another rank could not replay its part of the step"
        if why is None:
            verdict = self._replay(f, kind, faulty)
            if verdict == "deterministic-nonfinite":
                self._reproduced[symptoms] = again + 1
            return verdict
        self.not_replayed[f.step] = why
        said = {"replay": f"not replayed: {why}"}
        self.causes.annotate(("nonfinite-loss", "nonfinite-gradient"), f.step, f" Not replayed: {why}.", said)
        return "not-replayed"

    def _run_replay(self, f: StepFacts, observe: distributed.LocalPeak | None = None) -> ReplayResult:
        """The step run again as it ran; the gradients left as they were found."""
        saved = [(p, p.grad) for p in self.params]
        try:
            return replay(
                self.model, self.params, f.step_fn, f.window, f.contexts(), whole=self.distributed, observe=observe
            )
        finally:
            for p, g in saved:
                p.grad = g

    def _replay(self, f: StepFacts, kind: str | None, faulty: bool) -> str:
        """Replay the step; the verdict is this rank's when it holds (or may hold) the fault.

        Under torch.distributed every rank replays its whole window, so that every collective in
        it (a step_fn's own, DDP's first-iteration bucket rebuild, SyncBatchNorm's) is issued on
        every rank in the same order; gradients stay local (`local_replay`). Then every rank
        receives every faulty rank's verdict, so all reports say the same."""
        # a replay runs without the reduction: a hook that casts the gradients for it is judged by their peak
        hook = distributed.compressing_hook(self.model) if faulty and self.distributed else None
        peak = distributed.LocalPeak(self.model) if hook is not None else None
        result = self._run_replay(f, observe=peak)
        carried = self._carried(f, result) if faulty and not self.distributed else None
        if carried is not None:
            self._add_all(carried)
            return "deterministic-nonfinite"
        if self.is_compiled and faulty and not self.distributed and result.verdict == "transient-fault-suspected":
            only = self._compiled_only(f, kind, result.loss)  # torch.compile: numerics/compiled/step.py
            if only is not None:
                self._add_all([only])
                return "compiled-only-nonfinite"
        told: Finding | None = None  # the compression hook's cast past its dtype's range, where it is the cause
        if (
            hook is not None and peak is not None and result.verdict == "transient-fault-suspected"
            and peak.value > float(torch.finfo(hook[1]).max)
        ):  # fmt: skip
            told = findings.compressed_finding(f.step, hook, peak, distributed.describe(self.device))
            result = replace(result, verdict="deterministic-nonfinite")
        if faulty and result.verdict == "transient-fault-suspected":
            result.cause = self.transients.decide(
                self.model, self.params, f.step_fn, f.window, f.contexts, step=f.step, distributed=self.distributed
            )
        control: ControlResult | None = None
        if faulty and not self.distributed and result.verdict == "deterministic-nonfinite":
            culprit = result.culprit
            dtype = (culprit.evidence.get("dtype") if culprit else None) or result.evidence.get("dtype")
            if wants_control(dtype, self.model):
                saved = [(p, p.grad) for p in self.params]
                try:
                    control = run_control(self.model, self.params, f.step_fn, f.window, f.contexts())
                finally:
                    for p, g in saved:
                        p.grad = g
        mine = [told] if told is not None else self._verdict_findings(f, result, kind, control) if faulty else []
        if not self.distributed:
            self._add_all(mine)
            return result.verdict
        everyone = distributed.agree({"verdict": result.verdict if faulty else None, "findings": mine})
        verdicts = [e.get("verdict") for e in everyone if e.get("verdict") is not None]
        # a rank that reproduced the step holds the cause: the others' finite replays say nothing of a machine
        reproduced = "deterministic-nonfinite" in verdicts
        for rank, entry in enumerate(everyone):  # gathered in rank order
            if not (reproduced and entry.get("verdict") == "transient-fault-suspected"):
                # a finding of the rank's replay (its trace's first non-finite op) names that rank: every rank's
                # report holds it, and the merged report would give it the first file's
                self._add_all([
                    f if "rank" in f.where else replace(f, where={**f.where, "rank": rank})
                    for f in entry.get("findings") or []
                ])  # fmt: skip
        if reproduced:
            return "deterministic-nonfinite"
        return result.verdict if faulty else str(verdicts[0]) if verdicts else "not-replayed"

    def _add_all(self, found: list[Finding]) -> None:
        for finding in found:
            self.causes.add(finding)

    def _verdict_findings(
        self, f: StepFacts, result: ReplayResult, kind: str | None, control: ControlResult | None = None
    ) -> list[Finding]:
        if result.verdict == "replay-failed" and (result.error or "").startswith("not replayed: no micro-batch"):
            return [findings.not_replayed(f.step, result.error or "", here=self.here)]
        if result.verdict == "replay-failed":
            self.error("replaying the step", RuntimeError(result.error or "unknown"), step=f.step)
            return []
        me = distributed.describe(self.device)
        health = None
        if result.verdict == "transient-fault-suspected" and self._health is not None:
            from fpdoctor.health import watch

            health = watch.since(self._health)
        # a climb of the loss before it: the learning rate, where lowering it from the climb was tried and
        # separated the rates (the run's went non-finite or climbed, a lower one did not); a climb whose trial
        # did not (a 0/0 in the code after a bad batch) leaves the replay's own verdict
        climbed = self._climbing(f.step) if result.verdict == "deterministic-nonfinite" else None
        lr_trial = self._try_lower_lr(f.step) if climbed is not None else None
        if lr_trial is None or not lr_trial.separates:
            climbed, lr_trial = None, None
        made = findings.verdict_findings(
            f.step,
            result,
            me,
            micro_batches=f.micro_batches > 1,
            kind=kind,
            control=control,
            health=health,
            climbed=climbed,
            lr_trial=lr_trial,
            loss_finite=not f.bad_loss,
        )
        if self.is_compiled and result.verdict == "deterministic-nonfinite":  # the compiled model, run eagerly
            made = compiled.seen_in(made, compiled.EAGER_REPLAY)
        # the trace's own findings of the replay (the op of origin's) belong to this step too
        return [m if "step" in m.evidence else replace(m, evidence={**m.evidence, "step": f.step}) for m in made]

    def _compiled_only(self, f: StepFacts, kind: str | None, eager_loss: float) -> Finding | None:
        """The eager replay of a compiled model's bad step was finite: run it compiled once more."""
        saved = [(p, p.grad) for p in self.params]
        capture: contextlib.AbstractContextManager[list[Any]] = (
            self.outputs.graphs.capturing() if self.outputs is not None else contextlib.nullcontext([])
        )
        try:
            with capture as captured:
                bad, loss = compiled.rerun_compiled(self.model, self.params, f.step_fn, f.window, f.contexts())
        except Exception as exc:
            self.error("re-running the step compiled", exc, step=f.step)
            return None
        finally:
            for p, g in saved:
                p.grad = g
        if not bad:
            return None
        graph = None
        if captured:  # the first graph whose finite inputs gave NaN/Inf: run apart from the step
            try:
                graph = compiled.graph_evidence(captured[0], self._repro_dir(f.step))
            except Exception as exc:
                self.error("re-running the compiled graph", exc, step=f.step)
        return compiled.compiled_only_finding(f.step, kind, eager_loss, loss, self.here, graph=graph)

    def _repro_dir(self, step: int) -> str | Callable[[], str]:
        """The folder given, else a maker of a new private temporary one (a guessable name could be
        made first by someone else, and the reproducer is run from it), called only when there is a
        reproducer to write."""
        if self.repro_dir is not None:
            return self.repro_dir
        import os
        import tempfile

        return lambda: tempfile.mkdtemp(prefix=f"fpdoctor-graph-{os.getpid()}-step{step}-")

    def _collapse(self, f: StepFacts, next_scale: float) -> None:
        collapse = findings.collapse_finding(
            f.step, self.amp, self.steps, f.scale or math.nan, next_scale, here=self.here
        )
        if not (self.replay and f.why_not is None and not f.applied and not self.distributed):
            self.causes.add(collapse)
            return
        with preserved(self.model):  # name the op that overflows, once per collapse, from the step's own buffers
            self.buffers.restore()
            result = self._run_replay(f)
            carried = self._carried(f, result)
        named = result.culprit.evidence.get("kind") if result.culprit is not None else None
        if named in ("nan", "+inf", "-inf"):  # what the replay saw, where the scaler's flag says only "non-finite"
            collapse = findings.collapse_finding(
                f.step, self.amp, self.steps, f.scale or math.nan, next_scale, here=self.here, kind=named
            )
        # the cause ahead of the symptom it explains: the replay's verdict, then the collapse
        kind = named if named in ("nan", "+inf", "-inf") else "+inf"
        self._add_all([*(carried if carried is not None else self._verdict_findings(f, result, kind)), collapse])

    def _carried(self, f: StepFacts, result: ReplayResult) -> list[Finding] | None:
        """A step that began with an earlier step's non-finite gradients still in .grad, and whose
        replay from zeroed gradients is finite: the carried gradients made it non-finite, not this step
        and not the machine (the replay zeroes them, which the step as it ran did not). Replayed again
        at the loss scale of the step they came from, the op that overflowed there is named."""
        if f.carried is None or result.verdict != "transient-fault-suspected":
            return None
        since, since_scale = f.carried
        origin = None
        if since_scale is not None and since_scale != f.scale and f.contexts_at is not None:
            saved = [(p, p.grad) for p in self.params]
            try:
                origin = replay(self.model, self.params, f.step_fn, f.window, f.contexts_at(since_scale))
            finally:
                for p, g in saved:
                    p.grad = g
        return findings.carried_findings(
            f.step,
            since,
            since_scale,
            scale=f.scale,
            loss=result.loss,
            origin=origin,
            here=distributed.describe(self.device),
        )

    def _spike(self, step: int, loss_value: float, f: StepFacts | None = None) -> None:
        if not math.isfinite(loss_value):  # a NaN in the history would switch spike detection off
            return
        history = self._losses
        spiked = False
        if len(history) >= SPIKE_MIN_HISTORY:
            # floats, not statistics.pstdev's exact fractions: 32 values, every step, within 1e-15
            mean = math.fsum(history) / len(history)
            spread = math.sqrt(math.fsum((v - mean) ** 2 for v in history) / len(history))
            spiked = (
                loss_value > mean + SPIKE_SIGMAS * spread
                and loss_value > SPIKE_RATIO * abs(mean)
                and (
                    self._start_loss is None
                    or loss_value >= SPIKE_OF_START * abs(self._start_loss)
                    or loss_value >= SPIKE_FAR * abs(mean)
                )
            )
        elif history and history[0] > 0:
            # too few steps for a spread: a run that diverges from its first steps (a learning rate far
            # too high) is judged against its first loss
            mean, spread = history[0], 0.0
            spiked = loss_value > SPIKE_EARLY_RATIO * history[0]
        if spiked:
            # spikes on consecutive steps are one episode (a loss that climbs step after step)
            last = self._spike_at
            episode = last[1] if last is not None and last[0] == step - 1 else ("loss-spike", step)
            self._spike_at = (step, episode)
            # the first climb's state is kept until its loss comes back: a loss that climbs again from
            # where it stayed (a second spike) is the same divergence, the rate tried from its start
            if f is not None and episode == ("loss-spike", step) and not isinstance(self._climb, Snapshot):
                self._climb = self._keep_climb(f)
            if self._held and self._held[-1][1] != episode:
                self._release_spikes()  # spiked again before it came back
            self._held.append(
                (
                    findings.spike_finding(
                        step, loss_value, mean, spread, len(history), here=self.here, lr=self._learning_rate()
                    ),
                    episode,
                )
            )
            self._since_spike = []
        else:
            if self._held:
                self._since_spike.append(loss_value)
                if len(self._since_spike) >= SPIKE_RECOVERY:
                    before = self._held[0][0].evidence  # the level before the episode's first spike
                    back = statistics.median(self._since_spike) <= before["mean"] + 2 * before["std"]
                    self._release_spikes(came_back=back)
            if f is not None and not self._held:
                self._climb = None  # a finite step that did not climb, none held up: no climb to start from
            elif f is not None and self._climb is None:
                # a step of a climb still held up whose first step kept no state (a GradScaler skipped
                # it: replayed at that scale, every rate would overflow again): the climb from here;
                # once, where keeping it failed or is off (its reason stays)
                self._climb = self._keep_climb(f, first=False)
        history.append(loss_value)
        if self._start_loss is None:
            self._start_loss = loss_value

    def _release_spikes(self, *, came_back: bool = False) -> None:
        """The held spike episode judged: counted as noise where its loss came back, else its findings
        added as they were made (a non-finite step, the end of the run, a loss that stays up)."""
        held, self._held, self._since_spike = self._held, [], []
        if came_back:
            self._transient += [dict(f.evidence) for f, _ in held]
            self._climb = None  # it came back: no climb to start from
            return
        for finding, episode in held:
            self.causes.add(finding, episode)

    def _learning_rate(self) -> float | None:
        """The largest learning rate of the optimizer's groups now, where it has one."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        rates = [float(g["lr"]) for g in groups if isinstance(g.get("lr"), (int, float))]
        return max(rates) if rates else None

    def _climbing(self, step: int) -> Finding | None:
        """The loss spike before `step` whose climb was still going at the last finite step: its loss
        CLIMBING times the level before the spike (its mean plus twice its spread) or more. A spike the
        loss came back from, or stayed a little above (one bad batch, whose update shook the weights),
        is not the divergence a later non-finite step follows (a 0/0 in the code)."""
        spike = findings.climbed_before(step, self.findings)
        if spike is None or not self._losses:
            return None
        ev = spike.evidence
        level = float(ev.get("mean", math.nan)) + 2 * float(ev.get("std", 0.0))
        return spike if self._losses[-1] > CLIMBING * abs(level) else None

    def _keep_climb(self, f: StepFacts, *, first: bool = True) -> Snapshot | str:
        """The state a climb's first step starts from, to try a lower learning rate on if training stalls."""
        if not self.replay or f.why_not is not None or f.applied or self.distributed:
            return f.why_not or (
                "the step was applied by the step function itself"
                if f.applied
                else "replays are off"
                if not self.replay
                else "a trial on one rank would leave the others' collectives"
            )
        try:
            # where the optimizer already made the step's update (a GradScaler's step, device-side
            # skipping), the state after it: the weights the step started from are gone
            return snapshot(
                self.model,
                self.optimizer,
                f.step,
                window_runner(f.window, f.step_fn, f.contexts),
                f.scale,
                after_update=f.stepped,
                first=first,
            )
        except Exception as exc:
            return f"the state could not be kept ({type(exc).__name__}: {exc})"

    def _try_lower_lr(self, first_skip: int) -> LrTrial | None:
        """Lower the learning rate from the climb's first step, once per stalled episode, where the
        evidence points at it (a loss spike before the first skip)."""
        if self._lr_trial is not None or not findings.learning_rate_points(first_skip, self.findings):
            return self._lr_trial
        climb = self._climb
        if isinstance(climb, Snapshot):
            self._lr_trial = try_lower_lr(self.model, self.optimizer, climb)
            self._climb = None  # tried: the copy is not held any longer
        else:
            self._lr_trial = LrTrial(None, why_not=climb or "no state from before the climb was kept")
        return self._lr_trial

    def _progress(self) -> None:
        """Is training still progressing? Most recent steps skipped -> one training-stalled finding
        per episode, its counts kept current while the episode lasts."""
        history = self.history
        # the GradScaler's skips count only once its scale has collapsed: before, it is calibrating
        # (a healthy fp16 run's first steps overflow by design, from a scale of 65536)
        lost = self.amp.collapsed

        def skipped_(h: StepOutcome) -> bool:
            return h.skipped and (lost or h.verdict != "amp-skip")

        def stuck_(h: StepOutcome) -> bool:  # kept from the weights, or applied with a non-finite loss
            return skipped_(h) or not (h.finite or h.skipped)

        recent = history[-STALL_WINDOW:]
        skipped = sum(1 for h in recent if stuck_(h))
        all_so_far = len(history) >= STALL_FIRST and all(stuck_(h) for h in history)
        stalled = all_so_far or (len(recent) == STALL_WINDOW and skipped >= STALL_SKIPS)
        if stalled and not any(skipped_(h) for h in recent):
            # non-finite losses the optimizer applied (their gradients finite: a NaN in a term without
            # gradient trains on); a stall only where a climb of the loss led there (the rate's divergence)
            stalled = self._climbing(next(h.step for h in recent if stuck_(h))) is not None
        if not stalled:
            if skipped <= STALL_WINDOW // 2:
                if self._stall is not None and not self._stall_windowed and len(recent) < STALL_WINDOW:
                    return  # called on the run's first steps: judged over once the optimizer ran a window
                stall, self._stall = self._stall, None  # the episode is over; a later one is new
                if stall is not None and not self._stall_windowed and stall < len(self.findings):
                    # called on the run's first steps alone ("the optimizer never ran"), and the
                    # optimizer has run since, most of a window: no stall after all, and no episode
                    del self.findings[stall]
                    if self._episodes:
                        self._episodes.pop()
                self._stall_windowed = False
                if history[-1].finite and not history[-1].skipped:
                    self._lr_trial = None  # a finite step applied again: a trial of a rate (a verdict's) is done with
            return
        self._stall_windowed |= not all_so_far or len(recent) == STALL_WINDOW
        episode = [h for h in history[self._stall_start() :]]
        first_skip = next((h.step for h in episode if h.skipped or not h.finite), history[-1].step)
        count, first, read = self._skips
        for h in history[read:]:  # each step read once: a long stall rebuilds its finding on every step
            if h.skipped:
                count, first = count + 1, h.step if first is None else first
        self._skips = (count, first, len(history))
        finding = findings.stall_finding(
            run=(count, first) if first is not None else None,
            steps=len(history),
            window=episode,
            first_skip=first_skip,
            last_good=self.last_good_step,
            found=self.findings,
            here=self.here,
            lr_trial=self._try_lower_lr(first_skip),
            climbing=self._climbing(first_skip) is not None and self._lr_trial is not None and self._lr_trial.separates,
        )
        if self._stall is None or self._stall >= len(self.findings):
            same = [first for first, fix in self._episodes if fix == finding.fix]
            earlier = next(
                (i for i, f in enumerate(self.findings) if f.name == "training-stalled" and f.fix == finding.fix), None
            )
            self._episodes.append((first_skip, finding.fix))
            if same and earlier is not None:  # the cause stalled the run before: one finding, its episodes counted
                self._stall = earlier
            else:
                self._stall = len(self.findings)
                self.findings.append(finding)
                return
        same = [first for first, fix in self._episodes if fix == finding.fix]
        if len(same) > 1:
            finding = replace(
                finding,
                message=f"{finding.message} The run stalled so {len(same)} times, from steps "
                f"{', '.join(str(s) for s in same[:8])}{', ...' if len(same) > 8 else ''}: each episode's own "
                "cause is its replay's finding (deterministic-nonfinite, with its steps).",
                evidence={**finding.evidence, "episodes": len(same), "episode_steps": same[:20]},
            )
        self.findings[self._stall] = finding

    def _stall_start(self) -> int:
        """Where the stalled episode starts in the history: after the last run of finite steps."""
        history = self.history
        i = len(history)
        while i > 0 and (history[i - 1].skipped or not history[i - 1].finite or i > len(history) - STALL_WINDOW):
            i -= 1
        return i

    @property
    def update_summary(self) -> UpdateSummary | None:
        """What the measured optimizer steps judged (None: nothing low-precision was measured)."""
        return self._updates.summary

    def updates(self, stats: UpdateStats, *, every: int = EVERY) -> None:
        """A measured optimizer step from a front end's `UpdateProbe` (or why none can be measured:
        `stats.why_not`), judged by `UpdateJudge`; the fix is tried on the last finite step's window."""
        try:
            tried, untried = self._what_if()
            self._updates.add(stats, self.optimizer, every=every, what_if=tried, untried=untried)
        except Exception as exc:
            self.error("judging the optimizer's updates", exc, step=stats.step)
        finally:
            self._last_finite = None
            self.live.settle()

    def _why_no_copies(self, f: StepFacts | None, *, unscaled: bool = False) -> str | None:
        """Why a step's window cannot be run again on copies to take optimizer steps from its state
        (the what-if of fp32 master weights, the progress experiment); None where it can."""
        if self.optimizer is None:
            return "the optimizer is not known"
        if self.distributed:
            return "under torch.distributed a what-if run on one rank would issue collectives the others do not"
        if f is None:
            return "the step's window was not kept"
        if f.applied:
            return "the step function applied the step itself: running it again would step your optimizer"
        if f.why_not is not None:
            return f.why_not
        if f.scale is not None and not unscaled:
            return "the step ran through a GradScaler: stand-in steps would take its scaled gradients"
        return None

    def _what_if(self) -> tuple[Callable[[], WhatIf] | None, str]:
        """The what-if run of the last finite step's window, on stand-ins (`update_whatif`), or why none."""
        f, optimizer = self._last_finite, self.optimizer
        if not self.what_if_steps:
            return None, "what_if_steps=0"
        why = self._why_no_copies(f)
        if why is not None:
            return None, why
        assert f is not None and optimizer is not None
        steps = self.what_if_steps

        def run_window() -> torch.Tensor | None:
            """The window's micro-batches as they ran (their RNG, the front end's contexts); its loss,
            None where a micro-batch returns none (run from the gradients at the outputs)."""
            losses = []
            for micro in f.window:
                micro.rng.restore()
                with contextlib.ExitStack() as stack:
                    for context in f.contexts():
                        stack.enter_context(context)
                    loss = (f.what_if_fn or f.step_fn)(*micro.args, **micro.kwargs)
                if isinstance(loss, (torch.Tensor, float, int)):
                    losses.append(torch.as_tensor(loss).detach().float().mean().cpu())
            return torch.stack(losses).mean() if losses and len(losses) == len(f.window) else None

        def tried() -> WhatIf:
            with contextlib.ExitStack() as stack:
                # compiled code runs eagerly in the what-if: its stand-in weights would fail Dynamo's guards
                # and recompile the user's graphs (set_stance: torch >= 2.6, and only once Dynamo is imported)
                stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None
                if stance is not None:
                    stack.enter_context(stance("force_eager"))
                return what_if(self.model, optimizer, run_window, steps=steps, loss_is=f.what_if_loss)

        return tried, ""

    # -- progress against the reference (progress.py) ------------------------------------------------
    def _judge_progress(self, f: StepFacts) -> None:
        """Every `progress_window` finite steps: a flat window is put to the experiment from this
        step's state; the recipe stopping progress the reference makes is a finding, said once."""
        if self.progress_window <= 0 or not math.isfinite(f.loss_value):
            return
        self._window_losses.append((f.step, f.loss_value))
        # the window doubles after each experiment: a converged run, flat from here on, pays for one
        # experiment per doubling of its length (log2 of its steps), not one per window
        span = self.progress_window * 2 ** len(self.progress_judged)
        if len(self._window_losses) < span:
            return
        window, self._window_losses = self._window_losses, []
        self.progress_windows += 1
        flat = progress.flat([s for s, _ in window], [v for _, v in window])
        if flat is None or any(x.name == "training-not-progressing" for x in self.findings):
            return
        self._reference_asked = True
        why = self._why_no_copies(f, unscaled=True)  # the arms divide a GradScaler's scale out, as its step does
        if why is None and self.is_compiled:
            why = "a compiled model: its copies would compile new graphs"
        elif why is None and f.stepped:
            why = "the step was applied before it was judged: the state it started from is gone"
        judged: dict[str, Any] = {"window": [flat.first, flat.last], "flat": [flat.before, flat.after]}
        self.progress_judged.append(judged)
        if why is not None:
            judged["not_tried"] = why
            return
        held = {id(p) for p in self.model.parameters()}
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        stepped = [p for group in groups for p in group["params"]]
        if stepped and not any(id(p) in held for p in stepped):
            # the optimizer holds master weights of the script's own, copied into the model by its code after the
            # step: the arms step tensors the forward does not read, and "falls by 0 and 0" would measure nothing
            judged["not_tried"] = (
                "the what-if's steps moved no weight the model reads, in either recipe (an optimizer over tensors "
                "the forward does not read: master weights of your own, copied into the model by your code)"
            )
            return
        try:
            assert self.optimizer is not None
            arms = progress.run_arms(
                self.model, self.optimizer, f.window, f.what_if_fn or f.step_fn, f.contexts, divide=f.scale or 1.0
            )
            if f.scale and f.what_if_fn is not None:  # a loss to first order from the backwarded, scaled loss
                arms = progress.Arms(
                    arms.steps, (arms.run[0] / f.scale, arms.run[1] / f.scale),
                    (arms.reference[0] / f.scale, arms.reference[1] / f.scale),
                )  # fmt: skip
        except Exception as exc:  # step_fn cannot run on copies: said in the report, never raised
            judged["not_tried"] = f"the steps could not run on copies: {type(exc).__name__}: {exc}"
            return
        if not math.isfinite(arms.run[0]) and not math.isfinite(arms.reference[0]):
            # no loss from the very first replay, in either recipe: nothing went non-finite, the replayed
            # call does not give the run's loss (a PINN's, made of the output's derivatives and of several
            # forwards; a loss that a script computes from more than the model's output)
            judged["not_tried"] = (
                "the replayed step gives no loss to compare, at its first step already (a loss made of several "
                "forwards or of the output's derivatives is not the replayed call's)"
            )
            return
        judged.update(recipe=list(arms.run), reference=list(arms.reference))
        if f.what_if_fn is not None and f.what_if_loss != "the loss":  # estimated, not the loss function's
            judged["loss_is"] = f.what_if_loss
        if arms.recipe_stops_progress():
            dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in self.params}))
            self.findings.append(
                progress.finding(flat, arms, recipe=f"{dtypes} weights", here=self.here, loss_is=judged.get("loss_is"))
            )

    # -- the reference step (reference.py) --------------------------------------------------------
    def reference_due(self, step: int) -> bool:
        """Whether this step is compared with the reference step: the first judged one, then every
        `reference_every`-th; never under torch.distributed (a local run's gradients are not the
        all-reduced ones the optimizer receives)."""
        if self.reference_every <= 0:
            self.reference_off = "switched off (reference_every=0)"
        elif self.distributed:
            self.reference_off = (
                "under torch.distributed the optimizer receives all-reduced gradients, which a local step cannot give"
            )
        if self.reference_off is not None:
            return False
        if self._reference_asked or (self.reference_every == reference.EVERY and step in reference.EARLY):
            return True
        if self._reference_last is None:
            return reference.due(step, self.reference_every)
        if step < self._reference_last + self.reference_every:  # the least period: nothing measured per step
            return False
        if self._reference_at is None:  # once per period: the pace from the cost and the steps' time
            self._reference_at = self._reference_last + self._reference_gap()
        return step >= self._reference_at

    def _reference_gap(self) -> int:
        """Steps from the last reference step to the next (`reference.paced`)."""
        step_time = statistics.median(self._step_times) if self._step_times else 0.0
        return reference.paced(self.reference_every, self._reference_cost, step_time)

    def outputs_read(self, step: int, outputs: list[torch.Tensor], *, replayed: bool = True) -> None:
        """The training forward's outputs, judged for a format too coarse for them (coarse_output.py) at
        steps 4, 8, 16, 32, 64, then every 64th: a model fits its targets as it trains, so its first steps
        say little, and a run of 200 steps is judged by step 128; named once two checks in a row find it.
        One host read a check. `replayed`: the reference step replays the backward from the gradients at
        these outputs (watch, a callback that keeps them), so it cannot see their rounding; otherwise it
        ran the forward in fp32 (the Lightning callback, the Sentinel), and a departure it found is this
        rounding's consequence: the cause goes ahead of it, and says so."""
        found = self._coarse_read(step, outputs, self._outputs) if step >= 4 else None
        if found is None:
            return
        departed = None
        if not replayed:  # the gradients' departure at the backward is what a rounded output makes
            departed = next(
                (f for f in self.findings
                 if f.name == "gradients-depart-from-reference" and f.evidence.get("stage") == "backward"),
                None,
            )  # fmt: skip
        # appended (the run's findings are kept by position: Causes, the stall); the report puts it ahead of
        # the departure it explains (findings.causes_first)
        self.findings.append(coarse_output.finding(found, step, self.here, replayed=replayed, departed=departed))

    @property
    def framework(self) -> str | None:
        """The framework that steps the optimizer ("lightning", "transformers"), for fixes in its terms."""
        return self._updates.framework

    @framework.setter
    def framework(self, name: str | None) -> None:
        self._updates.framework = name

    def outputs_due(self, step: int) -> bool:
        """`outputs_read` would look at `step`'s outputs (a front end that hooks the model to see them
        hooks it for these steps alone)."""
        return step >= 4 and not self._outputs["named"] and _coarse_due(step)

    def inputs_read(self, step: int, inputs: list[torch.Tensor]) -> None:
        """The training forward's floating inputs, judged as `outputs_read` judges its outputs, at steps 1,
        2, 4, 8, ..., then every 64th: raw readings cast to bf16/fp16 before the model (pressure near 1013 hPa
        that varies by 4, bf16's spacing there 8) lose what they vary by before any op of the model runs;
        named once two checks in a row find it."""
        found = self._coarse_read(step, inputs, self._inputs, inputs=True)
        if found is not None:
            self.findings.append(coarse_output.input_finding(found, step, self.here))

    def _coarse_read(
        self, step: int, tensors: list[torch.Tensor], seen: dict[str, Any], *, inputs: bool = False
    ) -> dict[str, Any] | None:
        """One check of `tensors` at a power-of-two step, then every 64th; `seen`: "named" once said, "last"
        the previous check's figures. What to name, once two checks in a row find it; else None."""
        if seen["named"] or not _coarse_due(step):
            return None
        found = coarse_output.coarse(tensors, inputs=inputs)
        named = found is not None and seen["last"] is not None
        seen["named"] = seen["named"] or named
        seen["last"] = found
        return found if named else None

    def reference(self, step: int, **kwargs: Any) -> None:
        """`_reference_step`, timed: its cost paces the next one (`reference_due`)."""
        started = time.perf_counter()
        self._reference_last, self._reference_at, self._reference_asked = step, None, False
        try:
            self._reference_step(step, **kwargs)
        finally:
            self._reference_cost = time.perf_counter() - started
            self._spent += self._reference_cost

    def _reference_step(
        self,
        step: int,
        *,
        optimizer: torch.optim.Optimizer,
        scaler: Any,
        step_fn: Callable[..., Any],
        window: list[MicroBatch],
        contexts: _Contexts,
        backward_only: bool = False,
        scale_carried: bool = False,
        final_gradients: bool = False,
        hand: loss_factors.StepFactors | None = None,
    ) -> None:
        """Compare the step's gradients, before the optimizer takes them, with the reference step's;
        a departure is a finding. Host reads and two extra passes: reference steps only.
        `contexts()`: what a run of the window runs under (a local replay, a framework's autocast);
        the loss scale is set here. `backward_only`, `scale_carried`: see `reference.compare_step`.
        `final_gradients` (with `backward_only`): the live gradients are those the optimizer will
        take (watch judges at the optimizer's step, after your clipping): the update stages are
        compared on them, the reference update the same optimizer's over fp32 copies of the weights
        and state on those gradients, since the replay of the backward alone has no step_fn to
        process the reference's gradients as yours were. `hand`: constant factors on the step's loss that the
        gradients the optimizer takes should not carry (loss_factors.py): a loss scale of the script's own, which
        both runs divide out, and the gradients the optimizer took are judged for still carrying it; or a division
        by the micro-batch count made twice."""
        names = {id(p): n for n, p in named_parameters(self.model)}
        live = {names[id(p)]: p.grad.detach().float() for p in self.params if p.grad is not None and id(p) in names}
        scale = float(amp.scale_tensor(scaler, self.device)) if amp.enabled(scaler) else None
        unscaled = reference.unscaled_already(scaler, optimizer)
        divide = scale if scale is not None and scale > 0 and not unscaled else 1.0  # what scaler.step divides out
        why = None
        if self.is_compiled:  # Dynamo would compile graphs anew for the copies: the observer compiles nothing
            why = "a compiled model: running it on copies of its parameters would compile new graphs"
        elif not live:
            why = (
                "no parameter of the model that the optimizer holds had a gradient at its step (cleared after the "
                "backward, or master weights of your own)"
            )
        if why is not None:
            self.reference_compared.append(reference.Comparison(step, not_compared=why))
            return

        def at(scale: float | None) -> list[contextlib.AbstractContextManager[Any]]:
            made = contexts()
            if scale is not None and amp.enabled(scaler):
                made.append(amp.scale_as(scaler, torch.full_like(amp.scale_tensor(scaler, self.device), scale)))
            return made

        by_hand = hand.scale if hand is not None and scale is None and backward_only and scale_carried else None
        try:
            result = reference.compare_step(
                step, self.model, optimizer=optimizer, scaler=scaler, step_fn=step_fn, window=window,
                contexts=at, live=live, scale=by_hand or scale, unscaled=unscaled, backward_only=backward_only,
                scale_carried=scale_carried,
            )  # fmt: skip
        except Exception as exc:  # step_fn cannot run on copies (it reads tensors it holds itself)
            text = f"step_fn could not run on copies of the parameters: {type(exc).__name__}: {exc}"
            self.reference_compared.append(reference.Comparison(step, not_compared=text))
            return
        self.reference_compared.append(result)
        if self._mixed is not None and self._mixed[0] == step:
            measured = unscaled_twice.measure(result, {n: g / divide for n, g in live.items()})
            self.mixed_step_said(step, measured=measured, why_not=result.not_compared or "nothing to compare")
            result.backward_grads = result.reference_grads = None
            return
        made = None
        if hand is not None and backward_only and final_gradients and result.first_stage() is None:
            name = type(optimizer).__name__
            if by_hand:  # nothing unscales a hand-written scale for the optimizer: it takes the gradients as they are
                kept = loss_factors.measure(result, optimizer, self.model, live, by_hand)
                seen = between.read() if kept else None  # the optimizer and its step's line, as the script has them
                made = loss_factors.finding(kept, step, hand.at, name, seen=seen, here=self.here) if kept else None
            elif hand.twice:
                taken = {n: g / divide for n, g in live.items()}
                twice = loss_factors.measure_twice(result, optimizer, self.model, taken, hand.twice)
                made = loss_factors.twice_finding(twice, step, hand.at, name, here=self.here) if twice else None
        if made is not None:
            self.causes.add(made)
            result.backward_grads = result.reference_grads = None
            return
        if backward_only and final_gradients and result.first_stage() is None:
            # an optimizer with an eps in its defaults divides by the gradients' size (Adam, RMSprop, Adagrad)
            adaptive = "eps" in getattr(optimizer, "defaults", {})
            taken = {n: g / divide for n, g in live.items()}
            reference.processed_scaled(result, taken, adaptive=adaptive)
        result.backward_grads = None
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in self.params})
        recipe = f"{'/'.join(dtypes)} parameters" + (f", the loss scaled by a GradScaler ({scale:g})" if scale else "")
        # watch and the callbacks replay the model's own forward, under the autocast it ran under
        recipe += (
            ", the forward as the step ran it (its autocast, if any)"
            if backward_only
            else ", autocast as step_fn sets it"
        )
        made = reference.finding(result, recipe=recipe, here=self.here)
        if made is not None:
            self.causes.add(made)  # a cause seen again at a later reference step adds to its count
        elif result.first_stage() is None and result.not_compared is None and (final_gradients or not backward_only):
            own = {n: g / divide if divide != 1.0 else g for n, g in live.items()} if backward_only else None
            self._update_stages(result, optimizer, divide=divide, recipe=recipe, own=own)
        result.reference_grads = None

    def mixed_step(self, step: int, mixed: Mixed) -> None:
        """watch: this step's gradients were unscaled before its last backward (scaler_order.py). The
        first such step asks for a reference step, which measures what it cost (`_reference_step`)."""
        if self._mixed is None and not self._mixed_said:
            self._mixed = (step, mixed)
            self._reference_asked = True

    def cleared_step(self, step: int, cleared: Cleared | None) -> None:
        """watch: this step's gradients were cleared after its backward (grad_clears.py); one
        finding, counted over the steps it happens on."""
        if cleared is not None:
            self.causes.add(findings.cleared_finding(step, cleared, here=self.here))

    def unscaled_backward(self, step: int, backward_at: Where | None, scale_at: Where | None, *, scaler: Any) -> None:
        """watch: this step's backward ran on the loss scaler.scale() was given, not on what it returned,
        and the scaler stepped: one finding, counted over the steps it happens on."""
        scale = float(amp.scale_tensor(scaler, torch.device("cpu")))  # host read: this step only
        found = findings.unscaled_backward_finding(step, backward_at, scale_at, scale, self.optimizer, here=self.here)
        self.causes.add(found)

    def mixed_step_said(self, step: int, *, measured: unscaled_twice.Measured | None = None, why_not: str) -> None:
        """The finding of the step `mixed_step` noted, once: measured, or with why the reference step
        could not measure it."""
        if self._mixed is None or self._mixed[0] != step:
            return
        mixed, self._mixed, self._mixed_said = self._mixed[1], None, True
        self.causes.add(unscaled_twice.finding(mixed, step, measured=measured, why_not=why_not, here=self.here))

    def _update_stages(
        self,
        result: Comparison,
        optimizer: torch.optim.Optimizer,
        *,
        divide: float,
        recipe: str,
        own: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """The gradients agree: the optimizer's own update now, what the weights keep of it when the
        next step begins (`finish_update`), each against the same optimizer's update of the reference's
        gradients, or of `own` (the step's own gradients, unscaled, in fp32) where given."""
        names = {id(p): n for n, p in named_parameters(self.model)}
        live = {names[id(p)]: p.grad.detach() for p in self.params if p.grad is not None and id(p) in names}
        if own is not None:
            result.update_reference = "own"
        try:
            self._update_pending = reference_update.start(
                result, self.model, optimizer, live=live,
                reference_grads=own if own is not None else result.reference_grads or {}, divide=divide, recipe=recipe,
                watch_now=own is None,
            )  # fmt: skip
        except Exception as exc:  # an optimizer that cannot be copied: said in the report, never raised
            result.update_not_compared = f"the optimizer could not be stepped on copies: {type(exc).__name__}: {exc}"
            return
        made = reference_update.finding(result, recipe=recipe, here=self.here)
        if made is not None:
            self.causes.add(made)

    def watch_update_writes(self) -> None:
        """The optimizer of a reference step judged before it stepped has stepped: from here on the
        writes to the weights are what ran between the steps (watch's post-step hook)."""
        pending = self._update_pending
        if pending is not None and not pending.watch.started:
            pending.watch.start()

    def finish_update(self) -> None:
        """The weights of the last reference step against those before it, once it was applied."""
        pending, self._update_pending = self._update_pending, None
        if pending is None:
            return
        started = time.perf_counter()
        try:
            self._finish_update(pending)
        finally:  # part of the reference step's cost
            spent = time.perf_counter() - started
            self._reference_cost += spent
            self._spent += spent

    def _finish_update(self, pending: reference_update.Pending) -> None:
        step = pending.comparison.step
        outcome = next((h for h in reversed(self.history) if h.step == step), None)
        applied = outcome is not None and outcome.finite and not outcome.skipped
        why = "the step was not applied" if outcome is not None else "the step was not decided"
        try:
            reference_update.finish(pending, self.model, applied=applied, why=why)
            made = reference_update.finding(pending.comparison, recipe=pending.recipe, here=self.here)
        except Exception as exc:  # the observer's own failure: a finding, the training goes on
            pending.watch.stop()
            self.error("comparing the weights with the reference step's update", exc, step)
            return
        if made is not None:
            self.causes.add(made)

    def error(self, doing: str, exc: BaseException, step: int | None = None) -> None:
        """A failure of the observer's own: a finding once per distinct error, never raised."""
        text = f"{type(exc).__name__}: {exc}"
        if (doing, text) in self._errors:
            return
        self._errors.add((doing, text))
        at = step if step is not None else self.steps
        self.findings.append(findings.error_finding(doing, text, at, here=getattr(self, "here", {})))

    def note_once(self, key: tuple[str, str], finding: Finding) -> None:
        """A finding said once per key (a checkpoint that cannot be written, say)."""
        if key in self._errors:
            return
        self._errors.add(key)
        self.findings.append(finding)

    # -- the report ----------------------------------------------------------------------------
    def report(
        self, *, scaled: bool, lines: Sequence[tuple[str, str]] = (), data: dict[str, Any] | None = None
    ) -> Report:
        """The run so far: counts, verdicts, AMP's skips, the timeline; `lines` and `data` are the
        front end's own (its framework, its checkpoint), put first."""
        nonfinite = sum(1 for h in self.history if not h.finite and h.verdict != "amp-skip")
        # the GradScaler's own skips of overflowing gradients are counted on their line, not in these two
        apart = " (the GradScaler's overflow skips apart: below)" if scaled and self.amp.skipped else ""
        summary = [
            *lines,
            ("steps", str(self.steps)),
            ("non-finite steps", f"{nonfinite}{apart}"),
            ("skipped optimizer steps", f"{self.skipped}{apart}"),
            ("last good step", str(self.last_good_step)),
        ]
        out: dict[str, Any] = {
            **(data or {}),
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "nonfinite_steps": nonfinite,
            "skipped_steps": self.skipped,
            "last_good_step": self.last_good_step,
            "verdicts": {h.step: h.verdict for h in self.history if h.verdict and h.verdict != "amp-skip"},
        }
        if self.not_replayed:
            out["not_replayed"] = dict(self.not_replayed)
        if scaled:
            watch = self.amp
            rate = watch.skipped / self.steps if self.steps else 0.0
            out["amp"] = {
                "skipped_steps": watch.skipped,
                "skip_rate": rate,
                "scale": watch.scale,
                "min_scale": watch.min_scale,
            }
            # the scaler's skips of steps whose loss was finite and gradients overflowed; a step with a
            # NaN/Inf loss is counted as non-finite above, whoever skipped it
            summary.append(
                (
                    "AMP overflow skips",
                    f"{watch.skipped} ({rate:.1%}) with a finite loss, scale {watch.scale:g}"
                    if watch.scale is not None
                    else f"{watch.skipped} ({rate:.1%}) with a finite loss",
                )
            )
        line, judged = self._updates.line(), self._updates.data()
        if line is not None and judged is not None:  # low-precision trainable weights: judged or why not
            summary.append(line)
            out["updates"] = judged
        self.finish_update()  # the last reference step's weights, as they are now
        if self.reference_compared or self.reference_off is not None:  # an OK says what it judged, or why not
            pace = None
            if self._reference_last is not None and self._step_times:
                pace = (self._reference_gap(), self._reference_cost, statistics.median(self._step_times))
            line_, out["reference_step"] = reference.summary(
                self.reference_compared, every=self.reference_every, off=self.reference_off, pace=pace
            )
            summary.append(line_)
        if self.progress_judged:  # each flat window and what the experiment from its last step gave
            out["progress"] = list(self.progress_judged)
            summary.append(("progress", _progress_text(self.progress_judged[-1])))
        if self.distributed:  # what the corruption sentinel calibrated, struck and escalated, or why it is off
            line_, out["corruption"] = self.corruption.summary()
            summary.append(line_)
        out["judged"] = self._judged(out)
        summary.insert(0, ("judged", out["judged"]))  # an OK says what it judged, and what it did not
        out["timeline"] = findings.timeline(self.history, self.findings, TIMELINE_POINTS)
        out["summary"] = summary
        found = self._counted_under(findings.causes_first(list(self.findings)))
        if scaled:  # a scale that calibrated down at the start and settled: early skips were no stall
            found = findings.settled(found, self.history, self.amp.scale)
        # a spike still held is judged by what the run did: it ended before the loss came back
        held: list[Finding] = []
        episodes = Causes(held)  # one finding an episode, as _release_spikes adds them
        for finding, episode in self._held:
            episodes.add(finding, episode)
        found += held
        if self._transient:
            found.append(findings.transient_spikes(self._transient, SPIKE_RECOVERY, here=self.here))
        if self.recipe is not None:  # what the optimizer's hyperparameters and wiring did to the updates
            try:
                found += self.recipe.findings(self.steps, self.micro_batches, self.model, self.here)
            except Exception as exc:  # ours: said, the report stands without it
                out.setdefault("not_checked", {})["optimizer recipe"] = f"{type(exc).__name__}: {exc}"[:300]
        if self.is_compiled:
            found = compiled.label_step_findings(found, self.compiled_graphs, self.first_graphs)
        return Report(command="sentinel", findings=found, data=out)

    def _counted_under(self, found: list[Finding]) -> list[Finding]:
        """The reproduced step's finding, with the later non-finite steps of the same symptoms that were
        counted under it without a replay (its "same on N steps" counts the replayed ones only)."""
        counted = sorted(s for s, why in self.not_replayed.items() if why.startswith("the same symptoms"))
        at = next((i for i, f in enumerate(found) if f.name == "deterministic-nonfinite"), None)
        if not counted or at is None:
            return found
        text = (
            f" {len(counted)} later non-finite step(s) with the same symptoms (steps {counted[0]}-{counted[-1]}) "
            "were counted under it without a replay."
        )
        out = list(found)
        out[at] = annotated(found[at], text, {"counted_without_replay": len(counted)})
        return out

    def _judged(self, out: dict[str, Any]) -> str:
        """One sentence: the steps judged and by what, each reference with its measure, and what was
        not judged (a reference step that was off, a run too short for the progress check)."""
        parts = [f"{self.steps} optimizer step(s): the loss and gradients for NaN/Inf"]
        ref = out.get("reference_step")
        if ref is not None and ref["compared_steps"]:
            steps = ", ".join(map(str, ref["compared_steps"][:5])) + (", ..." if len(ref["compared_steps"]) > 5 else "")
            low, high = ref["bounds"]["norm_ratio"]
            parts.append(
                f"the gradients at step(s) {steps} against an fp32 step without autocast or loss scaling "
                f"(norm ratio within [{low:g}, {high:g}], cosine >= {ref['bounds']['cosine_min']:g})"
            )
            if ref.get("update_steps"):
                parts.append(
                    "the optimizer's update and what the weights kept of it at step(s) "
                    + ", ".join(map(str, ref["update_steps"][:5]))
                    + (
                        " against the same optimizer's over fp32 copies of the weights and its state, on the step's "
                        "own gradients"
                        if any(c.update_reference == "own" for c in self.reference_compared)
                        else " against the same optimizer's update of the fp32 step's gradients"
                    )
                )
            elif ref.get("update_not_compared"):
                parts.append(f"the update not compared: {next(iter(ref['update_not_compared'].values()))}")
        elif ref is not None:
            why = ref.get("off") or next(iter(ref["not_compared"].values()), "no step was due")
            parts.append(f"no reference step: {why}")
        if self.progress_window <= 0:
            parts.append("loss progress: off")
        elif not self.progress_windows:
            parts.append(f"loss progress: not judged (it needs {self.progress_window} finite steps)")
        else:
            tried = sum(1 for j in self.progress_judged if "reference" in j)
            # an arm that went non-finite decides nothing: said, so that an OK does not read as judged
            undecided = sum(1 for j in self.progress_judged if "reference" in j and not _finite_arms(j))
            parts.append(
                f"loss progress over {self.progress_windows} window(s): {len(self.progress_judged)} flat, "
                f"{tried} put to an fp32 reference"
                + (f", {undecided} of them undecided: {_UNDECIDED}" if undecided else "")
            )
        if "updates" in out:
            parts.append("the updates of bf16/fp16 weights against what their format keeps")
        # what a step judge cannot see, named so that an OK is not read as covering it
        parts.append(
            "not judged: tensors updated outside the optimizer step (an EMA of the weights, a running "
            "statistic; `fpdoctor trace` redoes those updates)"
        )
        return "; ".join(parts)


# the what-if's own steps, not the run's (which may have none): they step the optimizer on the backward's
# gradients without the script's code between the backward and the step, its clipping too
_UNDECIDED = (
    "the what-if's steps went non-finite (they step the optimizer on the backward's gradients, without your code "
    "between the backward and the step, its clipping too)"
)


def _progress_text(last: dict[str, Any]) -> str:
    """The summary's line for the last flat window and what the experiment from its last step gave."""
    text = f"loss flat over steps {last['window'][0]}-{last['window'][1]}"
    if "reference" in last and "loss_is" in last:
        # an estimate to first order, which can fall past any loss's floor (a cross-entropy below 0):
        # the fall is what it measures, not where the loss lands
        (a, b), (c, d) = last["recipe"], last["reference"]
        past = (
            "; a fall past the loss itself, as an estimate linear in how far the outputs move makes: a comparison "
            "of the two runs, not where the loss lands"
            if a > 0 and max(a - b, c - d) > a
            else ""
        )
        text += (
            f"; {progress.STEPS} steps on its batch, from {a:.4g}: the loss falls by {a - b:.4g} (yours) and "
            f"{c - d:.4g} (an fp32 reference), {last['loss_is']}{past}"
            + (f"; undecided: {_UNDECIDED}" if not _finite_arms(last) else "")
        )
    elif "reference" in last:
        text += (
            f"; {progress.STEPS} steps on its batch: yours {last['recipe'][0]:.4g} -> {last['recipe'][1]:.4g}, "
            f"fp32 reference {last['reference'][0]:.4g} -> {last['reference'][1]:.4g}"
            + (f"; undecided: {_UNDECIDED}" if not _finite_arms(last) else "")
        )
    else:
        text += f"; not put to the reference: {last['not_tried']}"
    return text


def _finite_arms(judged: dict[str, Any]) -> bool:
    """Both arms of a progress experiment stayed finite: only then does it decide anything."""
    return all(math.isfinite(v) for v in (*judged["reference"], *judged["recipe"]))


class JudgedSteps:
    """What a front end shows of its judge's counts: read through, never copied."""

    _judge: StepJudge

    @property
    def steps(self) -> int:
        return self._judge.steps

    @property
    def micro_batches(self) -> int:
        return self._judge.micro_batches

    @property
    def skipped(self) -> int:
        return self._judge.skipped

    @property
    def findings(self) -> list[Finding]:
        return self._judge.findings

    @property
    def history(self) -> list[StepOutcome]:
        return self._judge.history

    @property
    def last_good_step(self) -> int | None:
        return self._judge.last_good_step

    @property
    def should_stop(self) -> bool:
        """A finding at the `stop_on` level was decided: the run should end (the finding is in the report)."""
        return self._judge.live.stopped is not None

    @property
    def stopped_by(self) -> Finding | None:
        """The finding at the `stop_on` level that ended the run, if one did."""
        return self._judge.live.stopped


def _coarse_due(step: int) -> bool:
    """The coarse-format checks' steps: 1, 2, 4, ..., 64, then every 64th."""
    return step % 64 == 0 if step > 64 else not step & (step - 1)


def _close_outputs(outputs: compiled.OutputCheck | None) -> None:
    if outputs is not None:
        with contextlib.suppress(Exception):  # at the end of training: never raised into the user's loop
            outputs.close()
