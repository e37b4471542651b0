"""`fpdoctor.trace()`: the public context manager around the tracer, blame and headroom."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from fpdoctor.report.model import Report


class Trace:
    """Context manager; after the block, `.report` holds the Report (SPEC 3.4).

    `raise_on="nonfinite"` raises `NonFiniteError` (a FloatingPointError) at the op that produces
    the first NaN/Inf from finite inputs, before later ops run; without it the block runs to the
    end and the report blames the producer whose values reached what the code sees.
    Overflow of fp16/bf16/fp8 values is always judged per op; `headroom=True` adds per-module
    value histograms (underflow shares, fp16 what-ifs of fp32 modules) at about 10% more cost.
    """

    def __init__(
        self,
        model: Any = None,
        *,
        raise_on: str | None = None,
        headroom: bool = False,
        targets: tuple[str, ...] = ("fp16", "bf16"),
        sync_every: int | None = None,
    ) -> None:
        if raise_on not in (None, "nonfinite"):
            raise ValueError(f"raise_on must be None or 'nonfinite', got {raise_on!r}")
        from fpdoctor.numerics.limits import format_named

        for target in targets:
            format_named(target)
        self.model = model
        self.raise_on = raise_on
        self.headroom_enabled = headroom
        self.targets = targets
        self.sync_every = sync_every
        self.report: Report | None = None
        self.records: list[Any] = []

    def __enter__(self) -> Trace:
        from fpdoctor.numerics import trace as trace_mod
        from fpdoctor.numerics.headroom import Headroom
        from fpdoctor.numerics.modules import ModuleTracker

        if self.sync_every:
            trace_mod.SYNC_EVERY = self.sync_every
        roots = [self.model] if self.model is not None else None
        self._headroom = Headroom(self.targets) if self.headroom_enabled else None
        self._tracker = ModuleTracker(roots, on_output=self._module_output)
        self._tracer = trace_mod.Tracer(
            self._tracker,
            immediate=True if self.raise_on else None,
            raise_on=self.raise_on,
            on_nonfinite=self._raise_at_producer if self.raise_on else None,
        )
        import contextlib
        import warnings

        import torch

        self._stack = contextlib.ExitStack()
        # torch.compile'd code runs eagerly while traced, so every op is seen; the report says so.
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None:
            self._stack.enter_context(set_stance("force_eager"))
        self._warnings = self._stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
        from fpdoctor.numerics.recipes import RecipeWatch

        self._recipes = self._stack.enter_context(RecipeWatch())  # the optimizers stepped in the block
        self._tracker.__enter__()
        self._tracer.__enter__()
        return self

    def _module_output(self, name: str, call: int, output: Any, recompute: bool) -> None:
        import torch

        try:
            with torch._C._DisableTorchDispatch():  # our own statistics must not be traced
                self._tracer.module_output(name, call, output, recompute)
                if self._headroom is not None and not recompute and self._tracker.phase == "forward":
                    self._headroom.observe_module(name, output, self._tracer.absmax_of, self._tracer)
        except Exception as exc:  # the observer never kills the job
            self._tracer.errors.append(f"module hook {name}: {type(exc).__name__}: {exc}")

    def _raise_at_producer(self, tracer: Any, record: Any) -> None:
        from fpdoctor.numerics.blame import Analysis
        from fpdoctor.numerics.trace import NonFiniteError

        analysis = Analysis(tracer)
        role = analysis.roles.get(record.index)
        if role in ("nan-producer", "inf-producer") or (role == "constant" and record.kind == "nan"):
            finding = analysis.producer_finding(record, "first NaN" if record.kind == "nan" else "first Inf", [])
            raise NonFiniteError(finding.message, finding)
        bad_leaves = [s for s in record.inputs if s[0] == "leaf" and analysis.leaves[s[1]].kind == "nan"]
        if bad_leaves:
            leaf = analysis.leaves[bad_leaves[0][1]]
            finding = analysis._input_finding(leaf, [f"{record.op}"])
            raise NonFiniteError(finding.message, finding)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tracer.__exit__(exc_type, exc, tb)
        self._tracker.__exit__()
        self._stack.close()
        try:
            self.report = self._build_report()
        except Exception as error:  # never let the report hide the user's own exception
            self.report = Report(command="trace", data={"not_checked": {"report": f"{type(error).__name__}: {error}"}})
        self.records = self._tracer.records

    def _build_report(self) -> Report:
        from fpdoctor.numerics.blame import Analysis

        tracer = self._tracer
        tracer.finish()
        analysis = Analysis(tracer)
        findings = analysis.findings()
        rows: list[dict[str, Any]] = []
        if self._headroom is not None:
            rows = self._headroom.table()
            findings += self._headroom.findings(rows, tracer.records)
        findings += self._recipes.findings(tracer.records)
        tracer.errors.extend(self._recipes.errors)
        nonfinite = sum(1 for r in tracer.records if r.kind)
        phases = sorted({r.phase for r in tracer.records})
        summary = [
            ("ops traced", f"{len(tracer.records)} value-producing ops of {tracer.ops_seen} dispatched"),
            ("phases", ", ".join(phases) or "-"),
            ("non-finite ops", str(nonfinite)),
            ("modules with headroom stats", str(len(rows))),
        ]
        not_checked = {f"hook error {i}": e for i, e in enumerate(tracer.errors)}
        if self._tracker.saw_compiled:
            not_checked["torch.compile"] = (
                "compiled code ran eagerly while traced (set_stance force_eager): the ops "
                "are the model's own, not the fused kernels; compare with an untraced run"
            )
        return Report(
            command="trace",
            findings=findings,
            data={
                "summary": summary,
                "headroom": rows,
                "not_checked": not_checked,
                "ops": len(tracer.records),
                "nonfinite_ops": nonfinite,
            },
        )


def trace(
    model: Any = None,
    *,
    raise_on: str | None = None,
    headroom: bool = False,
    targets: tuple[str, ...] = ("fp16", "bf16"),
) -> Trace:
    """Trace the block for the op that produces NaN/Inf; see `Trace`."""
    return Trace(model, raise_on=raise_on, headroom=headroom, targets=targets)
