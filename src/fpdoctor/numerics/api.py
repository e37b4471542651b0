"""`fpdoctor.trace()`: the public context manager around the tracer, blame and headroom."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from types import TracebackType
from typing import Any

from fpdoctor.report.model import Finding, Report, Severity, Trial

_CAPTURES = 4  # producing ops whose inputs a reproducer keeps; blame picks one of the first


class Trace:
    """Context manager; after the block, `.report` holds the Report.

    `raise_on="nonfinite"` raises `NonFiniteError` (a FloatingPointError) at the op that produces
    the first NaN/Inf from finite inputs, before later ops run; without it the block runs to the
    end and the report blames the producer whose values reached what the code sees.
    Overflow of fp16/bf16/fp8 values is always judged per op; `headroom=True` adds per-module
    value histograms (underflow shares, fp16 what-ifs of fp32 modules) at about 10% more cost.
    On accelerators results are read back once per `sync_every` ops (default 256), not per op;
    `immediate=False` reads CPU results that way too. `ranges` takes exact value ranges of the
    fp32 ops that can grow values, for per-op fp16 what-ifs; by default it is on when headroom
    judges an fp16 target. Once the block is entered, `.tracer` is the recording `Tracer` and
    `.tracker` its `ModuleTracker`. `repro=DIR` writes a standalone reproducer of the op of origin
    (numerics/trace/repro.py) into DIR, runs it once in a fresh interpreter and says in the finding
    whether it reproduced; it reads every result at once (a host sync per op on accelerators) so
    that the inputs are copied while alive, and inputs above `repro_limit` bytes are described,
    not saved. A trace that finds nothing writes nothing. Optimizer steps over bf16/fp16 trainable
    weights are measured as the sentinel measures them (`trace_updates`): updates rounded away and
    accumulators that stop growing, and the summary says whether the training updates were judged.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        raise_on: str | None = None,
        headroom: bool = False,
        targets: tuple[str, ...] = ("fp16", "bf16"),
        sync_every: int | None = None,
        immediate: bool | None = None,
        ranges: bool | None = None,
        repro: str | os.PathLike[str] | None = None,
        repro_limit: int | None = None,
    ) -> None:
        if raise_on not in (None, "nonfinite"):
            raise ValueError(f"raise_on must be None or 'nonfinite', got {raise_on!r}")
        if sync_every is not None and (not isinstance(sync_every, int) or sync_every < 1):
            raise ValueError(f"sync_every must be a positive number of ops, got {sync_every!r}")
        from fpdoctor.formats import format_named
        from fpdoctor.numerics.trace.repro import LIMIT, check_dir

        self.repro = check_dir(os.fspath(repro)) if repro is not None else None
        self.repro_limit = LIMIT if repro_limit is None else repro_limit
        self._captures: list[tuple[Any, Any]] = []  # (record, Capture) of the first producing ops

        for target in targets:
            format_named(target)
        self.model = model
        self.raise_on = raise_on
        self.headroom_enabled = headroom
        self.targets = targets
        self.sync_every = sync_every
        # None: read results at once on CPU, in batches on accelerators; False forces batches
        # (how accelerators run) on CPU too.
        # A reproducer copies the producing op's inputs while they are alive: results read at once.
        self.immediate = True if raise_on or repro is not None else immediate
        self.ranges = ranges
        self.report: Report | None = None
        self.records: Any = []  # the tracer's records (a Store) once the block exits
        self._forced_eager = False  # compiled code ran eagerly (a torch too old to run it compiled under the trace)

    def __enter__(self) -> Trace:
        from fpdoctor.numerics.trace.headroom import Headroom
        from fpdoctor.numerics.trace.modules import ModuleTracker
        from fpdoctor.numerics.trace.tracer import Tracer

        roots = [self.model] if self.model is not None else None
        self._headroom = Headroom(self.targets) if self.headroom_enabled else None
        self.tracker = ModuleTracker(roots, on_output=self._module_output)
        # exact ranges of fp32 ops that grow values, for headroom's per-op fp16 what-ifs
        ranges = self.headroom_enabled and "fp16" in self.targets if self.ranges is None else self.ranges
        self.tracer = Tracer(
            self.tracker,
            immediate=self.immediate,
            raise_on=self.raise_on,
            on_nonfinite=self._raise_at_producer if self.raise_on else None,
            sync_every=self.sync_every,
            ranges=ranges,
            on_produced=self._capture if self.repro is not None else None,
        )
        import contextlib
        import threading

        self._thread = threading.get_ident()
        self._stack = contextlib.ExitStack()
        try:
            self._enter_all()
        except BaseException:
            self._stack.close()  # nothing of ours stays installed: global hooks, stance, watch
            raise
        return self

    def _enter_all(self) -> None:
        import sys
        import warnings

        import torch

        from fpdoctor.numerics.compiled import under_trace as trace_compiled
        from fpdoctor.numerics.observe import dynamo

        dynamo.keep_out([*dynamo.fpdoctor_modules(), type(self.tracer)])  # never compiled by Dynamo
        self._compiled: Any = None
        if not trace_compiled.supported() or trace_compiled.compiled_before():
            # a torch whose Dynamo will not compile under a dispatch mode, or graphs compiled
            # before the trace (their calls cannot be wrapped now): compiled code runs eagerly
            # while traced, and the report says so. Only where something was compiled: torch._dynamo
            # is then imported already (importing it costs ~2.6 s and ~77 MiB).
            set_stance = getattr(torch.compiler, "set_stance", None) if "torch._dynamo" in sys.modules else None
            if set_stance is not None:
                self._stack.enter_context(set_stance("force_eager"))
                self._forced_eager = True
        self._warnings = self._stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        from fpdoctor.numerics.trace.recipes import RecipeWatch

        # the optimizers stepped in the block, their parameters known by the records that made them
        self._recipes = self._stack.enter_context(
            RecipeWatch(source_of=self.tracer.provenance.get, position=lambda: self.tracer.records.count)
        )
        from fpdoctor.numerics.trace.steps import StepCounter

        # the optimizer step of each record, told beside the module call count
        self._steps = self._stack.enter_context(StepCounter(lambda: self.tracer.records.count))
        from fpdoctor.numerics.trace.scaled_grads import ScaledGrads

        # gradients of a GradScaler-scaled output (a gradient penalty) read without unscaling them
        self._scaled_grads = self._stack.enter_context(ScaledGrads(lambda: self._steps.steps))
        self.tracer.scaled_grads = self._scaled_grads
        from fpdoctor.numerics.updates.under_trace import TraceUpdates

        # what each optimizer step did to bf16/fp16 trainable weights, measured as the sentinel does
        self._updates = self._stack.enter_context(TraceUpdates(self.tracker.param_names))
        from fpdoctor.numerics.trace.step_batch import StepBatch

        # the dataset indices of the DataLoader batch the step was seen to read: bad rows are named
        # as dataset items too (a framework's loop fetches ahead: not the last batch handed out)
        self.tracker.on_call = self._stack.enter_context(StepBatch(self.tracer)).on_call
        self._stack.enter_context(self.tracker)
        self._stack.enter_context(self.tracer)
        if not self._forced_eager:  # compiled graphs run compiled, each call checked; exits before the tracer
            self._compiled = self._stack.enter_context(trace_compiled.CompiledUnderTrace(self.tracer))

    def _module_output(self, name: str, call: int, output: Any, recompute: bool) -> None:
        import threading

        from fpdoctor.torchprivate import DisableTorchDispatch

        if threading.get_ident() != self._thread:
            return  # a model running in another thread: its ops are not traced
        try:
            with DisableTorchDispatch():  # our own statistics must not be traced
                self.tracer.module_output(name, call, output, recompute)
                if self._headroom is not None and not recompute and self.tracker.phase == "forward":
                    self._headroom.observe_module(name, output, self.tracer.absmax_of, self.tracer)
        except Exception as exc:  # the observer never kills the job
            self.tracer.errors.append(f"module hook {name}: {type(exc).__name__}: {exc}")

    def _capture(self, record: Any, func: Any, args: Any, kwargs: Any, *, outs: Any, written: Any) -> None:
        """The inputs of the first few ops that made NaN/Inf from finite inputs: the op of origin
        blame picks is among them unless it was masked, or came later than these."""
        if len(self._captures) >= _CAPTURES:
            return
        from fpdoctor.numerics.trace.repro import Capture

        try:
            out = outs[0] if len(outs) == 1 else outs
            capture = Capture(func, args, kwargs, out=out, written=written, limit=self.repro_limit)
            self._captures.append((record, capture))
        except Exception as exc:  # the observer never kills the job
            self.tracer.errors.append(f"reproducer capture {record.op}: {type(exc).__name__}: {exc}")

    def _reproduce(self, findings: list[Any], analysis: Any, not_checked: dict[str, str]) -> list[Any]:
        """Write and run the reproducer of the first nonfinite-produced finding's op."""
        import dataclasses

        from fpdoctor.numerics.trace import repro

        at = next((i for i, f in enumerate(findings) if f.name == "nonfinite-produced"), None)
        if at is None or self.repro is None:
            return findings
        finding = findings[at]
        capture = next((c for r, c in self._captures if analysis.where(r) == dict(finding.where)), None)
        if capture is None:
            not_checked["reproducer"] = (
                f"{finding.where.get('op')} was not among the first {_CAPTURES} ops that made NaN/Inf: no reproducer"
            )
            return findings
        if capture.why_not is not None:
            info: dict[str, Any] = {"scripted": False, "why": capture.why_not}
            text = f" No reproducer: {capture.why_not}."
        else:
            directory = repro.write_capture(self.repro, capture, dict(finding.where))
            ran = repro.run_once(directory)
            info = {
                "dir": str(directory),
                "command": f"python {directory / 'repro.py'}",
                "reproduced": bool(ran.get("reproduced")),
                "values_saved": len(capture.values) == len(capture.meta),
                "result": ran.get("message"),
            }
            if "values_matter" in ran:
                info["values_matter"] = ran["values_matter"]
            said = "reproduces it" if info["reproduced"] else "did not reproduce it"
            text = f" Reproducer: python {directory / 'repro.py'} (run once here: {said}; {ran.get('message')})."
        findings = list(findings)
        findings[at] = dataclasses.replace(
            finding, message=finding.message + text, evidence={**finding.evidence, "reproducer": info}
        )
        return findings

    def _step_number(self, position: int) -> int | None:
        """The optimizer step (as the trace counts them: a GradScaler's skipped steps too) under way
        at record `position`."""
        at = self._steps.step_of(position, "optimizer")
        return at[0] if at is not None else None

    def _graph_repro_dir(self) -> str | Callable[[], str]:
        """Where the reproducer of a compiled-only graph goes: `repro=DIR`, else a maker of a new
        private temporary folder (a guessable name in the shared temp folder could be made first by
        someone else, and the reproducer is run from it), called only when there is one to write."""
        if self.repro is not None:
            return str(self.repro)
        import tempfile

        return lambda: tempfile.mkdtemp(prefix=f"fpdoctor-graph-{os.getpid()}-trace-")

    def _raise_at_producer(self, tracer: Any, record: Any) -> None:
        """Called for every non-finite record: classify this one alone (cheap: most are values
        passed on), and build the whole analysis only to word the error we raise."""
        from fpdoctor.numerics.trace.blame import Analysis
        from fpdoctor.numerics.trace.tracer import NonFiniteError

        kinds = [tracer.kind_of(src) for src in record.inputs]
        if not record.inputs:
            produced = record.kind == "nan"  # a NaN constant; an -inf mask is not an error yet
        elif record.kind == "nan":
            produced = "nan" not in kinds
        else:
            produced = not any(kinds)
        # NaN or +Inf arriving in the data is the data's fault, before any op that passes it on
        bad_leaf = next(
            (s for s in record.inputs if s[0] == "leaf" and tracer.leaves[s[1]].kind in ("nan", "+inf")), None
        )
        if not produced and bad_leaf is None:
            return
        analysis = Analysis(tracer, self._steps)
        if bad_leaf is not None:
            finding = analysis.input_finding(tracer.leaves[bad_leaf[1]], [f"{record.op}"])
        else:
            finding = analysis.producer_finding(record, "first NaN" if record.kind == "nan" else "first Inf", [])
        raise NonFiniteError(finding.message, finding)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stack.close()  # the tracer, the tracker's global hooks, the watch, the stance: all, always
        from fpdoctor import progress

        try:
            with progress.task(f"trace: judging the {self.tracer.ops_seen:,} ops traced"):
                self.report = self._build_report()
        except Exception as error:  # never let the report hide the user's own exception
            # what was traced was not judged: never an OK (an "ok" here once hid a NaN behind a bug)
            self.report = Report(
                command="trace",
                data={"status": "incomplete", "not_checked": {"report": f"{type(error).__name__}: {error}"}},
            )
        self.records = self.tracer.records

    def _build_report(self) -> Report:
        from fpdoctor.numerics.trace.blame import Analysis

        tracer = self.tracer
        tracer.finish()
        analysis = Analysis(tracer, self._steps)
        findings = analysis.findings()
        rows: list[dict[str, Any]] = []
        if self._headroom is not None:
            rows = self._headroom.table()
            findings += self._headroom.findings(rows, list(tracer.records))
        else:  # values in fp16/bf16/fp8 are judged per op whether or not headroom is on
            from fpdoctor.numerics.trace.headroom import op_findings, op_overflow

            findings += op_findings(op_overflow(list(tracer.records), targets=()))
        from fpdoctor.numerics.trace.same_line import merged

        findings = merged(findings)  # what a producer's line does later, in the producer's finding
        recipes = self._recipes.findings(list(tracer.records), self._step_number)
        # an update that blew the weights up comes before the NaN it led to: it is the cause, unless the
        # forward or backward made NaN/Inf at or before its step (its gradients were bad: a consequence)
        blown = [_after_the_gradients(f, findings) for f in recipes if f.name == "update-blew-up"]
        caused = [f for f in blown if f.evidence.get("consequence_of_step") is None]
        eps = [f for f in recipes if f.name == "fp16-adam-eps"]
        if caused and eps:  # an Adam that divides by an eps fp16 holds as ~0: the eps blew the update up
            blown = [_of_the_eps(f, eps[0]) if f in caused else f for f in blown]
            findings = (
                eps + findings + blown + [f for f in recipes if f.name not in ("update-blew-up", "fp16-adam-eps")]
            )
        else:
            if caused:
                findings = [_after_the_blowup(f, caused[0]) for f in findings]
            findings = caused + findings + [f for f in blown if f not in caused]
            findings += [f for f in recipes if f.name != "update-blew-up"]
        tracer.errors.extend(self._recipes.errors)
        # running updates outside the optimizer, rounded away (an EMA, a norm's statistics): what the
        # model is evaluated with, before the optimizer's own updates, which slow its training
        findings += tracer.lost_updates.findings(self._recipes.trains)
        findings += tracer.flushed.findings()  # squares flushed to zero: a norm by hand too small
        findings += [_after_zeroed(f, findings) for f in self._updates.findings]
        tracer.errors.extend(self._updates.errors)
        # a penalty on gradients still scaled: the cause of the scaler's skips and of its low scale, first
        scaled = self._scaled_grads.findings()
        if scaled:  # then the scaler's skips are that penalty's, not its calibration: no "nothing to do" beside it
            findings = [_skips_of_scaled(f, scaled[0]) if f.name == "grad-scaler-calibrated" else f for f in findings]
        findings = scaled + findings
        repro_notes: dict[str, str] = {}
        if self.repro is not None:
            try:
                findings = self._reproduce(findings, analysis, repro_notes)
            except Exception as exc:  # the reproducer is ours: its failure is said, the findings stay
                repro_notes["reproducer"] = f"{type(exc).__name__}: {exc}"
        kinds = [r.kind for r in tracer.records if r.kind]
        nonfinite = len(kinds)
        said = str(nonfinite)
        if kinds and all(k == "-inf" for k in kinds) and not any(f.name == "nonfinite-produced" for f in findings):
            # said, so that an OK beside them is read right (where a finding blames an -inf, it is no mask's)
            said += " (-inf only, no NaN: a mask's fill, as a causal mask is)"
        phases = sorted({r.phase for r in tracer.records})
        summary = [
            # an OK says what it judged and what it did not: a trace has no reference to compare with
            ("judged", _judged(tracer.records.count, self._steps.steps, phases)),
            ("ops traced", f"{tracer.records.count} value-producing ops of {tracer.ops_seen} dispatched"),
            ("phases", ", ".join(phases) or "-"),
            ("non-finite ops", said),
            ("optimizer steps", str(self._steps.steps)),
            ("modules with headroom stats", str(len(rows))),
        ]
        from fpdoctor.numerics.updates.under_trace import low_precision_trainable

        trained = low_precision_trainable(self.tracker.param_names) if "backward" in phases else 0
        updates = self._updates.line(trained)
        if updates is not None:  # low-precision trainable weights: whether their updates were judged
            summary.append(updates)
        not_checked = {f"hook error {i}": e for i, e in enumerate(tracer.errors)}
        not_checked.update(repro_notes)
        for name, steps in self._recipes.elsewhere.items():  # torch records a thread's ops in that thread only
            not_checked[f"training in thread {name!r}"] = (
                f"{steps} optimizer step(s) ran in that thread, whose ops the trace does not record (it records the "
                "thread it runs the script in): run the loop in the main thread to trace it, or under "
                "fpdoctor.Sentinel in its own thread (docs/sentinel.md)"
            )
        graph_calls = self._compiled.calls if self._compiled is not None else 0
        if graph_calls:
            from fpdoctor.numerics.compiled import step as compiled

            findings = compiled.seen_in(findings, compiled.EAGER)  # the eager ops around the compiled graphs
            try:  # the first graph that made NaN/Inf, run again apart: its op, or compiled-only
                findings = self._compiled.findings(findings, self._graph_repro_dir())
            except Exception as exc:  # ours: said, the tracer's findings stay
                not_checked["compiled graph"] = f"{type(exc).__name__}: {exc}"
            summary.append(("compiled graph calls", f"{graph_calls} run compiled, each one's outputs checked"))
        if self._forced_eager and self.tracker.saw_compiled:
            from fpdoctor.numerics.compiled import step as compiled

            findings = compiled.seen_in(findings, compiled.EAGER)  # evidence.seen_in: not the compiled program
            not_checked["torch.compile"] = (
                "compiled code ran eagerly while traced (set_stance force_eager), as it was compiled before "
                "the trace began: the ops are the model's own, not the fused kernels; compile inside the "
                "traced block (or trace the whole script) to check the compiled graphs"
            )
        return Report(
            command="trace",
            findings=findings,
            data={
                "summary": summary,
                "headroom": rows,
                "not_checked": not_checked,
                "ops": tracer.records.count,
                "nonfinite_ops": nonfinite,
                # the training ran in threads the trace does not record, none in its own: no verdict
                # (the main thread's set-up ops, the data and the model made, are no training)
                **({"status": "not checked"} if self._recipes.elsewhere and not self._recipes.steps else {}),
            },
        )


def _judged(ops: int, steps: int, phases: list[str]) -> str:
    """What a trace judged, and what only a reference would show."""
    over = f" over {steps} optimizer step(s)" if steps else ""
    return (
        f"the outputs of {ops:,} ops{over} ({', '.join(phases) or 'none ran'}) for NaN/Inf, and fp16/bf16 values "
        "against their format's range; not compared with a reference: how far the run is from fp32 is "
        "`fpdoctor watch`'s reference step (steps 1, 10, 100, then paced; none where the loss reads gradients, "
        "create_graph=True) or `fpdoctor compare`'s forward against fp64 (the model alone)"
    )


def trace(
    model: Any = None,
    *,
    raise_on: str | None = None,
    headroom: bool = False,
    targets: tuple[str, ...] = ("fp16", "bf16"),
    sync_every: int | None = None,
    repro: str | os.PathLike[str] | None = None,
) -> Trace:
    """Trace the block for the op that produces NaN/Inf; see `Trace`."""
    return Trace(model, raise_on=raise_on, headroom=headroom, targets=targets, sync_every=sync_every, repro=repro)


# What a NaN/Inf after weights that blew up is reported as: its op's own fix (a precision, an
# epsilon) was checked on that step's values, which the diverging weights made; later steps grow past it.
_AFTER_BLOWUP = ("nonfinite-produced", "nonfinite-input", "grad-scaler-stalled", "overflow-near-limit")


def _after_the_blowup(finding: Finding, blown: Finding) -> Finding:
    """A finding of a step after the update that blew the weights up, with that update as its fix:
    where the weights keep growing, a fix at the op that overflowed only moves the step where it does."""
    step, at = finding.evidence.get("step"), blown.evidence.get("optimizer_step")
    if finding.name not in _AFTER_BLOWUP or not isinstance(step, int) or not isinstance(at, int) or step <= at:
        return finding
    growth = blown.evidence.get("growth")
    grown = f"{growth:.3g}x" if isinstance(growth, float) else "to non-finite values"
    span = f"steps {blown.evidence.get('from_step', at)}-{at}"
    return dataclasses.replace(
        finding,
        message=finding.message + f" The weights it runs on had grown {grown} over {span} (update-blew-up, first).",
        evidence={**finding.evidence, "after_blowup_step": at},
        fix=f"Lower the learning rate and clip the gradients, as update-blew-up says: the weights grew {grown} over "
        f"{span} before step {step}, and weights that keep growing overflow any format, so a change at this op "
        "(fp32, bf16, an epsilon) only moves the step where they do.",
        trial=Trial.untried(
            "a change at this op was measured on this step's values, which the diverging weights made; the run "
            "would overflow again later (update-blew-up)"
        ),
    )


def _after_zeroed(found: Finding, findings: list[Finding]) -> Finding:
    """An optimizer's updates rounded away at a step after gradients were zeroed by an Inf turned into 0
    (a clip_grad_norm_ whose norm overflowed, NUM008): what it measured is what the momentum left of
    earlier steps, a consequence, told as such with that finding's fix first."""
    step = found.evidence.get("step")
    zeroed = [
        f.evidence["step"] for f in findings if f.name == "nonfinite-zeroed" and isinstance(f.evidence.get("step"), int)
    ]
    if found.evidence.get("kind") != "rounded-away" or not isinstance(step, int) or not zeroed or min(zeroed) > step:
        return found
    at = min(zeroed)
    return dataclasses.replace(
        found,
        message=found.message + f" From step {at} the gradients were zeroed (nonfinite-zeroed above): the updates "
        "measured here are what the optimizer's momentum left of earlier steps, a consequence of that first.",
        evidence={**found.evidence, "after_zeroed_step": at},
        fix=f"Fix nonfinite-zeroed first (the gradients zeroed from step {at}); then, if updates still round away: "
        + (found.fix or ""),
    )


def _of_the_eps(blown: Finding, eps: Finding) -> Finding:
    """update-blew-up where the same run's Adam divides by an eps that fp16 holds as ~0 (fp16-adam-eps):
    the update's size is the division's, and a lower rate or clipping does not move the step at
    which it fails; the eps, first, is the cause."""
    return dataclasses.replace(
        blown,
        severity=Severity.WARNING,
        title="The update blew the weights up by dividing by Adam's eps, which is ~0 in fp16: a consequence",
        message=blown.message.split(" The next forward")[0]
        + f" Its eps ({eps.evidence.get('eps'):g}) is {eps.evidence.get('eps_in_fp16'):.3g} in fp16 (fp16-adam-eps, "
        "first): where the second moment is small the update divides by ~0, so its size is the eps's, not the "
        "learning rate's.",
        evidence={**blown.evidence, "consequence_of": "fp16-adam-eps"},
        fix="Fix the eps first, as fp16-adam-eps says. A lower learning rate or gradient clipping does not change "
        "the step at which it fails: the division by ~0 is the same.",
        trial=Trial.untried("the eps is the cause: fp16-adam-eps carries the fix"),
    )


def _after_the_gradients(blown: Finding, findings: list[Finding]) -> Finding:
    """update-blew-up as a consequence where the forward or backward made NaN/Inf at or before the
    update's step: the update carried bad gradients into the weights, and a lower learning rate or
    clipping does not move the step at which it fails."""
    step = blown.evidence.get("optimizer_step")
    made = [
        f.evidence["step"]
        for f in findings
        if f.name in ("nonfinite-produced", "nonfinite-input")
        and f.where.get("phase") in ("forward", "backward")
        and isinstance(f.evidence.get("step"), int)
    ]
    # a gradient the optimizer read non-finite from a backward not seen op by op (a compiled graph's)
    made += [
        f.evidence["step"]
        for f in findings
        if f.name == "nonfinite-input"
        and f.evidence.get("origin") == "gradient"
        and isinstance(f.evidence.get("step"), int)
    ]
    # a GradScaler whose 1/scale overflowed handed the optimizer NaN gradients it did not skip
    made += [
        s
        for f in findings
        if f.name == "grad-scaler-stalled"
        for s in (f.evidence.get("scale_out_of_range") or {}).get("applied_steps") or []
        if isinstance(s, int)
    ]
    first = min(made, default=None)
    if step is None or first is None or first > step:
        return blown
    return dataclasses.replace(
        blown,
        severity=Severity.WARNING,
        title=f"The update at step {step} carried non-finite gradients into the weights: a consequence",
        message=blown.message.split(" The next forward")[0]
        + f" The forward or backward had already made NaN/Inf at step {first} (the finding above names the op): "
        "the update was handed non-finite gradients, so it is their consequence, not a learning rate too high.",
        evidence={**blown.evidence, "consequence_of_step": first},
        fix="Fix the op that made the gradients non-finite (the first finding). A lower learning rate or gradient "
        "clipping does not change the step at which it fails: the update only passed the NaN on.",
        trial=Trial.untried("the update was handed non-finite gradients: the op that made them carries the trial"),
    )


def _skips_of_scaled(found: Finding, cause: Finding) -> Finding:
    """The scaler's skips where gradients of its scaled output are read unscaled (a penalty): the
    scale fell to where the penalty fits, which the cause's fix takes away."""
    skipped, steps = found.evidence.get("skipped"), found.evidence.get("steps")
    first, last = found.evidence.get("scale_first"), found.evidence.get("scale_last")
    return dataclasses.replace(
        found,
        title=found.title.replace("while calibrating its scale", f"on the gradients {cause.code} reads scaled"),
        message=(
            f"GradScaler found non-finite gradients and skipped {skipped} of {steps} steps (scale {first:g} -> "
            f"{last:g}). They are {cause.code}'s: its penalty reads gradients still multiplied by the scale, so the "
            "scale fell until that penalty fitted; that is not the scaler calibrating."
            if None not in (skipped, steps, first, last)
            else f"GradScaler skipped steps on the gradients {cause.code} reads scaled: its penalty reads them still "
            "multiplied by the scale, so the scale fell until that penalty fitted; that is not the scaler calibrating."
        ),
        fix=f"Unscale those gradients as {cause.code} says; these skips go with it.",
        trial=Trial.untried(f"the change is {cause.code}'s fix, in the training code"),
    )  # fmt: skip
