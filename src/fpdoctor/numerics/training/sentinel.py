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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fpdoctor.numerics.observe import amp, dynamo
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.observe.gradcheck import (
    FlagRead,
    grad_norm,
    grads_of,
    loss_flag,
    nonfinite_flag,
    skip_on_device,
    skips_on_device,
)
from fpdoctor.numerics.trace.scaled_grads import ScaledGrads
from fpdoctor.numerics.training import checkpoint, distributed, findings, progress, reference
from fpdoctor.numerics.training.coarse_output import ModelOutputs
from fpdoctor.numerics.training.judge import (  # re-exported: the sentinel's public constants
    SPIKE_MIN_HISTORY,
    SPIKE_RATIO,
    SPIKE_SIGMAS,
    SPIKE_WINDOW,
    TIMELINE_POINTS,
    JudgedSteps,
    StepFacts,
    StepJudge,
    StepOutcome,
)
from fpdoctor.numerics.training.live import Live, stop_level
from fpdoctor.numerics.updates.measure import EVERY, GradAccumulation, UpdateProbe, UpdateSample, UpdateStats
from fpdoctor.numerics.updates.whatif import WHAT_IF_STEPS
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Report

__all__ = [
    "GRAD_NORM_EVERY",
    "SPIKE_MIN_HISTORY",
    "SPIKE_RATIO",
    "SPIKE_SIGMAS",
    "SPIKE_WINDOW",
    "TIMELINE_POINTS",
    "Sentinel",
    "StepOutcome",
]

# The timeline's gradient norm is one more pass over the gradients: taken on every 10th step it
# costs a tenth of that, and a norm curve keeps its shape.
GRAD_NORM_EVERY = 10

# the numbers read back per optimizer step, in this order
_LOSS, _GRAD, _LOCAL_LOSS, _LOSS_VALUE, _SCALE, _NEXT_SCALE, _GRAD_NORM = range(7)


_UNSET: dict[torch.device, torch.Tensor] = {}  # per device, made once: NaN, a slot of the flags not read this step


def _unset(device: torch.device) -> torch.Tensor:
    """A 0-d float32 NaN on `device`, made once (a kernel launch fewer per slot per step on a GPU); only
    ever read (stacked into the step's flags), never written."""
    unset = _UNSET.get(device)
    if unset is None:
        unset = _UNSET[device] = torch.full((), float("nan"), device=device)
    return unset


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
        if opt is optimizer and not dynamo.compiling():  # traced by Dynamo: inlined as nothing
            seen.append(opt)

    handle = register_optimizer_step_post_hook(note)
    try:
        yield
    finally:
        handle.remove()


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
    # the user's own GradScaler steps the user's optimizer after guard.step: the step's gradients are
    # left for it (it skips an overflow itself; without gradients its step() would raise)
    hands_off: bool = False
    # the step whose non-finite gradients were still in .grad when this one began, and its loss scale
    carried: tuple[int, float | None] | None = None
    outputs: list[torch.Tensor] = field(default_factory=list)  # the model's, where their format is checked


@dataclass
class Sentinel(JudgedSteps):
    """Guard a training step: `loss = guard.step(step_fn, *args)`; `guard.report` for the story.

    `step_fn` runs forward and backward and returns the loss; the sentinel calls
    `optimizer.step()` only when loss and gradients are finite. With `accumulate=1` (default)
    gradients are zeroed by `step_fn` as in a plain loop. With `accumulate=N` each call is one
    micro-batch: `step_fn` must only run forward and backward; after every N-th call the sentinel
    checks, steps the optimizer (or skips) and zeroes the gradients (`set_to_none`).

    `scaler=` a `torch.amp.GradScaler`: step_fn calls `scaler.scale(loss).backward()` and returns
    the unscaled loss; the sentinel calls `scaler.step(optimizer)` and `scaler.update()`. A live
    scaler that step_fn uses is found by itself on the first step when `scaler=` is not given.

    The first step, and every `reference_every`-th after, is compared with the same step computed
    in fp32 without autocast or loss scaling, from the same weights, batch and RNG (`reference`):
    step_fn runs twice more there, on copies of the parameters, as it does when a bad step is
    replayed; so step_fn must only compute (forward, backward, clipping), never step anything.

    With bf16/fp16 trainable weights, every `check_updates`-th step is measured on a sample for
    updates the dtype rounds away and accumulators that stop growing (`updates`); the fix is tried
    once by a `what_if_steps` what-if run on stand-in copies (`update_whatif`).

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
    # Skip a bad step on the device (a fused optimizer given the check's flag as found_inf) and
    # read the flag when the next step starts. None: where the optimizer can and the model is on a GPU.
    device_skip: bool | None = field(default=None, kw_only=True)
    # bf16/fp16 trainable weights: measure what every N-th optimizer step did to a sample of them
    # (updates rounded away, low-precision optimizer state and .grad accumulation); 0: off
    check_updates: int = field(default=EVERY, kw_only=True)
    # when updates are rounded away, try fp32 master weights for this many steps on copies, once; 0: off
    what_if_steps: int = field(default=WHAT_IF_STEPS, kw_only=True)
    # compare the first step and every N-th after with the same step in fp32, no autocast, no loss
    # scaling (reference.py): step_fn runs twice more on those steps, on copies of the parameters; 0: off
    reference_every: int = field(default=reference.EVERY, kw_only=True)
    # every N finite steps a loss no better in the window's second half than in its first is put to the
    # experiment: 8 steps on the step's batch in your recipe and in fp32 (progress.py); 0: off
    progress_window: int = field(default=progress.WINDOW, kw_only=True)
    # "error" or "warning": the first finding at that level sets `should_stop` (for the loop to end, in CI);
    # every finding is said on stderr as it is decided, whatever this says
    stop_on: str | None = field(default=None, kw_only=True)
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
        if not isinstance(self.check_updates, int) or self.check_updates < 0:
            raise ValueError(f"check_updates must be an int >= 0 (every N-th step; 0: off), got {self.check_updates!r}")
        reference.check_every(self.reference_every)
        if not isinstance(self.progress_window, int) or self.progress_window < 0 or 0 < self.progress_window < 4:
            raise ValueError(f"progress_window must be 0 (off) or an int >= 4 steps, got {self.progress_window!r}")
        if not isinstance(self.what_if_steps, int) or self.what_if_steps < 0:
            raise ValueError(f"what_if_steps must be an int >= 0, got {self.what_if_steps!r}")
        if self.device_skip and not skips_on_device(self.optimizer):
            raise ValueError("device_skip=True needs an optimizer that takes found_inf (a fused one)")
        stop_on = stop_level(self.stop_on)
        # the decisions are the step judge's; this class collects what happened in the user's loop
        self._judge = StepJudge(
            self.model,
            hooked=self.model,
            optimizer=self.optimizer,
            replay=self.replay,
            with_scaler=self.scaler is not None,
            views="FSDP or a communication hook of your own",
            gpu_health=self.gpu_health,
            what_if_steps=self.what_if_steps,
            live=Live(stop_on=stop_on),
        )
        self._judge.reference_every = self.reference_every
        self._judge.progress_window = self.progress_window
        self._params = self._judge.params
        self._device = self._judge.device
        self._window: list[MicroBatch] = []
        self._micro_flags: list[torch.Tensor] = []
        self._micro_losses: list[torch.Tensor] = []
        self._pending: _Pending | None = None
        self._in_window = 0  # micro-batches of the current window seen so far
        # a step the GradScaler skipped leaves its non-finite gradients in .grad (as a plain loop does):
        # (step, scale) of the first such step until step_fn is seen to zero them; checked at the next
        # step's start (a host read after a skipped step only), carried into that step's facts
        self._left: tuple[int, float | None] | None = None
        self._carried: tuple[int, float | None] | None = None
        self._stepped = False
        self._stepped_inside = False  # step_fn called optimizer.step() itself in the current window
        self._told_observing = False
        self._scaler_searched = self.scaler is not None
        self._penalty = False  # step_fn differentiates an output a GradScaler scaled (a gradient penalty)
        # A fused optimizer takes the check's flag as found_inf and skips on the device; on a GPU
        # the host then need not wait for the flag before optimizer.step().
        if self.device_skip is None:
            self.device_skip = self._device.type == "cuda" and skips_on_device(self.optimizer)
        self._updates: UpdateProbe | None = None
        self._grad_sums: GradAccumulation | None = None
        # step_fn computes the loss: the model's outputs, on the steps their format is checked (coarse_output.py),
        # come from hooks put on for that step alone
        self._outputs = ModelOutputs(self.model) if not self._judge.is_compiled else None
        self._hooked: list[torch.Tensor] = []
        self._grad_rows: list[tuple[str, str, int, float, float]] = []
        self._measured: UpdateStats | None = None
        if self.check_updates and self.optimizer is not None:
            try:
                probe = UpdateProbe(self.model, self.optimizer, every=self.check_updates)
                if probe.low_precision:
                    self._updates = probe
                    why = probe.why_not or (
                        "the optimizer is stepped on the device (device-side skipping)" if self.device_skip else None
                    )
                    if why is not None:
                        self._updates = None
                        stats = UpdateStats(0, type(self.optimizer).__name__, why_not=why)
                        self._judge.updates(stats, every=self.check_updates)
                    else:
                        self._judge.expects_updates = True  # the last finite window kept for the what-if
                        if self.accumulate > 1:
                            self._grad_sums = GradAccumulation(probe)
            except Exception as exc:
                self._judge.error("preparing the update checks", exc)

    # -- the always-on part --------------------------------------------------------------------
    def step(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one micro-batch (one step when accumulate=1) of `step_fn` under the guard."""
        judge = self._judge
        rng = None
        self.flush()  # a step decided on the device is looked at before the next one runs
        try:
            if self._in_window == 0:
                judge.begin_window()
                self._carried = self._still_left()
                if self._grad_sums is not None and self._grad_sums.probe.due(judge.steps + 1):
                    self._grad_sums.start()  # this window's micro-batch gradients, summed in fp32 on the sample
                self._hooked = []  # a window that never ended keeps nothing into the next
            rng = RngState.capture()
        except Exception as exc:
            judge.error("preparing the step", exc)
        self._in_window += 1
        ends = self._in_window >= self.accumulate
        if ends:
            judge.steps += 1  # counted whether or not the check below works
        scalers: list[Any] = []
        looking = not self._scaler_searched
        spying = contextlib.ExitStack()
        if looking:
            try:
                spying.enter_context(amp.spy(scalers))
            except Exception as exc:  # no GradScaler to look for in this torch: the step goes on
                judge.error("looking for a GradScaler", exc)
        inner: list[torch.optim.Optimizer] = []
        if self.optimizer is not None:
            try:
                spying.enter_context(_steps_of(self.optimizer, inner))
            except Exception as exc:
                judge.error("watching for optimizer steps inside step_fn", exc)
        if (self.scaler is not None or looking) and not self._penalty:
            try:  # a gradient penalty on scaled gradients: its overflows may be the scaler's calibration
                penalty = spying.enter_context(ScaledGrads(lambda: 0, reads=False))
                spying.callback(lambda: setattr(self, "_penalty", bool(penalty.calls)))
            except Exception as exc:
                judge.error("looking for a gradient penalty", exc)
        scale_before = amp.scale_version(self.scaler)
        outputs = self._outputs if self._outputs is not None and judge.outputs_due(judge.steps + (not ends)) else None
        taken: list[torch.Tensor] = []
        try:
            if outputs is not None:  # the model's outputs, for this call of step_fn alone (coarse_output.py)
                try:
                    outputs.start()
                except Exception as exc:
                    outputs = None
                    judge.error("watching the model's outputs", exc)
            with spying:
                loss = step_fn(*args, **kwargs)  # the user's own errors are the user's
        except BaseException:
            if self._grad_sums is not None:
                self._grad_sums.stop()
            self._in_window -= 1  # the call did not happen, as far as the window is concerned
            judge.steps -= ends
            raise
        finally:
            if outputs is not None:  # off as soon as step_fn returns or raises: nothing of ours outlives it
                taken = outputs.take()
        self._hooked += taken
        if looking:
            self._scaler_searched = True
            if len(scalers) == 1:
                self.scaler = scalers[0]
        judge.micro_batches += 1
        self._stepped = False
        if ends and self._grad_sums is not None:
            try:
                self._grad_rows = self._grad_sums.finish() or []
            except Exception as exc:
                judge.error("measuring the gradient accumulation", exc)
        # step_fn stepped the optimizer, or updated the scaler (whose step may have skipped the optimizer)
        try:
            updated = amp.updated_since(self.scaler, scale_before)
        except Exception as exc:
            updated = False
            judge.error("watching for scaler updates inside step_fn", exc)
        self._stepped_inside = self._stepped_inside or bool(inner) or updated
        try:
            self._after(step_fn, rng, args, kwargs, loss, ends=ends)
        except _UserRaised as raised:  # the user's optimizer raised: theirs, once, as it was
            if ends:
                self._window, self._micro_flags, self._micro_losses, self._in_window = [], [], [], 0
            raise raised.original from None
        except Exception as exc:  # the observer never kills the job
            judge.error("checking the step", exc)
            if ends:
                self._window, self._micro_flags, self._micro_losses, self._in_window = [], [], [], 0
                decided = judge.decided == judge.steps
                if not self._stepped and not decided:  # no verdict yet: the step goes on unguarded
                    self._unguarded_step()
                if self.accumulate > 1 or (decided and not self._stepped):  # a skipped step leaves no gradient
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
            self._judge.error("deciding the last step", exc)

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
                self._judge.findings.append(findings.observing_finding(self.steps, here=self._judge.here))
        if not observed and self.optimizer is not None and self._judge.reference_due(self.steps):
            try:  # before the optimizer takes the gradients: what it receives, against the reference's
                self._judge.reference(self.steps, optimizer=self.optimizer, scaler=self.scaler, step_fn=step_fn,
                                      window=window, contexts=self._local_replay)  # fmt: skip
            except Exception as exc:  # the observer's own failure: a finding, the step goes on
                self._judge.error("comparing the step with the reference step", exc)
        # one micro-batch a step (the usual case): its own flag and loss, no stack and reduction to launch
        local_loss = micro_flags[0] if len(micro_flags) == 1 else torch.stack(micro_flags).amax()
        loss_value = micro_losses[0] if len(micro_losses) == 1 else torch.stack(micro_losses).mean()
        hands_off = self.optimizer is None and amp.enabled(self.scaler) and not observed
        scaler = self.scaler if amp.enabled(self.scaler) and not observed and not hands_off else None
        stepped = False
        scale = next_scale = _unset(self._device)
        grad: torch.Tensor | None
        if hands_off:  # the scale this step's backward used; what the user's update() will make of an overflow
            scale = amp.scale_tensor(self.scaler, self._device)
            next_scale = scale * float(self.scaler.get_backoff_factor())
            grad = nonfinite_flag(grads_of(self._params), self._device)
        elif scaler is not None:
            assert self.optimizer is not None
            scale = amp.scale_tensor(scaler, self._device)
            if not amp.stepped(scaler, self.optimizer):
                self._stepped = True  # given to the scaler: whatever happens next, never stepped twice
                with self._measured_inside(self.steps):
                    _user(scaler.step, self.optimizer)  # the scaler checks the gradients and skips on overflow
                grad = amp.found_inf(scaler, self.optimizer, self._device)
                _user(scaler.update)
            else:  # step_fn stepped the scaler itself
                grad = amp.found_inf(scaler, self.optimizer, self._device)
            next_scale = amp.scale_tensor(scaler, self._device)
            stepped = True
        else:
            grad = None
        if grad is None:
            grad = nonfinite_flag(grads_of(self._params), self._device)
        agreed = torch.stack([local_loss, grad])
        if self._judge.distributed:
            # every rank skips, or none: replicas stay equal; each rank's gradient norm rides along
            agreed = self._judge.corruption.exchange(agreed, self.steps)
        # after the scaler's step the gradients are unscaled (GradScaler unscales before it steps)
        norm = (
            grad_norm(grads_of(self._params), self._device)
            if (self.steps - 1) % GRAD_NORM_EVERY == 0  # steps 1, 11, 21, ...: the first one too
            else _unset(self._device)
        )
        flags = torch.cat([agreed, torch.stack([local_loss, loss_value, scale, next_scale, norm])])
        # on its way to the host before the optimizer's kernels are queued: the next step waits
        # (if at all) for this check to finish, not for the optimizer
        read = FlagRead(flags)
        if scaler is None and self.device_skip and self.optimizer is not None and not observed:
            undo = skip_on_device(
                self.optimizer, agreed[1]
            )  # the fused optimizer skips a non-finite gradient on the device
            stepped = self._stepped = True
            try:
                _user(self.optimizer.step)
            finally:
                undo()
        pending = _Pending(
            self.steps,
            window,
            step_fn,
            read,
            micro_flags,
            stepped or observed,
            observed,
            scale if scaler is not None or hands_off else None,
            hands_off,
            self._carried,
            self._hooked,
        )
        self._hooked = []
        if stepped and self.device_skip:
            self._pending = pending  # decided when the next step starts (or at flush)
        else:
            self._resolve(pending)

    def _still_left(self) -> tuple[int, float | None] | None:
        """The skipped step whose non-finite gradients are still in .grad as this step begins (None:
        no step left any, or step_fn zeroed them); a host read only after a step the scaler skipped."""
        if self._left is None or self.accumulate > 1:
            return None
        if not nonfinite_flag(grads_of(self._params), self._device).item():
            self._left = None  # step_fn zeroes the gradients: nothing is carried
        return self._left

    def _resolve(self, pending: _Pending) -> None:
        """The step's facts, read once, to the judge; then what the verdict asks of this loop."""
        self._pending = None
        values = pending.flags.values()
        bad_loss, bad_grad, local_loss = values[_LOSS] > 0, values[_GRAD] > 0, values[_LOCAL_LOSS] > 0
        scale: float | None = values[_SCALE] if pending.scale is not None else None
        next_scale: float | None = values[_NEXT_SCALE] if pending.scale is not None else None
        if pending.observed and bad_grad and not bad_loss and amp.enabled(self.scaler):
            # step_fn's own scaler skipped it: AMP's, at the scale it has now (a host read, skipped steps only)
            scale = next_scale = float(self.scaler.get_scale())
        micro = None
        if local_loss:  # host reads from here on: bad steps only
            micro_values = torch.stack(pending.micro_loss_flags).tolist()
            micro = next((i for i, v in enumerate(micro_values, start=1) if v > 0), None)  # from 1, as steps
        facts = StepFacts(
            pending.step,
            bad_loss=bad_loss,
            bad_grad=bad_grad,
            local_loss=local_loss,
            loss_value=values[_LOSS_VALUE],
            window=pending.window,
            step_fn=pending.step_fn,
            contexts=lambda: self._contexts(pending),
            scale=scale,
            next_scale=next_scale,
            grad_norm=None if math.isnan(values[_GRAD_NORM]) else values[_GRAD_NORM],
            micro=micro,
            micro_batches=self.accumulate,
            # given to the scaler already: it applies a step whose gradients are finite
            skippable=not (pending.stepped and pending.scale is not None) and not pending.hands_off,
            applied=pending.observed,
            stepped=pending.stepped,
            why_not="step_fn applied the step itself" if pending.observed else None,
            carried=pending.carried,
            contexts_at=lambda at: self._contexts(pending, at),
            penalty=self._penalty,
            replays_penalty=True,  # step_fn holds the loss code: its replay under trace reads the penalty
        )
        apply = None if pending.stepped or self.optimizer is None else self._apply
        outcome = self._judge.judge(facts, apply)
        if outcome.finite:
            self._left = None
            if pending.outputs:  # the outputs' format: what the reference step's fp32 forward cannot see
                self._judge.outputs_read(pending.step, pending.outputs, replayed=False)
        elif outcome.verdict == "amp-skip" and self._left is None:
            self._left = (pending.step, scale)
        if self._measured is not None:
            stats, self._measured = self._measured, None
            self._judge.updates(stats, every=self.check_updates)
        if not outcome.skipped or outcome.verdict == "amp-skip":  # applied (a NaN loss's finite gradients too)
            if self.accumulate > 1:
                self._zero_grads()
            if outcome.finite and self.checkpoint_every and pending.step % self.checkpoint_every == 0:
                self._save_checkpoint(pending.step)
        elif not pending.observed and not pending.hands_off:  # a skipped step leaves no gradient
            self._zero_grads()

    def _apply(self) -> None:
        assert self.optimizer is not None
        self._stepped = True
        step = self._judge.decided
        sample = self._measure_before(step) if step is not None else None
        _user(self.optimizer.step)
        if sample is not None:
            self._measure_after(sample)

    def _measure_before(self, step: int) -> UpdateSample | None:
        """The sample, and the step's intended update in fp32, on a measured step."""
        probe = self._updates
        if probe is None or not probe.due(step):
            return None
        try:
            return probe.before(step)
        except Exception as exc:
            self._judge.error("measuring the optimizer's updates", exc)
            return None

    def _measure_after(self, sample: UpdateSample) -> None:
        assert self._updates is not None
        try:
            self._updates.after(sample)
            self._measured = self._updates.read(sample)
            self._measured.grads, self._grad_rows = self._grad_rows, []
        except Exception as exc:
            self._judge.error("measuring the optimizer's updates", exc)

    @contextlib.contextmanager
    def _measured_inside(self, step: int) -> Iterator[None]:
        """A GradScaler unscales the gradients, then steps the optimizer (or skips it): the step is
        measured between the two, from global optimizer hooks held for this one call."""
        if self._updates is None or not self._updates.due(step):
            yield
            return
        mine = self.optimizer
        taken: list[UpdateSample | None] = []  # the sample of this call's step, once

        def before(optimizer: Any, args: Any, kwargs: Any) -> None:
            if optimizer is mine and not taken:
                taken.append(self._measure_before(step))

        def after(optimizer: Any, args: Any, kwargs: Any) -> None:
            if optimizer is mine and taken and taken[0] is not None:
                sample, taken[0] = taken[0], None
                self._measure_after(sample)

        handles = [register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _contexts(self, pending: _Pending, scale: float | None = None) -> list[contextlib.AbstractContextManager[Any]]:
        """What a replay of `pending` runs under; made anew for each replay (each is entered once).
        `scale`: another loss scale than the step's own (the scale of the step whose gradients it carried)."""
        contexts: list[contextlib.AbstractContextManager[Any]] = [distributed.local_replay(self.model)]
        if pending.scale is not None:
            at = pending.scale if scale is None else torch.full_like(pending.scale, scale)
            contexts.append(amp.scale_as(self.scaler, at))
        return contexts

    def _local_replay(self) -> list[contextlib.AbstractContextManager[Any]]:
        """What a run of the reference step runs under: a local replay (no DDP hook, no all-reduce)."""
        return [distributed.local_replay(self.model)]

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
            self._judge.note_once(
                key, findings.checkpoint_finding(step, self.checkpoint_path, text, here=self._judge.here)
            )

    @property
    def report(self) -> Report:
        if self._pending is not None and not self._judge.distributed:
            self.flush()
        data: dict[str, Any] = {}
        if self._pending is not None:
            data["undecided_step"] = self._pending.step
        report = self._judge.report(scaled=self.scaler is not None, data=data)
        if self.checkpoint_path:
            written = self.checkpoint_step is not None
            text = f"{self.checkpoint_path} (step {self.checkpoint_step})" if written else "none written"
            report.data["summary"].append(("last-good checkpoint", text))
            report.data["checkpoint_step"] = self.checkpoint_step
        return report
