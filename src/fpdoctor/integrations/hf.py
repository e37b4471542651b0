"""The training sentinel inside the Hugging Face `Trainer` (transformers >= 4.40, through accelerate).

    from fpdoctor.integrations.hf import FpDoctorCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[FpDoctorCallback("fpdoctor.json")])
    trainer.train()               # then: callback.report

The Trainer gives its callbacks no loss, so the callback looks at the model itself (hooks put on
it at `on_train_begin`, removed at `on_train_end`):
- a forward pre-hook: a micro-batch's inputs (references) and the RNG state, for the replay;
- a forward hook: the loss the model returns (`outputs.loss`, unscaled), checked on the device;
- the end of the last micro-batch's backward (an autograd callback queued from the loss): the
  gradients, read with the step's one host read before the Trainer computes the gradient norm -
  which multiplies every gradient by a non-finite norm, so that afterwards every parameter shows
  NaN. Under DDP the read waits for `on_pre_optimizer_step` (the all-reduce must have finished);
  the DDP hook has each rank's own gradients from before it;
- `on_pre_optimizer_step`: the step is decided - a non-finite one is reported, replayed and
  skipped (gradients set to None, so `optimizer.step()` changes nothing); an overflow under fp16's
  GradScaler is the scaler's to skip (the Trainer's `optimizer_step_was_skipped`), counted as an
  AMP skip;
- with `stop_on`, the first finding at that level sets `control.should_training_stop` there (or
  at `on_optimizer_step`, for a finding about the update), which the Trainer reads after the step;
- `on_log`: with `logging_nan_inf_filter` (on by default) the Trainer counts the mean of the
  logging interval's other losses in place of a NaN/Inf one (0 when it is logged alone), so the
  logs look healthy; the callback adds `nonfinite_steps` (how many since the last
  log) to that log entry and to `state.log_history`, and names each such step in a warning.

A loss computed outside the model's forward (`compute_loss` overridden, `compute_loss_func`,
label smoothing) is not seen: the gradients are still checked and a bad step skipped, and its
replay runs the model's forward and the backward from the gradients that arrived at the model's
outputs (`_outputs.py`), so the op of origin inside the model is still named. What it cannot do:
replay a micro-batch that ran the model more than once; stop the learning-rate scheduler from
advancing on a step it skipped (the Trainer only holds it back for the GradScaler's own skips).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fpdoctor.integrations import _report
from fpdoctor.integrations._outputs import KeptGradients, backward_from
from fpdoctor.integrations._watch import StepWatch, guarded
from fpdoctor.numerics.observe.batches import OutputsOnly
from fpdoctor.numerics.training import distributed, reference
from fpdoctor.numerics.training.live import Live, stop_level
from fpdoctor.report.model import Report
from fpdoctor.torchprivate import queue_callback

TWICE = "the model ran more than once in one micro-batch"


def _transformers() -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ImportError("fpdoctor.integrations.hf needs transformers >= 4.40: pip install 'fpdoctor[hf]'") from None


_BASE = _transformers()
_Callback: Any = _BASE.TrainerCallback


class FpDoctorCallback(_Callback):
    """The training sentinel for the Hugging Face Trainer: checks every optimizer step's loss and
    gradients on the device, skips a non-finite step, replays it under `trace` and says why; the
    NaN/Inf losses that `logging_nan_inf_filter` keeps out of the logs are named (see the module's doc).

    `report_path`: where the report is written (.json, .md, .html, else text; under DDP every rank
    writes its own, `name.rankN.ext`): when training starts, again as findings arrive (marked "in
    progress", so a job killed at any point leaves a readable report) and when it ends.
    `stop_on="error"` (or "warning"): the first finding at that level ends training at that step
    (`control.should_training_stop`), the report saying why. `replay=False`: report and skip only.
    `callback.report` holds the report at any time.
    """

    def __init__(
        self,
        report_path: str | None = None,
        *,
        replay: bool = True,
        reference_every: int = reference.EVERY,
        stop_on: str | None = None,
    ) -> None:
        self._stop_level = stop_level(stop_on)  # "error", "warning" or None; ValueError otherwise
        self.stop_on = stop_on
        if not isinstance(replay, bool):
            raise ValueError(f"replay must be True or False, got {replay!r}")
        # the model's backward at steps 1, 1 + N, ... against the same step in fp32 (reference.py); 0: off
        self.reference_every = reference.check_every(reference_every)
        self.report_path = _report.check_path(report_path)
        self.replay = replay
        self._watch: StepWatch | None = None
        self._model: nn.Module | None = None
        self._state: Any = None
        self._gradient_state: Any = None
        self._handles: list[Any] = []
        self._open = False  # a micro-batch has started (its first training forward ran)
        self._replaying = False
        self._backward_queued = False
        self._kept: KeptGradients | None = None  # the current micro-batch's output gradients
        self._at_exit: Any = None  # the exit handler of a training in progress
        self._args: Any = None  # the training's arguments (rank, world size)
        self._finished: StepWatch | None = None  # the watch whose report was written
        self._unlogged = 0  # non-finite steps since the last log
        self._filtering = True
        self._main = True  # the world's process 0: the one that logs

    @property
    def report(self) -> Report:
        """What the callback found so far (counts, verdicts, findings), and why a stopped run ended."""
        return _report.build(self._watch, "transformers", self.stop_on)

    # -- the Trainer's events ----------------------------------------------------------------------
    @guarded("setting up")
    def on_train_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any
    ) -> None:
        self._close()
        self._watch = None
        if model is None:
            return
        self._model, self._state, self._args = model, state, args
        self._filtering = bool(getattr(args, "logging_nan_inf_filter", False))
        self._main = bool(getattr(state, "is_world_process_zero", True))
        self._unlogged = 0
        scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer holds fp16's GradScaler
        self._gradient_state = getattr(optimizer, "gradient_state", None)
        self._watch = StepWatch(
            model,
            self._step_fn,
            replay=self.replay,
            reference_every=self.reference_every,
            scaler=scaler,
            ddp=_ddp_wrapper(model),
            optimizer=getattr(optimizer, "optimizer", optimizer),
            replay_context=self._replay_context,
            live=Live(stop_on=self._stop_level),
            loader_rows=True,  # a bad step's rows named as the dataset items of its own batch
            framework="transformers",
        )
        self._watch.final_gradients = True  # on_pre_optimizer_step comes after the Trainer's clipping
        if self.report_path:  # rewritten as findings arrive: a job killed at any point leaves a readable report
            world = int(getattr(args, "world_size", 1) or 1)
            rank = int(getattr(args, "process_index", 0)) if world > 1 else None
            path = _report.path_for_rank(self.report_path, rank, world)
            self._watch.write_live(_report.live_writer(self._watch, "transformers", path))
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True),
        ]
        # a train() that raises ends without on_train_end: the report is still written at exit
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
        self._at_exit = functools.partial(self._finish_at_exit, args)
        atexit.register(self._at_exit)

    @guarded("ending a micro-batch")
    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._open = False  # the next training forward starts the next micro-batch

    @guarded("deciding the step")
    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._open = False
        watch = self._watch
        if watch is None:
            return
        step = state.global_step + 1  # the step being taken, as the Trainer's logs will number it
        watch.check(step, spread=True)  # unless read at the end of the backward
        if watch.checked and not watch.last_check_finite:
            for kept in watch.window_args(KeptGradients):  # host reads, bad steps only, before the replay
                kept.read_finite()
        checked = watch.decide(step, spread=True)
        if watch.stop_due():  # the optimizer step still runs (skipped if bad); the loop ends after it
            control.should_training_stop = True
        if checked is None or checked.finite:
            return
        if watch.scaler is not None and checked.bad_grad and not checked.bad_loss:
            return  # an AMP overflow: the scaler skips it, and that is not news
        self._unlogged += 1
        if self._main:
            line = _report.step_line(watch.findings, step)
            if line and checked.bad_loss and self._filtering:
                line += (
                    " The Trainer's logs hide it: with logging_nan_inf_filter=True they count the mean of the "
                    "interval's other losses in its place (0 when it is logged alone)."
                )
            if line:
                _logger().warning(line)

    @guarded("measuring the optimizer's updates")
    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._watch is not None:
            self._watch.after_step()
            if self._watch.stop_due(agree=False):  # a finding about the update just taken
                control.should_training_stop = True

    @guarded("adding to the log")
    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._unlogged or logs is None:
            return
        logs["nonfinite_steps"] = self._unlogged
        history = getattr(state, "log_history", None)
        if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
            history[-1]["nonfinite_steps"] = self._unlogged
        self._unlogged = 0

    @guarded("writing the report")
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._finish(args)

    def _finish(self, args: Any) -> None:
        """The hooks off the model, the report written and summed up: at the end of training, or -
        the Trainer tells its callbacks nothing when `train()` raises - when the process exits."""
        watch = self._watch
        self._close()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if watch is None or watch is self._finished:
            return
        self._finished = watch
        report = _report.build(watch, "transformers", self.stop_on)
        world = int(getattr(args, "world_size", 1) or 1)
        rank = int(getattr(args, "process_index", 0)) if world > 1 else None
        if self.report_path:
            path = _report.path_for_rank(self.report_path, rank, world)
            try:
                _report.write(report, path)
            except Exception as exc:  # a report we cannot write never fails the training
                _logger().error(f"fpdoctor: could not write the report to {path}: {exc}")
        if self._main:
            (_logger().warning if report.findings else _logger().info)(
                "\n".join(_report.summary_lines(report, "transformers"))
            )

    # -- the model's hooks -------------------------------------------------------------------------
    def _training(self, module: nn.Module) -> bool:
        return self._watch is not None and not self._replaying and module.training and torch.is_grad_enabled()

    @guarded("looking at the model's inputs")
    def _before_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        watch = self._watch
        if watch is None or not self._training(module):
            return
        if not self._open and not _in_training_loop(sys._getframe(1)):
            # train() raised earlier (the Trainer tells its callbacks nothing then) and the model is
            # used on: the training is over - its report is written and the hooks come off the model
            self._finish(self._args)
            return
        if not self._open:
            self._open = True
            self._backward_queued = False
            watch.start_micro()
        elif watch.has_inputs():
            watch.cannot_replay(TWICE)
            return
        self._kept = KeptGradients()
        watch.inputs((self._kept, *args), kwargs)
        # the model normalised its loss by the window's token count: the step's loss is the sum
        watch.sum_losses = kwargs.get("num_items_in_batch") is not None

    @guarded("looking at the model's loss")
    def _after_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        watch = self._watch
        if watch is None or not self._training(module):
            return
        loss = _loss_of(output)
        if loss is None:  # computed outside the forward: the gradients at the outputs stand in for it
            watch.loss_unseen()
            if self._kept is not None:
                self._kept.watch(output)
            return
        watch.loss(loss)
        last = getattr(self._gradient_state, "sync_gradients", False)
        # under DDP the gradients are read after the all-reduce, at on_pre_optimizer_step
        if last and not self._backward_queued and loss.requires_grad and not distributed.active():
            self._backward_queued = True
            loss.register_hook(self._backward_started)

    @guarded("waiting for the end of the backward")
    def _backward_started(self, grad: torch.Tensor) -> None:
        queue_callback(self._backward_done)

    @guarded("checking the gradients")
    def _backward_done(self) -> None:
        """The last micro-batch's backward has finished: every gradient is complete, none clipped."""
        if self._watch is not None and self._state is not None:
            self._watch.check(self._state.global_step + 1)

    # -- the replay ----------------------------------------------------------------------------------
    def _step_fn(self, kept: KeptGradients, *args: Any, **kwargs: Any) -> torch.Tensor | OutputsOnly | None:
        """One micro-batch as the Trainer runs it: the model (accelerate's autocast is part of its
        forward), its own loss, scaled like accelerate's backward under fp16. A loss the Trainer
        computes outside the model: the backward from the gradients that arrived at the outputs."""
        assert self._model is not None and self._watch is not None
        with torch.enable_grad():
            output = self._model(*args, **kwargs)
            loss = _loss_of(output)
            if loss is None:
                if not kept.complete or not kept.outputs:
                    raise RuntimeError("neither a loss nor the gradients of the model's outputs were seen")
                return backward_from(output, kept)
            scaler = self._watch.scaler
            (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss.detach()

    @contextlib.contextmanager
    def _replay_context(self) -> Iterator[None]:
        """The replay's forwards are not micro-batches of the run."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    def _finish_at_exit(self, args: Any) -> None:
        try:
            self._finish(args)
        except Exception as exc:  # at exit: said, never raised
            _logger().error(f"fpdoctor: writing the report at exit failed ({type(exc).__name__}: {exc})")

    def _logger(self) -> Any:
        return _logger()

    def _close(self) -> None:
        """Take the hooks off the model (the watch stays, for `report`)."""
        for handle in self._handles:
            handle.remove()
        if self._watch is not None:
            self._watch.close()
        self._handles, self._open = [], False


def _in_training_loop(frame: Any) -> bool:
    """Whether this forward runs inside the Trainer's training loop (a short walk up the stack,
    once per micro-batch)."""
    for _ in range(64):
        if frame is None:
            return False
        if frame.f_code.co_name == "_inner_training_loop":
            return True
        frame = frame.f_back
    return True  # deeper than that: assume the loop, never drop a training's hooks by mistake


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries, as the Trainer reads it (`outputs["loss"]`)."""
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if not isinstance(loss, torch.Tensor) or not (loss.is_floating_point() or loss.is_complex()):
        return None
    return loss


def _ddp_wrapper(model: nn.Module) -> nn.Module | None:
    """The DistributedDataParallel that wraps `model`: the Trainer gives its callbacks the bare
    model only. One pass over the interpreter's objects, once per training, under DDP only."""
    if not distributed.active():
        return None
    import gc

    for obj in gc.get_objects():
        if isinstance(obj, nn.parallel.DistributedDataParallel) and obj.module is model:
            return obj
    return None


def _logger() -> Any:
    # under transformers' own logger: its handler, and the verbosity the user set for it
    return _BASE.utils.logging.get_logger("transformers.fpdoctor")
