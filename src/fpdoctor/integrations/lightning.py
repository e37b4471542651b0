"""The training sentinel inside Lightning's `Trainer.fit` (Lightning >= 2.0, `lightning` or `pytorch_lightning`).

    from fpdoctor.integrations.lightning import FpDoctorCallback
    trainer = Trainer(callbacks=[FpDoctorCallback(report_path="fpdoctor.json")])
    trainer.fit(model)            # then: callback.report

Or with no change to the code: `FPDOCTOR_LIGHTNING=1` (and `FPDOCTOR_REPORT=fpdoctor.json`) in the
environment; the package's entry point adds the callback to every Trainer then, and to none
otherwise.

Where the callback looks, and why there:
- `on_train_batch_start`: a micro-batch starts; its batch (a reference) and the RNG state, for the replay;
- `on_before_backward`: its loss, on the device. Lightning passes the loss divided by
  `accumulate_grad_batches` and, under "16-mixed", multiplied by the GradScaler's scale: both are
  undone for the loss curve (a non-finite loss stays non-finite either way);
- `on_before_optimizer_step`: the gradients are complete and not yet clipped (Lightning clips after
  this hook), unscaled under "16-mixed" except for optimizers that unscale inside their step (fused
  Adam: Lightning leaves it to them) - finiteness is the same either way. The step is decided here,
  with one host read: a non-finite step is reported, replayed and skipped (gradients set to None,
  so the optimizer step that follows changes nothing); an overflow under a GradScaler is the
  scaler's to skip and is counted as an AMP skip.
- `on_train_end` (or `on_exception`): the report is written and summed up through Lightning's logger.
  With `report_path` the file is also written at `on_fit_start` and rewritten as findings arrive
  ("in progress"); with `stop_on`, the first finding at that level sets `trainer.should_stop`, which
  Lightning's loop reads after the optimizer step.

What it cannot do: replay under manual optimization (`training_step` steps the optimizer itself;
such steps are still checked and skipped, and their report says "not replayed"); undo what a
`training_step` changes besides buffers, the modules' public attributes (preserve.attributes_kept:
rebound, set, written in place, a container added to, one level down), `self.log` calls and
torchmetrics states (the replay drops the calls and puts the rest back), such as what an object held
in an attribute keeps of its own; stop
the learning-rate scheduler from advancing on a skipped step (Lightning steps it after every
optimizer step, as it does after an AMP skip).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from fpdoctor.integrations import _report
from fpdoctor.integrations._watch import StepWatch, guarded
from fpdoctor.integrations.entry_point import stop_on_from_environment
from fpdoctor.numerics.training import reference
from fpdoctor.numerics.training.live import Live, stop_level
from fpdoctor.report.model import Report
from fpdoctor.torchprivate import scaler_scale

ENV_REPORT = "FPDOCTOR_REPORT"
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _lightning(package: str | None = None) -> Any:
    """The Lightning package to build on: `package`, else `lightning.pytorch`, else `pytorch_lightning`."""
    for name in (package,) if package else _PACKAGES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(
        "fpdoctor.integrations.lightning needs Lightning >= 2.0: pip install 'fpdoctor[lightning]'"
    ) from None


class _Hooks:
    """The callback's behaviour, on whichever Lightning package's `Callback` it is mixed into."""

    def __init__(
        self,
        report_path: str | None = None,
        *,
        replay: bool = True,
        reference_every: int = reference.EVERY,
        stop_on: str | None = None,
    ) -> None:
        super().__init__()
        self._stop_level = stop_level(stop_on)  # "error", "warning" or None; ValueError otherwise
        self.stop_on = stop_on
        if not isinstance(replay, bool):
            raise ValueError(f"replay must be True or False, got {replay!r}")
        # the model's backward at steps 1, 1 + N, ... against the same step in fp32 (reference.py); 0: off
        self.reference_every = reference.check_every(reference_every)
        self.report_path = _report.check_path(report_path)
        self.replay = replay
        self._from_entry_point = False
        self._active = True
        self._watch: StepWatch | None = None
        self._trainer: Any = None
        self._takes_index = True
        self._logger_name = "lightning.pytorch.fpdoctor"
        self._written: Report | None = None

    @property
    def report(self) -> Report:
        """What the callback found so far (counts, verdicts, findings), and why a stopped run ended."""
        return _report.build(self._watch, "lightning", self.stop_on)

    # -- Lightning's hooks -------------------------------------------------------------------------
    @guarded("setting up")
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        # one sentinel per Trainer: a callback the user gave wins over the environment's
        others = [cb for cb in trainer.callbacks if isinstance(cb, _Hooks) and cb is not self]
        self._active = not (self._from_entry_point and any(not cb._from_entry_point for cb in others))
        package = "lightning.pytorch" if type(trainer).__module__.startswith("lightning.") else "pytorch_lightning"
        self._logger_name = f"{package}.fpdoctor"  # under Lightning's own logger: its handler and level

    @guarded("setting up")
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._watch = None
        self._written = None
        if not self._active:
            return
        self._trainer = trainer
        precision = trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)
        model = trainer.strategy.model
        ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
        optimizers = list(trainer.optimizers)
        self._takes_index = _takes_batch_index(pl_module.training_step)
        self._watch = StepWatch(
            pl_module,
            self._step_fn,
            replay=self.replay,
            reference_every=self.reference_every,
            scaler=scaler,
            ddp=ddp,
            optimizer=optimizers[0] if len(optimizers) == 1 else None,
            replay_context=lambda: _replaying(pl_module),
            live=Live(stop_on=self._stop_level),
            loader_rows=True,  # a bad step's rows named as the dataset items of its own batch
            hook_outputs=True,  # training_step computes the loss: the callback sees no output otherwise
            framework="lightning",
        )
        if not pl_module.automatic_optimization:
            self._watch.cannot_replay_any = "manual optimization: training_step steps the optimizer itself"
        if getattr(trainer, "gradient_clip_val", None):
            # Lightning clips after on_before_optimizer_step: the update the callback would infer is not the one taken
            self._watch.no_update_check("Lightning clips the gradients after the callback sees them")
        else:  # the gradients on_before_optimizer_step sees (unscaled) are those the optimizer takes
            self._watch.final_gradients = pl_module.automatic_optimization
        if self.report_path:  # rewritten as findings arrive: a job killed at any point leaves a readable report
            rank, world = _rank(trainer)
            path = _report.path_for_rank(self.report_path, rank, world)
            self._watch.write_live(_report.live_writer(self._watch, "lightning", path))

    @guarded("preparing the step")
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        watch = self._watch
        if watch is None:
            return
        watch.start_micro()
        watch.inputs((batch, batch_idx) if self._takes_index else (batch,), {})

    @guarded("reading the loss")
    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        watch = self._watch
        if watch is None:
            return
        watch.forward_done()
        scale = scaler_scale(watch.scaler) if watch.scaler is not None else None
        # automatic optimization divides the loss by accumulate_grad_batches; manual does not
        times = float(trainer.accumulate_grad_batches) if pl_module.automatic_optimization else 1.0
        watch.loss(loss, scale=scale, times=times)

    @guarded("deciding the step")
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        watch = self._watch
        if watch is None:
            return
        step = trainer.global_step + 1  # the step being taken, counted from 1
        params = [p for group in optimizer.param_groups for p in group["params"]]
        checked = watch.decide(step, params)
        if (
            checked is not None
            and not checked.finite
            and not (watch.scaler is not None and checked.bad_grad and not checked.bad_loss)
        ):
            self._log_step(trainer, step)
        if watch.stop_due():  # the optimizer step still runs (skipped if bad); the loop ends after it
            trainer.should_stop = True

    @guarded("measuring the optimizer's updates")
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._watch is not None:
            self._watch.forward_done()  # a step whose backward Lightning never ran: the hooks are off all the same
            self._watch.after_step()  # a step measured at on_before_optimizer_step has been taken
            if self._watch.stop_due(agree=False):  # a finding about the update just taken
                trainer.should_stop = True

    @guarded("measuring the optimizer's updates")
    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self._watch is not None:
            self._watch.forward_done()  # a batch skipped by on_train_batch_start's -1 left the hooks on

    @guarded("writing the report")
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._finish(trainer)

    @guarded("writing the report")
    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._finish(trainer)

    # -- the replay's step and the end ------------------------------------------------------------
    def _step_fn(self, *args: Any) -> torch.Tensor:
        """One micro-batch as Lightning's automatic optimization runs it: training_step under the
        precision plugin's autocast, the loss scaled like Lightning's, the module's own backward."""
        trainer = self._trainer
        pl_module = trainer.lightning_module
        with torch.enable_grad():
            with trainer.precision_plugin.train_step_context():
                output = pl_module.training_step(*args)
            loss = output.get("loss") if isinstance(output, Mapping) else output
            if not isinstance(loss, torch.Tensor):
                raise RuntimeError("training_step returned no loss when the step was replayed")
            scaler = self._watch.scaler if self._watch is not None else None
            pl_module.backward(scaler.scale(loss) if scaler is not None else loss)
        return loss.detach()

    def _finish(self, trainer: Any) -> None:
        watch = self._watch
        if watch is None or self._written is not None:
            return
        watch.close()
        report = _report.build(watch, "lightning", self.stop_on)
        self._written = report
        rank, world = _rank(trainer)
        if self.report_path:
            path = _report.path_for_rank(self.report_path, rank, world)
            try:
                _report.write(report, path)
            except Exception as exc:  # a report we cannot write never fails the training
                self._logger().error(f"fpdoctor: could not write the report to {path}: {exc}")
        if rank in (None, 0):
            lines = _report.summary_lines(report, "lightning")
            log = self._logger()
            (log.warning if report.findings else log.info)("\n".join(lines))

    def _log_step(self, trainer: Any, step: int) -> None:
        rank, _ = _rank(trainer)
        if rank not in (None, 0) or self._watch is None:
            return
        line = _report.step_line(self._watch.findings, step)
        if line:
            self._logger().warning(line)

    def _logger(self) -> Any:
        import logging

        return logging.getLogger(self._logger_name)


def _rank(trainer: Any) -> tuple[int | None, int]:
    world = int(getattr(trainer, "world_size", 1) or 1)
    return (int(trainer.global_rank) if world > 1 else None), world


def _takes_batch_index(training_step: Any) -> bool:
    """Lightning passes batch_idx when training_step takes a second argument (its own rule)."""
    try:
        parameters = inspect.signature(training_step).parameters
    except (TypeError, ValueError):
        return True
    if "batch_idx" in parameters:
        return True
    positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in parameters.values())


@contextlib.contextmanager
def _replaying(pl_module: nn.Module) -> Iterator[None]:
    """A replay leaves no trace in the logs or the metrics: `self.log`/`self.log_dict` do nothing
    for its length, and torchmetrics states it updates are put back after."""
    instance = vars(pl_module)
    shadowed = {name: instance[name] for name in ("log", "log_dict") if name in instance}
    metrics = [(m, _metric_state(m)) for m in pl_module.modules() if _is_metric(m)]
    instance["log"] = instance["log_dict"] = _no_log
    try:
        yield
    finally:
        for name in ("log", "log_dict"):
            if name in shadowed:
                instance[name] = shadowed[name]
            else:
                instance.pop(name, None)
        for metric, state in metrics:
            for name, value in state.items():
                setattr(metric, name, value)


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


def _is_metric(module: nn.Module) -> bool:
    """A torchmetrics Metric (duck-typed: its states are attributes, not buffers)."""
    return isinstance(getattr(module, "_defaults", None), dict) and hasattr(module, "_update_count")


def _metric_state(metric: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for name in [*metric._defaults, "_update_count", "_computed", "_forward_cache"]:
        value = getattr(metric, name, None)
        if isinstance(value, torch.Tensor):
            value = value.detach().clone()
        elif isinstance(value, list):
            value = [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in value]
        state[name] = value
    return state


def callback_class(package: str | None = None) -> type:
    """FpDoctorCallback built on `package`'s Callback ("lightning.pytorch" or "pytorch_lightning")."""
    pl = _lightning(package)
    if pl is _BASE_PACKAGE:
        return FpDoctorCallback
    cached = _CLASSES.get(pl.__name__)
    if cached is None:
        cached = type("FpDoctorCallback", (_Hooks, pl.Callback), {"__doc__": FpDoctorCallback.__doc__})
        _CLASSES[pl.__name__] = cached
    return cached


def from_environment(package: str) -> list[Any]:
    """The entry point's callbacks: one FpDoctorCallback when FPDOCTOR_LIGHTNING is on, with
    FPDOCTOR_REPORT's report file and FPDOCTOR_STOP_ON's stop_on."""
    path = os.environ.get(ENV_REPORT) or None
    stop_on = stop_on_from_environment(f"{package}.fpdoctor")
    try:
        callback = callback_class(package)(report_path=path, stop_on=stop_on)
    except ValueError as exc:  # a bad FPDOCTOR_REPORT: the run goes on, without the file
        import logging

        logging.getLogger(f"{package}.fpdoctor").error(f"fpdoctor: {ENV_REPORT}: {exc}")
        callback = callback_class(package)(stop_on=stop_on)
    callback._from_entry_point = True
    return [callback]


_BASE_PACKAGE = _lightning()
_Callback: Any = _BASE_PACKAGE.Callback
_CLASSES: dict[str, type] = {}


class FpDoctorCallback(_Hooks, _Callback):
    """The training sentinel for Lightning: checks every optimizer step's loss and gradients on the
    device, skips a non-finite step, replays it under `trace` and says why (see the module's doc).

    `report_path`: where the report is written (.json, .md, .html, else text; under DDP every rank
    writes its own, `name.rankN.ext`): when training starts, again as findings arrive (marked "in
    progress", so a job killed at any point leaves a readable report) and when it ends.
    `stop_on="error"` (or "warning"): the first finding at that level ends training at that step
    (`trainer.should_stop`), the report saying why. `replay=False`: report and skip only.
    `callback.report` holds the report at any time.
    """
