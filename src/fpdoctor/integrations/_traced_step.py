"""One training step traced by `fpdoctor watch`, after a bad step its replay could not explain.

The watch replays a bad step through the model alone: it knows the model's forward and the
gradients that reached its outputs, not the loss code between them. Where the replay shows the
NaN/Inf reproducing but names no op with a checked fix (made in the loss code, or by an op the
replay could not re-run), the cause recurs, so the next training step is traced, from its model
forward through its backward, by the same tracer and experiments as `fpdoctor trace`: its finding
(the op, the line, the literal or dtype, the fix checked) leads the watch's report, so both commands
give one verdict. Once per run: a traced step costs what `fpdoctor trace` costs on it. A traced step
whose values stayed finite (a division by a count that is 0 on some batches only) says nothing: the
next one is traced, up to TRIES steps.

The trace starts in the top-level module's forward pre-hook (torch copies the hook tables before
calling them, so the trace may add its own) and ends after that step's first backward returns,
outside every hook table's iteration: the optimizer step and its hooks run untraced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from fpdoctor.report.model import Finding, Severity

# the findings of a traced step that say where a non-finite value was made, and how to fix it
_CAUSES = (
    "gradients-still-scaled",
    "nonfinite-produced",
    "nonfinite-input",
    "overflow-near-limit",
    "grad-scaler-stalled",
)
# causes in the recipe, whose overflows the trace's nonfinite findings then name: first, as `trace` puts them
_RECIPE = ("gradients-still-scaled",)
# the watch's findings of the recurring bad step, whose fix the traced step's cause replaces
_EXPLAINED = ("deterministic-nonfinite", "training-stalled")
TRIES = 8  # steps traced at most, until one makes the non-finite value again


# the trace's account of its one traced step, as the run's: said of that step (the watch counts the run's)
_ONE_STEP = (
    ("skipped 1 of 1 steps", "skipped it"),
    (", so the weights never moved: this is not", ": this is not"),
    (", on 1 of the 1 skipped steps:", ":"),
)


class TracedStep:
    """Armed by a bad step, started at the next training forward, finished after its backward."""

    def __init__(self) -> None:
        self.armed_by: int | None = None  # the bad step whose replay named no checked cause
        self.done = False  # once per run
        self._trace: Any = None
        self.step: int | None = None  # the step traced
        self.said: dict[str, Any] | None = None  # what the report says of it
        self.findings: list[Finding] = []  # what it found (`finish`), the report's lead (`lead`)
        self._params: set[int] | None = None  # the bad step's optimizer's parameters (ids), where known
        self.closing = False  # that optimizer stepped: the trace ends at the next training forward
        self.penalty = False
        self.tries = 0  # steps traced so far

    def arm(self, step: int, params: set[int] | None = None, *, penalty: bool = False) -> None:
        """Armed by `step`; `params` (ids): its optimizer's. The trace then runs from the next training
        forward that reads them until that optimizer's next step (`stepped`), and ends at the training
        forward after it: with two optimizers (a GAN's critic and generator) the other's forward and
        backward may come first, and the bad step's own loss code is traced all the same."""
        if not self.done and self.armed_by is None:
            self.armed_by = step
            self._params = params
            # armed by a gradient penalty on scaled gradients, not by a bad step: the trace says whether the
            # code unscales them (its overflows at the scaler's first scales are calibration)
            self.penalty = penalty

    @property
    def until_step(self) -> bool:
        """It ends after its optimizer's step, not at the first backward."""
        return bool(self._params)

    def stepped(self, optimizer: Any) -> None:
        """An optimizer stepped while the trace runs: its own ends the trace at the next training forward."""
        params = self._params
        if self.running and params and any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
            self.closing = True

    @property
    def running(self) -> bool:
        return self._trace is not None

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """The watch's own work while the step is traced (its optimizer hook deciding a step: an isfinite of
        the loss, a replay): the trace records none of it, as the program's ops are all it may judge (an
        isfinite's abs of a NaN loss was "NaN already in an input: check the data pipeline")."""
        tracer = getattr(self._trace, "tracer", None)
        if tracer is None:
            yield
            return
        tracer.aside += 1
        try:
            yield
        finally:
            tracer.aside -= 1

    def start(self, module: nn.Module, step: int) -> None:
        """At a training forward (its module's pre-hook), where armed."""
        if self.armed_by is None or self.done or self._trace is not None:
            return
        if self._params and not any(id(p) in self._params for p in module.parameters()):
            return  # another optimizer's model: the bad step's own comes later
        from fpdoctor.numerics.api import Trace

        self.done, self.step = True, step
        trace = Trace(module)
        trace.__enter__()
        self._trace = trace

    def finish(self) -> list[Finding]:
        """After the traced step's backward: the trace's findings of where the value was made, the
        checked ones first, each saying which step was traced and why."""
        trace, self._trace = self._trace, None
        if trace is None:
            return []
        trace.__exit__(None, None, None)
        report = trace.report
        found = [f for f in (report.findings if report is not None else []) if f.name in _CAUSES]
        found = [f for f in found if f.severity is not Severity.INFO]
        self.tries += 1
        if not found and not self.penalty and self.tries < TRIES:
            self.done, self.closing = False, False  # this batch was fine: the next step is traced instead
            return []
        if self.penalty:  # the penalty read scaled, or nothing: an overflow there is the scaler's calibration
            found = [f for f in found if f.name in _RECIPE]
        # the recipe's cause first, then checked fixes, then the forward's before the backward's (x / 0 makes
        # a NaN in the forward and an Inf in its backward: the forward's is where it is made)
        found.sort(
            key=lambda f: (
                f.name not in _RECIPE,
                f.name == "nonfinite-input",  # an input the trace saw come in (a gradient read by the scaler)
                not (f.trial is not None and f.trial.tried),
                f.where.get("phase") == "backward",
            )
        )
        self.said = {
            "step": self.step,
            "armed_by": self.armed_by,
            "findings": [f.code for f in found],
            "ops": report.data.get("ops") if report is not None else None,
        }
        why = (
            f"Traced at step {self.step} (a gradient penalty differentiates an output GradScaler scaled; the watch "
            "traced the step that reads it, as `fpdoctor trace` does): "
            if self.penalty
            else f"Traced at step {self.step} (step {self.armed_by} was non-finite again on replay, and the replay "
            "of the model alone named no op with a checked fix; the watch traced the training steps after it, "
            "through their loss and backward as `fpdoctor trace` does, until one made it again): "
        )
        # the trace counts its own steps from 1: the script's count is the traced step's
        ours = (
            (", optimizer step 1,", f", optimizer step {self.step},"),
            (", optimizer step 1)", f", optimizer step {self.step})"),
        )
        self.findings = []
        for f in found[:2]:
            message, title = f.message, f.title
            for theirs, mine in ours:
                message = message.replace(theirs, mine)
            if f.name == "grad-scaler-stalled" and f.evidence.get("steps") == 1:
                # the trace's counts are of its one step, not the run's: the watch's own counts say those
                origin = f.evidence.get("origin")
                op = origin.get("op") if isinstance(origin, dict) else None
                title = f"GradScaler skipped the step traced at step {self.step}" + (
                    f": its non-finite value is made at {op}" if op else ""
                )
                for theirs, mine in _ONE_STEP:
                    message = message.replace(theirs, mine)
            evidence = {**f.evidence, "step": self.step, "traced_step": self.step}
            self.findings.append(replace(f, title=title, message=why + message, evidence=evidence))
        return self.findings

    def lead(self, found: list[Finding]) -> list[Finding]:
        """The report's findings with the traced step's first: the cause before the replays it
        explains, whose fix becomes its checked one (theirs named no op: the loss code, an op the
        model's replay could not reach)."""
        if not self.findings:
            return found
        # gradients the loss scale left 1024x too large from the first step on: the weights grew out of range; or
        # the learning rate, which the loss's climb names
        rate = next((f for f in found if f.name == "loss-scale-not-undone"), None)
        rate = rate or next(
            (f for f in found if f.name == "training-stalled" and "climbed_at_step" in f.evidence), None
        )
        if rate is not None:  # the learning rate's, tried: the op where the growing values overflowed follows it
            at = found.index(rate) + 1
            why = (
                f"the loss climbed from step {rate.evidence['climbed_at_step']}"
                if rate.name == "training-stalled"
                else f"the optimizer took gradients {rate.evidence['scale']:g}x too large from step "
                f"{rate.evidence['step']} on"
            )
            said = (
                f"As {rate.name} says ({why}: the weights grew out of range, and a change at this op only moves the "
                f"step where they overflow): {rate.fix}"
            )
            followed = [replace(f, fix=said, trial=rate.trial) if rate.fix else f for f in self.findings]
            return [*found[:at], *followed, *found[at:]]
        cause = self.findings[0]
        said = f"the step traced at step {self.step} names it ({cause.code}): {cause.fix}"
        explained = [
            replace(f, fix=said, trial=cause.trial, title=_named_by(f.title, self.step))
            if f.name in _EXPLAINED and not (f.trial is not None and f.trial.tried)
            else f
            for f in found
        ]
        return [*self.findings, *explained]


def _named_by(title: str, step: int | None) -> str:
    """A title that said the replay named no op, once the step traced after it named one."""
    return title.replace("(no op named)", f"(the op: named by the step traced at step {step})")
