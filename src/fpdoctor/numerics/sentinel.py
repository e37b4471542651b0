"""The training sentinel: an always-on finite check of loss and gradients that replays bad steps.

Cost per optimizer step: one fused device pass over the gradients that sets a found_inf flag
(`gradcheck`, what GradScaler uses), a device copy of the buffers a forward changes (BatchNorm's
running statistics; none for most models), and one read of a few numbers. With a fused optimizer
on a GPU the read is not waited for: the optimizer is given the flag as `found_inf` and skips a
bad step on the device by itself, the numbers come back asynchronously and are looked at when the
next step starts; a bad step is replayed then, on its own batch and weights (nothing was updated,
its buffers are put back). Elsewhere the numbers are read before `optimizer.step()`.

When a step is not finite it is skipped and replayed under `trace` (`replay`): reproduced means a
numerical bug at the op the trace names; not reproduced means the first run did not compute what
the code asks for: suspect the hardware.

Under `torch.amp.GradScaler` (`scaler=`, or found when step_fn scales the loss itself) the
scaler checks and skips overflowing steps; those are counted, not replayed (`amp`). Under DDP a
communication hook notes each rank's local gradient before the all-reduce and one all-gather on
a bad step names the rank that held it (`distributed`; FSDP: no pre-reduce attribution).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fpdoctor.numerics import amp, checkpoint, distributed
from fpdoctor.numerics import sentinel_findings as findings
from fpdoctor.numerics.control import ControlResult, run_control, wants_control
from fpdoctor.numerics.gradcheck import (
    FlagRead,
    bad_parameters,
    grad_norm,
    grads_of,
    kind_of,
    loss_flag,
    nonfinite_flag,
    skips_on_device,
    tensor_kind,
)
from fpdoctor.numerics.replay import MicroBatch, ReplayResult, replay
from fpdoctor.preserve import BufferSnapshot, RngState, preserved
from fpdoctor.report.model import Finding, Report

SPIKE_WINDOW = 32
TIMELINE_POINTS = 2000  # loss points a report keeps for its plot (events are always kept)
SPIKE_MIN_HISTORY = 8
# A loss more than SPIKE_SIGMAS standard deviations above the recent mean, and at least
# SPIKE_RATIO times it, is a spike: both, so that a flat loss curve's tiny noise does not count.
SPIKE_SIGMAS = 6.0
SPIKE_RATIO = 1.5

# The timeline's gradient norm is one more pass over the gradients: taken on every 10th step it
# costs a tenth of that, and a norm curve keeps its shape.
GRAD_NORM_EVERY = 10

# the numbers read back per optimizer step, in this order
_LOSS, _GRAD, _LOCAL_LOSS, _LOSS_VALUE, _SCALE, _NEXT_SCALE, _GRAD_NORM = range(7)


class _UserRaised(Exception):
    """The user's own optimizer or scaler raised inside the sentinel's bookkeeping: re-raised as is."""

    def __init__(self, original: Exception) -> None:
        super().__init__(str(original))
        self.original = original


def _user(call: Callable[..., Any], *args: Any) -> Any:
    """Call the user's optimizer / scaler; what it raises is the user's and reaches the user once."""
    try:
        return call(*args)
    except Exception as exc:
        raise _UserRaised(exc) from exc


@contextlib.contextmanager
def _steps_of(optimizer: torch.optim.Optimizer, seen: list[torch.optim.Optimizer]) -> Iterator[None]:
    """Note every `optimizer.step()` inside the block (torch's global optimizer hook, removed after:
    nothing is left on the user's optimizer)."""

    def note(opt: Any, args: Any, kwargs: Any) -> None:
        if opt is optimizer:
            seen.append(opt)

    handle = register_optimizer_step_post_hook(note)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class StepOutcome:
    step: int
    loss: float
    finite: bool
    skipped: bool
    verdict: str | None = None  # "deterministic-nonfinite" / "transient-fault-suspected" / "amp-skip"
    grad_norm: float | None = None  # of the unscaled gradients, every GRAD_NORM_EVERY-th step
    scale: float | None = None  # GradScaler's loss scale this step used


@dataclass
class _Pending:
    """One optimizer step between its check on the device and its decision on the host."""

    step: int
    window: list[MicroBatch]
    step_fn: Callable[..., Any]
    flags: FlagRead
    micro_loss_flags: list[torch.Tensor]
    stepped: bool  # the optimizer (or the scaler) has already been given this step
    observed: bool  # step_fn stepped the optimizer itself: the step was applied, the sentinel only looks
    scale: torch.Tensor | None  # the loss scale this step used, for its replay


@dataclass
class Sentinel:
    """Guard a training step: `loss = guard.step(step_fn, *args)`; `guard.report` for the story.

    `step_fn` runs forward and backward and returns the loss; the sentinel calls
    `optimizer.step()` only when loss and gradients are finite. With `accumulate=1` (default)
    gradients are zeroed by `step_fn` as in a plain loop. With `accumulate=N` each call is one
    micro-batch: `step_fn` must only run forward and backward; after every N-th call the sentinel
    checks, steps the optimizer (or skips) and zeroes the gradients (`set_to_none`).

    `scaler=` a `torch.amp.GradScaler`: step_fn calls `scaler.scale(loss).backward()` and returns
    the unscaled loss; the sentinel calls `scaler.step(optimizer)` and `scaler.update()`. A live
    scaler that step_fn uses is found by itself on the first step when `scaler=` is not given.

    Under torch.distributed every rank calls `step` (the decision is agreed across ranks with a
    tiny all-reduce per step). With device-side skipping (fused optimizer on a GPU) the last
    step is decided when the next one starts, by `flush()` (call it on every rank), or, outside
    torch.distributed, when `report` is read.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    replay: bool = True
    checkpoint_path: str | None = None
    checkpoint_every: int = 0
    scaler: Any = field(default=None, kw_only=True)
    accumulate: int = field(default=1, kw_only=True)
    # On a GPU: read its health (NVML, kernel log) at the start and on a fault that does not
    # reproduce, to say what changed on it (new Xids, ECC errors) - two reads per job, none per step.
    gpu_health: bool = field(default=True, kw_only=True)
    steps: int = field(default=0, init=False)
    micro_batches: int = field(default=0, init=False)
    skipped: int = field(default=0, init=False)
    findings: list[Finding] = field(default_factory=list, init=False)
    history: list[StepOutcome] = field(default_factory=list, init=False)
    last_good_step: int | None = field(default=None, init=False)
    checkpoint_step: int | None = field(default=None, init=False)  # the step of the checkpoint last written

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must be >= 0")
        if self.checkpoint_every and not self.checkpoint_path:
            raise ValueError("checkpoint_every needs checkpoint_path")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(
                f"accumulate must be an int >= 1 (micro-batches per optimizer step), got {self.accumulate!r}"
            )
        if self.scaler is not None:
            if not hasattr(self.scaler, "scale") or not hasattr(self.scaler, "update"):
                raise ValueError("scaler must be a torch.amp.GradScaler")
            if self.optimizer is None:
                raise ValueError("scaler= needs the optimizer: the sentinel calls scaler.step(optimizer)")
        self._params: list[torch.Tensor] = [p for p in self.model.parameters() if p.requires_grad]
        self._device = self._params[0].device if self._params else torch.device("cpu")
        self._losses: deque[float] = deque(maxlen=SPIKE_WINDOW)
        self._buffers = BufferSnapshot(self.model)
        self._window: list[MicroBatch] = []
        self._micro_flags: list[torch.Tensor] = []
        self._micro_losses: list[torch.Tensor] = []
        self._pending: _Pending | None = None
        self._errors: set[tuple[str, str]] = set()
        self._in_window = 0  # micro-batches of the current window seen so far
        self._stepped = False
        self._stepped_inside = False  # step_fn called optimizer.step() itself in the current window
        self._told_observing = False
        self._decided = False  # this step's verdict (step or skip) is taken: never step it blindly after
        self._amp = amp.ScaleWatch()
        self._scaler_searched = self.scaler is not None
        self._watch: distributed.BucketWatch | None = None
        self._distributed = False
        try:
            self._distributed = distributed.active()
            self._watch = distributed.BucketWatch.install(self.model)
        except Exception as exc:
            self._error("installing the DDP gradient hook", exc)
        # A fused optimizer takes the check's flag as found_inf and skips on the device; on a GPU
        # the host then need not wait for the flag before optimizer.step().
        self._device_skip = self._device.type == "cuda" and skips_on_device(self.optimizer)
        # where every finding of this rank happened, under torch.distributed (rank, host, device)
        self._here: dict[str, Any] = {}
        if self._distributed:
            try:
                self._here = findings.place(distributed.describe(self._device))
            except Exception as exc:
                self._error("describing this rank", exc)
        # The GPU's health now, to say on a transient fault what changed on it since (Xid, ECC).
        self._health: Any = None
        if self.gpu_health and self._device.type == "cuda":
            try:
                from fpdoctor.health import watch

                uuid = distributed.describe(self._device).get("uuid")
                self._health = watch.start(uuid) if uuid else None
            except Exception as exc:
                self._error("reading the GPU's health", exc)
        self._weights_bad = False  # the parameters themselves are non-finite: steps cannot recover
        try:
            eps = findings.optimizer_eps_finding(self.optimizer, with_scaler=self.scaler is not None, here=self._here)
            if eps is not None:
                self.findings.append(eps)
        except Exception as exc:
            self._error("looking at the optimizer's settings", exc)

    # -- the always-on part --------------------------------------------------------------------
    def step(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one micro-batch (one step when accumulate=1) of `step_fn` under the guard."""
        rng = None
        self.flush()  # a step decided on the device is looked at before the next one runs
        try:
            if self._in_window == 0:
                self._buffers.capture()
                if self._watch is not None:
                    self._watch.begin()
            rng = RngState.capture()
        except Exception as exc:
            self._error("preparing the step", exc)
        self._in_window += 1
        ends = self._in_window >= self.accumulate
        if ends:
            self.steps += 1  # counted whether or not the check below works
        scalers: list[Any] = []
        looking = not self._scaler_searched and self.optimizer is not None
        spying = contextlib.ExitStack()
        if looking:
            try:
                spying.enter_context(amp.spy(scalers))
            except Exception as exc:  # no GradScaler to look for in this torch: the step goes on
                self._error("looking for a GradScaler", exc)
        inner: list[torch.optim.Optimizer] = []
        if self.optimizer is not None:
            try:
                spying.enter_context(_steps_of(self.optimizer, inner))
            except Exception as exc:
                self._error("watching for optimizer steps inside step_fn", exc)
        scale_before = amp.scale_version(self.scaler)
        try:
            with spying:
                loss = step_fn(*args, **kwargs)  # the user's own errors are the user's
        except BaseException:
            self._in_window -= 1  # the call did not happen, as far as the window is concerned
            self.steps -= ends
            raise
        if looking:
            self._scaler_searched = True
            if len(scalers) == 1:
                self.scaler = scalers[0]
        self.micro_batches += 1
        self._stepped = self._decided = False
        # step_fn stepped the optimizer, or updated the scaler (whose step may have skipped the optimizer)
        try:
            updated = amp.updated_since(self.scaler, scale_before)
        except Exception as exc:
            updated = False
            self._error("watching for scaler updates inside step_fn", exc)
        self._stepped_inside = self._stepped_inside or bool(inner) or updated
        try:
            self._after(step_fn, rng, args, kwargs, loss, ends=ends)
        except _UserRaised as raised:  # the user's optimizer raised: theirs, once, as it was
            if ends:
                self._window, self._micro_flags, self._micro_losses, self._in_window = [], [], [], 0
            raise raised.original from None
        except Exception as exc:  # the observer never kills the job
            self._error("checking the step", exc)
            if ends:
                self._window, self._micro_flags, self._micro_losses, self._in_window = [], [], [], 0
                if not self._stepped and not self._decided:  # no verdict yet: the step goes on unguarded
                    self._unguarded_step()
                if self.accumulate > 1 or (self._decided and not self._stepped):  # a skipped step leaves no gradient
                    self._zero_grads()
        return loss

    def flush(self) -> None:
        """Decide the step whose flag is still on its way (device-side skipping). Under
        torch.distributed every rank must call it, as every rank calls `step`."""
        try:
            if self._pending is not None:
                self._resolve(self._pending)
        except _UserRaised as raised:
            raise raised.original from None
        except Exception as exc:
            self._error("deciding the last step", exc)

    def _after(
        self, step_fn: Callable[..., Any], rng: RngState | None, args: Any, kwargs: Any, loss: Any, *, ends: bool
    ) -> None:
        """Check a micro-batch; at the end of a window, check and step (or skip)."""
        if rng is None:
            raise RuntimeError("the RNG state could not be captured before the step")
        loss_t = torch.as_tensor(loss) if not isinstance(loss, torch.Tensor) else loss
        if not loss_t.is_floating_point() and not loss_t.is_complex():
            raise TypeError(
                f"step_fn must return the loss (a floating-point tensor or number), got {type(loss).__name__}"
            )
        self._window.append(MicroBatch(rng, args, dict(kwargs)))
        self._micro_flags.append(loss_flag(loss_t, self._device))
        self._micro_losses.append(loss_t.detach().float().mean().to(self._device))
        if not ends:
            return
        window, micro_flags, micro_losses = self._window, self._micro_flags, self._micro_losses
        self._window, self._micro_flags, self._micro_losses, self._in_window = [], [], [], 0
        observed, self._stepped_inside = self._stepped_inside, False
        if observed:  # stepping again would apply the update twice: from here on the sentinel only looks
            self._stepped = True
            if not self._told_observing:
                self._told_observing = True
                self.findings.append(findings.observing_finding(self.steps, here=self._here))
        local_loss = torch.stack(micro_flags).amax()
        loss_value = torch.stack(micro_losses).mean()
        scaler = self.scaler if amp.enabled(self.scaler) and not observed else None
        stepped = False
        scale = next_scale = torch.full((), float("nan"), device=self._device)
        if scaler is not None:
            assert self.optimizer is not None
            scale = amp.scale_tensor(scaler, self._device)
            if not amp.stepped(scaler, self.optimizer):
                self._stepped = True  # given to the scaler: whatever happens next, never stepped twice
                _user(scaler.step, self.optimizer)  # the scaler checks the gradients and skips on overflow
                grad = amp.found_inf(scaler, self.optimizer, self._device)
                _user(scaler.update)
            else:  # step_fn stepped the scaler itself
                grad = amp.found_inf(scaler, self.optimizer, self._device)
            if grad is None:
                grad = nonfinite_flag(grads_of(self._params), self._device)
            next_scale = amp.scale_tensor(scaler, self._device)
            stepped = True
        else:
            grad = nonfinite_flag(grads_of(self._params), self._device)
        agreed = torch.stack([local_loss, grad])
        if self._distributed:
            agreed = distributed.all_max(agreed)  # every rank skips, or none: replicas stay equal
        # after the scaler's step the gradients are unscaled (GradScaler unscales before it steps)
        norm = (
            grad_norm(grads_of(self._params), self._device)
            if (self.steps - 1) % GRAD_NORM_EVERY == 0  # steps 1, 11, 21, ...: the first one too
            else torch.full((), float("nan"), device=self._device)
        )
        flags = torch.cat([agreed, torch.stack([local_loss, loss_value, scale, next_scale, norm])])
        # on its way to the host before the optimizer's kernels are queued: the next step waits
        # (if at all) for this check to finish, not for the optimizer
        read = FlagRead(flags)
        if scaler is None and self._device_skip and self.optimizer is not None and not observed:
            opt: Any = self.optimizer
            opt.found_inf = agreed.amax()  # the GradScaler protocol of fused optimizers: skip on the device
            stepped = self._stepped = True
            try:
                _user(opt.step)
            finally:
                del opt.found_inf
        pending = _Pending(
            self.steps,
            window,
            step_fn,
            read,
            micro_flags,
            stepped or observed,
            observed,
            scale if scaler is not None else None,
        )
        if stepped and self._device_skip:
            self._pending = pending  # decided when the next step starts (or at flush)
        else:
            self._resolve(pending)

    def _resolve(self, pending: _Pending) -> None:
        self._pending = None
        values = pending.flags.values()
        step = pending.step
        bad_loss, bad_grad, local_loss = values[_LOSS] > 0, values[_GRAD] > 0, values[_LOCAL_LOSS] > 0
        loss_value, scale, next_scale = values[_LOSS_VALUE], values[_SCALE], values[_NEXT_SCALE]
        outcome = StepOutcome(step, loss_value, finite=not (bad_loss or bad_grad), skipped=False)
        scaled = pending.scale is not None
        outcome.scale = scale if scaled else None
        outcome.grad_norm = None if math.isnan(values[_GRAD_NORM]) else values[_GRAD_NORM]
        self.history.append(outcome)
        if scaled and bad_grad and not bad_loss:  # an overflow the scaler skipped: AMP's business
            outcome.skipped, outcome.verdict = True, "amp-skip"
            if self._amp.observe(True, next_scale):
                self._collapse(pending, scale, next_scale)
            self._spike(step, loss_value)
            if self.accumulate > 1:
                self._zero_grads()
            return
        if scaled and not bad_grad:
            self._amp.observe(False, next_scale)
        elif scaled:  # a NaN loss the scaler skipped: counted as non-finite, not as an AMP overflow
            self._amp.scale = next_scale
        self._decided = True  # from here on a failure of ours never applies this step
        if outcome.finite:
            if not pending.stepped and self.optimizer is not None:
                self._stepped = True
                _user(self.optimizer.step)
            if self.accumulate > 1:
                self._zero_grads()
            self.last_good_step = step
            self._spike(step, loss_value)
            if self.checkpoint_every and step % self.checkpoint_every == 0:
                self._save_checkpoint(step)
            return
        outcome.skipped = (bad_grad or not scaled) and not pending.observed  # a scaler steps on a bad loss
        if pending.observed:  # applied already by step_fn: reported, not replayed (its weights are gone)
            if bad_grad and not bad_loss and amp.enabled(self.scaler):  # step_fn's scaler skipped it
                outcome.skipped, outcome.verdict = True, "amp-skip"
                scale_now = float(self.scaler.get_scale())  # a host read, on a skipped step only
                if self._amp.observe(True, scale_now):
                    self.findings.append(
                        findings.collapse_finding(step, self._amp, self.steps, scale_now, scale_now, here=self._here)
                    )
                return
            self._attribute(pending, bad_loss, local_loss, loss_value)
            return
        if outcome.skipped:
            self.skipped += 1
            self._buffers.restore()  # the bad forward's buffer writes (BatchNorm statistics) undone
        if self._weights_bad or self._weights_went_bad(step):  # said once; no replay can change it
            self._zero_grads()
            return
        faulty, kind = self._attribute(pending, bad_loss, local_loss, loss_value)
        if self.replay:
            outcome.verdict = self._replay(pending, kind, faulty=faulty)
        self._zero_grads()

    # -- findings ------------------------------------------------------------------------------
    def _attribute(
        self, pending: _Pending, bad_loss: bool, local_loss: bool, loss_value: float
    ) -> tuple[bool, str | None]:
        """Report the bad step; whether this rank holds (or may hold) the fault, and its kind
        (nan / +inf / -inf) as this rank saw it."""
        step = pending.step
        me = distributed.describe(self._device)
        micro = None
        if local_loss:
            micro_values = torch.stack(pending.micro_loss_flags).tolist()
            micro = next((i for i, v in enumerate(micro_values, start=1) if v > 0), None)  # from 1, as steps
        local = {
            **me,
            "loss_bad": local_loss,
            "loss_kind": kind_of(loss_value) if local_loss and not math.isfinite(loss_value) else None,
            "micro_batch": micro,
            "faults": self._watch.local_faults() if self._watch is not None else None,
            "parameters": [] if self._watch is not None else self._bad_parameters(),
        }
        kind = findings.step_kind(local)
        ranks = distributed.agree(local) if self._distributed else [local]
        attributed = [r for r in ranks if r.get("loss_bad") or r.get("faults")]
        for r in attributed or ([] if self._distributed else ranks):
            self._report_rank(step, r, pending)
        if self._distributed and not attributed:
            if kind is None:  # no pre-reduce view: the reduced gradients' kind (host reads, bad steps only)
                kind = findings.step_kind({"parameters": self._bad_parameters()})
            views = "FSDP or a communication hook of your own"
            self.findings.append(
                findings.unattributed_finding(step, kind, len(self._params), views=views, here=self._here)
            )
            return True, kind
        if not self._distributed:
            return True, kind
        return any(r.get("rank") == me.get("rank") for r in attributed), kind

    def _report_rank(self, step: int, r: dict[str, Any], pending: _Pending) -> None:
        self.findings.append(
            findings.rank_finding(
                step,
                r,
                micro_batches=self.accumulate > 1,
                scaled=pending.scale is not None,
                numel=len(self._params),
                applied=pending.observed,
            )
        )

    def _weights_went_bad(self, step: int) -> bool:
        """On a bad step: are the parameters themselves non-finite (an earlier update put NaN/Inf
        in them)? Then one finding names the last applied step, and no step is replayed after."""
        bad = [
            (name, kind, p)
            for name, p in self.model.named_parameters()
            if (kind := tensor_kind(p.detach())) is not None
        ]
        anywhere = bool(bad)
        if self._distributed:  # sharded weights (FSDP) differ by rank: every rank takes the same path
            flag = torch.tensor([float(anywhere)], device=self._device)
            anywhere = bool(distributed.all_max(flag).item())
        if not anywhere:
            return False
        self._weights_bad = True
        if not bad:  # another rank's shard holds them
            return True
        self.findings.append(
            findings.weights_finding(step, self.last_good_step, bad, len(self._params), here=self._here)
        )
        return True

    def _bad_parameters(self) -> list[tuple[str, str]]:
        return bad_parameters(self.model)

    def _replay(self, pending: _Pending, kind: str | None, *, faulty: bool = True) -> str:
        """Replay the step; the verdict is this rank's when it holds (or may hold) the fault.

        Under torch.distributed every rank replays its whole window, so that every collective in
        it (a step_fn's own, DDP's first-iteration bucket rebuild, SyncBatchNorm's) is issued on
        every rank in the same order; gradients stay local (`local_replay`). Then every rank
        receives every faulty rank's verdict, so all reports say the same."""
        result = replay(
            self.model, self._params, pending.step_fn, pending.window, self._contexts(pending), whole=self._distributed
        )
        control = None
        if faulty and not self._distributed and result.verdict == "deterministic-nonfinite":
            dtype = (result.culprit.evidence.get("dtype") if result.culprit else None) or result.evidence.get("dtype")
            if wants_control(dtype, self.model):
                control = run_control(
                    self.model, self._params, pending.step_fn, pending.window, self._contexts(pending)
                )
        mine = self._verdict_findings(pending.step, result, kind, control) if faulty else []
        if not self._distributed:
            self.findings.extend(mine)
            return result.verdict
        everyone = distributed.agree({"verdict": result.verdict if faulty else None, "findings": mine})
        for entry in everyone:
            self.findings.extend(entry.get("findings") or [])
        verdicts = [e.get("verdict") for e in everyone if e.get("verdict") is not None]
        return result.verdict if faulty else str(verdicts[0]) if verdicts else "not-replayed"

    def _contexts(self, pending: _Pending) -> list[contextlib.AbstractContextManager[Any]]:
        """What a replay of `pending` runs under; made anew for each replay (each is entered once)."""
        contexts: list[contextlib.AbstractContextManager[Any]] = [distributed.local_replay(self.model)]
        if pending.scale is not None:
            contexts.append(amp.scale_as(self.scaler, pending.scale))
        return contexts

    def _verdict_findings(
        self, step: int, result: ReplayResult, kind: str | None, control: ControlResult | None = None
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
            step, result, me, micro_batches=self.accumulate > 1, kind=kind, control=control, health=health
        )

    def _collapse(self, pending: _Pending, scale: float, next_scale: float) -> None:
        self.findings.append(
            findings.collapse_finding(pending.step, self._amp, self.steps, scale, next_scale, here=self._here)
        )
        if self.replay and not self._distributed:  # name the op that overflows, once per collapse
            with preserved(self.model):  # from the step's own buffers; the run keeps its own after
                self._buffers.restore()
                result = replay(
                    self.model,
                    self._params,
                    pending.step_fn,
                    pending.window,
                    [amp.scale_as(self.scaler, pending.scale)],
                )
            self.findings.extend(self._verdict_findings(pending.step, result, "+inf"))

    def _spike(self, step: int, loss_value: float) -> None:
        if not math.isfinite(loss_value):  # a NaN in the history would switch spike detection off
            return
        history = self._losses
        if len(history) >= SPIKE_MIN_HISTORY:
            mean = statistics.fmean(history)
            spread = statistics.pstdev(history)
            if loss_value > mean + SPIKE_SIGMAS * spread and loss_value > SPIKE_RATIO * abs(mean):
                spike = findings.spike_finding(step, loss_value, mean, spread, len(history), here=self._here)
                self.findings.append(spike)
        history.append(loss_value)

    def _error(self, doing: str, exc: BaseException, step: int | None = None) -> None:
        """A failure of the sentinel's own: a finding once per distinct error, never raised."""
        text = f"{type(exc).__name__}: {exc}"
        if (doing, text) in self._errors:
            return
        self._errors.add((doing, text))
        at = step if step is not None else self.steps
        self.findings.append(findings.error_finding(doing, text, at, here=getattr(self, "_here", {})))

    # -- stepping without a verdict ------------------------------------------------------------
    def _unguarded_step(self) -> None:
        if self.optimizer is None:
            return
        if amp.enabled(self.scaler):
            if not amp.stepped(self.scaler, self.optimizer):
                self.scaler.step(self.optimizer)
                self.scaler.update()
        else:
            self.optimizer.step()

    def _zero_grads(self) -> None:
        for p in self._params:
            p.grad = None

    def _save_checkpoint(self, step: int) -> None:
        assert self.checkpoint_path is not None
        try:
            checkpoint.atomic_save(self.checkpoint_path, self.model, self.optimizer, step)
            self.checkpoint_step = step
        except Exception as exc:  # a checkpoint we cannot write never stops the training
            text = f"{type(exc).__name__}: {exc}"
            key = ("checkpoint", f"{type(exc).__name__} {getattr(exc, 'errno', '')}")  # not the temp file's name
            if key in self._errors:
                return
            self._errors.add(key)
            self.findings.append(findings.checkpoint_finding(step, self.checkpoint_path, text, here=self._here))

    @property
    def report(self) -> Report:
        if self._pending is not None and not self._distributed:
            self.flush()
        nonfinite = sum(1 for h in self.history if not h.finite and h.verdict != "amp-skip")
        summary = [
            ("steps", str(self.steps)),
            ("non-finite steps", str(nonfinite)),
            ("skipped optimizer steps", str(self.skipped)),
            ("last good step", str(self.last_good_step)),
        ]
        data: dict[str, Any] = {
            "steps": self.steps,
            "micro_batches": self.micro_batches,
            "nonfinite_steps": nonfinite,
            "skipped_steps": self.skipped,
            "last_good_step": self.last_good_step,
            "verdicts": {h.step: h.verdict for h in self.history if h.verdict and h.verdict != "amp-skip"},
        }
        if self._pending is not None:
            data["undecided_step"] = self._pending.step
        if self.scaler is not None:
            watch = self._amp
            rate = watch.skipped / self.steps if self.steps else 0.0
            data["amp"] = {
                "skipped_steps": watch.skipped,
                "skip_rate": rate,
                "scale": watch.scale,
                "min_scale": watch.min_scale,
            }
            summary.append(("AMP overflow skips", f"{watch.skipped} ({rate:.1%}), scale {watch.scale}"))
        if self.checkpoint_path:
            written = self.checkpoint_step is not None
            text = f"{self.checkpoint_path} (step {self.checkpoint_step})" if written else "none written"
            summary.append(("last-good checkpoint", text))
            data["checkpoint_step"] = self.checkpoint_step
        data["timeline"] = findings.timeline(self.history, self.findings, TIMELINE_POINTS)
        data["summary"] = summary
        return Report(command="sentinel", findings=list(self.findings), data=data)
