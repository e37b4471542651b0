"""The update checks under `trace`: what each optimizer step in the traced block did to bf16/fp16
trainable weights, measured as the sentinel measures it (`updates.UpdateProbe`) and judged by the
same `UpdateJudge` (TRN010 update-rounded-away, TRN011 accumulation-stalled, the same evidence and fix).

Global optimizer hooks, removed on exit (nothing is set on the user's optimizer): before a step
the sample and its fp32 shadow step, after it the sampled weights again and one read back, on each
optimizer's first step and every `EVERY`-th after (1, 11, 21, ...), as the sentinel measures.
Gradients summed over micro-batches in a bf16/fp16 `.grad` are measured on the window of the
second step (the first the trace sees whole: the optimizer, and so which parameters it steps, is
known from its first step, after that window's backward ran) and of every measured step after:
a traced script often runs a few steps only. The check's own ops are not recorded and its shadow
step is not counted as a step (`updates.ours`, `updates.no_global_optimizer_hooks`). No what-if
run: the trace does not know the step to run again (the sentinel, `fpdoctor watch` and the
callbacks try the fix).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.numerics.observe import dynamo
from fpdoctor.numerics.updates.causes import Causes
from fpdoctor.numerics.updates.judge import UpdateJudge
from fpdoctor.numerics.updates.measure import (
    EVERY,
    LOW_PRECISION,
    GradAccumulation,
    UpdateProbe,
    UpdateSample,
    UpdateStats,
)
from fpdoctor.provenance import Provenance
from fpdoctor.report.model import Finding

UNTRIED = "trace does not run the step again; fpdoctor watch or the sentinel tries fp32 master weights on copies"


@dataclass
class _Stepped:
    """One optimizer seen stepping in the block: its probe, its steps, the step being measured."""

    optimizer: Any  # held while traced, so that its id stays its own
    probe: UpdateProbe
    steps: int = 0
    sample: UpdateSample | None = None
    grads: GradAccumulation | None = None
    rows: list[tuple[str, str, int, float, float]] | None = None


class TraceUpdates:
    """Context manager over a traced block; `findings` and `line` after it."""

    def __init__(self, names: Provenance) -> None:
        self.names = names  # parameter -> its dotted name, as the trace's module tracker knows it
        self.findings: list[Finding] = []
        self.judge = UpdateJudge(Causes(self.findings), {})
        self.errors: list[str] = []
        self.stepped = 0  # optimizer steps seen (of any optimizer)
        self._seen: dict[int, _Stepped] = {}
        self._thread = threading.get_ident()
        self._handles: list[Any] = []

    def __enter__(self) -> TraceUpdates:
        from torch.optim import optimizer as optimizer_mod

        self._thread = threading.get_ident()
        self._handles = [
            optimizer_mod.register_optimizer_step_pre_hook(self._before),
            optimizer_mod.register_optimizer_step_post_hook(self._after),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for seen in self._seen.values():  # a window started after the last step: its hooks go
            if seen.grads is not None:
                seen.grads.stop()
        self._seen = {}  # the optimizers (and through them the weights) are not held past the block

    @staticmethod
    def window_due(probe: UpdateProbe, step: int) -> bool:
        """The micro-batch gradients of `step`'s window are summed in fp32 on the sample."""
        return step == 2 or (step > 2 and probe.due(step))

    # -- the hooks ---------------------------------------------------------------------------------
    def _before(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if dynamo.compiling() or threading.get_ident() != self._thread:
            return
        try:
            self.stepped += 1
            seen = self._seen.get(id(optimizer))
            if seen is None:
                seen = self._seen[id(optimizer)] = _Stepped(optimizer, UpdateProbe(self._named(optimizer), optimizer))
                probe = seen.probe
                if probe.low_precision and probe.why_not is not None:  # said once; not measured
                    self._add(UpdateStats(0, type(optimizer).__name__, why_not=probe.why_not), optimizer)
            seen.steps += 1
            rows = None
            if seen.grads is not None:
                rows, seen.grads = seen.grads.finish(), None
            if seen.probe.due(seen.steps):
                seen.sample, seen.rows = seen.probe.before(seen.steps), rows
            elif rows:  # the gradients of a window whose step is not measured
                self._add(UpdateStats(seen.steps, type(optimizer).__name__, grads=rows), optimizer)
        except Exception as exc:  # the observer never raises into the user's step
            self._error("measuring the optimizer's updates", exc)

    def _after(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if dynamo.compiling() or threading.get_ident() != self._thread:
            return
        seen = self._seen.get(id(optimizer))
        if seen is None:
            return
        try:
            sample, seen.sample = seen.sample, None
            rows, seen.rows = seen.rows, None
            if sample is not None:
                seen.probe.after(sample)
                stats = seen.probe.read(sample)
                stats.grads = rows or []
                self._add(stats, optimizer)
            elif rows:  # no gradient to measure the update on; the window's sums still say what they say
                self._add(UpdateStats(seen.steps, type(optimizer).__name__, grads=rows), optimizer)
            probe = seen.probe
            if probe.low_precision and probe.why_not is None and self.window_due(probe, seen.steps + 1):
                seen.grads = GradAccumulation(probe)  # the next window's micro-batch gradients, in fp32
                seen.grads.start()
        except Exception as exc:
            self._error("measuring the optimizer's updates", exc)

    def _add(self, stats: UpdateStats, optimizer: Any) -> None:
        self.judge.add(stats, optimizer, every=EVERY, untried=UNTRIED)

    def _named(self, optimizer: Any) -> list[tuple[str, torch.Tensor]]:
        """The optimizer's parameters by the names the trace knows them (its modules' own), else by
        their place in the optimizer."""
        named = []
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                name = self.names.get(p)
                named.append((name if isinstance(name, str) else f"param_groups[{g}]['params'][{i}]", p))
        return named

    def _error(self, doing: str, exc: BaseException) -> None:
        text = f"{doing}: {type(exc).__name__}: {exc}"
        if text not in self.errors and len(self.errors) < 5:
            self.errors.append(text)

    # -- the report ----------------------------------------------------------------------------------
    def line(self, low_precision_trained: int) -> tuple[str, str] | None:
        """The summary's "training updates" line: what was judged, or why not. `low_precision_trained`:
        bf16/fp16 trainable parameters a traced backward reached (0: the line is said only when an
        optimizer stepped such weights)."""
        said = self.judge.line()
        if said is not None:
            return said
        if not low_precision_trained:
            return None
        if not self.stepped:
            return ("training updates", "not judged: no optimizer stepped in the traced block")
        return (
            "training updates",
            f"nothing to judge: the {self.stepped} optimizer step(s) stepped no bf16/fp16 parameter "
            "(fp32 master weights, or the low-precision weights are not the optimizer's)",
        )


def low_precision_trainable(names: Provenance) -> int:
    """bf16/fp16 parameters that require grad among the tensors the trace named (its modules')."""
    count = 0
    for ref, _ in list(names.table.values()):
        t = ref()
        if isinstance(t, torch.nn.Parameter) and t.requires_grad and t.dtype in LOW_PRECISION:
            count += 1
    return count
