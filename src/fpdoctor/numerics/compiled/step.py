"""A bad step of a compiled model: seen in the compiled program, or only in its eager re-run.

The step check (loss and gradient flags) reads what the compiled program computed; a replay runs
under `trace`, where compiled code runs eagerly (the ops are the model's own, not the fused
kernels). So every finding says where it was seen (`evidence.seen_in`): "compiled" or "eager
replay". When the eager replay is finite, the step is run once more compiled, as it ran (same
batch, RNG state and weights; the graphs already compiled for these shapes, so nothing is
recompiled): non-finite again means the compiled program makes NaN/Inf that the model's eager
math does not (`compiled-only-nonfinite`); finite means the fault followed the run's history,
as for an eager model (`transient-fault-suspected`). Under `trace` the graphs compiled in the
block run compiled (numerics/compiled/under_trace.py): the first bad graph's finding says "compiled",
those of the eager ops around the graphs "eager". `OutputCheck` names the first
compiled module whose outputs went non-finite in a bad step (`evidence.compiled_output`).
"""

from __future__ import annotations

import contextlib
import math
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.compiled.graphs import GraphCheck, nonfinite_of
from fpdoctor.numerics.observe import dynamo
from fpdoctor.numerics.observe.batches import MicroBatch, OutputsOnly
from fpdoctor.numerics.observe.gradcheck import grads_of, loss_flag, nonfinite_flag
from fpdoctor.preserve import preserved
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding
from fpdoctor.torchprivate import compiled_inner

COMPILED = "compiled"
EAGER_REPLAY = "eager replay"
EAGER = "eager"  # under trace: seen in eager ops (those around compiled graphs, or compiled code run eagerly)
# what the step check itself saw: the compiled program's loss and gradients
_SEEN_BY_THE_CHECK = ("nonfinite-loss", "nonfinite-gradient", "loss-spike", "transient-fault-suspected")


def seen_in(found: Sequence[Finding], where: str, names: Sequence[str] | None = None) -> list[Finding]:
    """`found` with evidence.seen_in = `where` (those named in `names` only, when given)."""
    return [
        replace(f, evidence={**f.evidence, "seen_in": where}) if names is None or f.name in names else f for f in found
    ]


def label_step_findings(
    found: Sequence[Finding], graphs: dict[int, dict[str, Any]], first_graphs: dict[int, dict[str, Any]] | None = None
) -> list[Finding]:
    """A compiled model's step findings: those of the step check were seen in the compiled program,
    and name the first compiled module whose outputs were non-finite in that step (`graphs`, by
    step) and the first Dynamo graph (`first_graphs`, by step: its id, user lines, modules, ops)."""
    out = []
    for f in found:
        if f.name in _SEEN_BY_THE_CHECK or f.name == "compiled-only-nonfinite":
            step = f.evidence.get("step", -1)
            graph = graphs.get(step)
            first = (first_graphs or {}).get(step)
            extra = {
                "seen_in": f.evidence.get("seen_in", COMPILED),
                **({"compiled_output": graph} if graph else {}),
                **({"compiled_graph": first} if first and "compiled_graph" not in f.evidence else {}),
            }
            out.append(replace(f, evidence={**f.evidence, **extra}))
        else:
            out.append(f)
    return out


def rerun_compiled(
    model: nn.Module,
    params: list[torch.Tensor],
    step_fn: Callable[..., Any],
    window: list[MicroBatch],
    contexts: list[contextlib.AbstractContextManager[Any]],
) -> tuple[bool, float]:
    """The window run again as it ran, compiled and untraced: (non-finite, the loss). Gradients
    and buffers are put back by the caller and `preserved`; nothing reaches the weights."""
    loss_value = math.nan
    try:
        with contextlib.ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            stack.enter_context(preserved(model))
            for micro in window:
                for p in params:
                    p.grad = None
                micro.rng.restore()
                loss = step_fn(*micro.args, **micro.kwargs)
                device = params[0].device if params else torch.device("cpu")
                unseen = loss is None or isinstance(loss, OutputsOnly)
                bad_outputs = isinstance(loss, OutputsOnly) and not loss.finite
                seen = torch.as_tensor(math.nan if bad_outputs else 0.0) if unseen else torch.as_tensor(loss)
                flags = torch.stack([loss_flag(seen, device), nonfinite_flag(grads_of(params), device)])
                loss_bad, grad_bad = flags.tolist()
                loss_value = math.nan if unseen else float(seen.detach().float().mean())
                if loss_bad or grad_bad:
                    return True, loss_value
    finally:
        for p in params:
            p.grad = None
    return False, loss_value


def compiled_only_finding(
    step: int,
    kind: str | None,
    eager_loss: float,
    compiled_loss: float,
    here: dict[str, Any],
    *,
    graph: dict[str, Any] | None = None,
) -> Finding:
    """The compiled step is non-finite twice; the same step run eagerly is finite. `graph`: what
    `graph_evidence` found of the first graph that made it."""
    finding = catalog.make(
        "compiled-only-nonfinite",
        message=(
            f"Step {step} was non-finite in the compiled program, and again when run compiled a second time with "
            "the same batch, RNG state and weights; run eagerly under trace it was finite"
            + (f" (loss {eager_loss:.4g})" if math.isfinite(eager_loss) else "")
            + ": the compiled kernels compute something the model's eager ops do not (a fusion, a decomposition, "
            "a lowering or a reduction in lower precision)."
        ),
        where={"module": None, "op": None, "phase": None, "step": step, **here},
        evidence={
            "kind": kind,
            "step": step,
            "count": 1,
            "numel": 1,
            "seen_in": COMPILED,
            "eager_replay_loss": eager_loss,
            "compiled_rerun_loss": compiled_loss,
        },
    )
    if not graph:
        return finding
    return replace(finding, message=finding.message + graph_sentence(graph), evidence={**finding.evidence, **graph})


def graph_evidence(captured: Any, repro_dir: str | Callable[[], str] | None) -> dict[str, Any]:
    """The first graph whose finite inputs gave NaN/Inf in the compiled re-run (`graphs.Captured`),
    run eagerly node by node, then recompiled alone, with emulate_precision_casts and bisected
    (numerics/compiled/rerun.py), and written as a reproducer into `repro_dir` (run once). A
    callable `repro_dir` makes a new folder only when there is a reproducer to write, and the folder
    is removed again when none could be written: a run never leaves an empty folder behind."""
    from fpdoctor.numerics.compiled import repro as graph_repro
    from fpdoctor.numerics.compiled import rerun as graph_rerun

    out: dict[str, Any] = {"compiled_graph": {**captured.graph.covers(), "bad_outputs": captured.bad_outputs}}
    try:
        origin = graph_rerun.eager_origin(captured)
    except Exception as exc:
        out["graph_eager"] = f"could not run eagerly: {type(exc).__name__}: {exc}"[:300]
        return out
    if origin is not None:  # the graph's own eager ops make it from these inputs
        out["graph_eager"] = "non-finite"
        out["graph_eager_origin"] = origin
        return out
    out["graph_eager"] = "finite"
    settled = graph_rerun.settle(captured)
    out["graph_compiled"] = settled
    if settled.get("recompiled") == "non-finite" and repro_dir is not None:
        made = repro_dir() if callable(repro_dir) else None
        try:
            sides = settled.get("sides") or (settled.get("bisect") or {}).get("sides")
            out["reproducer"] = graph_repro.write_and_run(made or str(repro_dir), captured, sides)
        except Exception as exc:
            out["reproducer"] = {"scripted": False, "why": f"{type(exc).__name__}: {exc}"[:300]}
        if made is not None and not out["reproducer"].get("scripted", True):
            with contextlib.suppress(OSError):  # only an empty folder: whatever was written stays
                os.rmdir(made)
    return out


def graph_sentence(graph: dict[str, Any]) -> str:
    """What the finding's message adds of the graph."""
    from fpdoctor.numerics.compiled import rerun as graph_rerun

    covers = graph.get("compiled_graph") or {}
    where = ", ".join(covers.get("lines") or covers.get("modules") or []) or "no user line recorded"
    text = f" The first graph to make it: Dynamo graph {covers.get('id')} ({covers.get('backend')}; {where})"
    if graph.get("graph_eager") == "finite":
        text += ", finite when its ops ran eagerly on the same inputs"
    elif graph.get("graph_eager") == "non-finite":
        origin = graph.get("graph_eager_origin") or {}
        text += f", non-finite eagerly too, from {origin.get('op')} at {origin.get('line') or 'an unrecorded line'}"
    said = graph_rerun.describe(graph.get("graph_compiled") or {})
    text += f"; {said}." if said else "."
    made = graph.get("reproducer") or {}
    if made.get("command"):
        text += (
            f" Reproducer: {made['command']} ({'reproduces it' if made.get('reproduced') else 'did not reproduce it'})."
        )
    elif made:
        text += f" No reproducer: {made.get('why')}."
    return text


class OutputCheck:
    """A finite check on what each compiled module of the model returns (`torch.compile(module)`'s
    wrappers, the model's own or its blocks'): per call, one fused reduction over its floating
    outputs, left on the device. Nothing is read on a healthy step; on a bad one, one read names
    the first compiled module (in call order) whose outputs were non-finite: where the compiled
    program made the NaN/Inf, or passed it on. The hook goes on the wrapper, outside the compiled
    code: Dynamo neither traces it nor guards on it, so nothing is recompiled."""

    def __init__(self, model: nn.Module) -> None:
        self._calls: list[tuple[str, torch.Tensor]] = []  # (module name, flag) per call in this window
        self._handles: list[Any] = []
        self.graphs = GraphCheck()  # the same, graph by graph (numerics/compiled/graphs.py)
        check = weakref.ref(self)
        for name, module in model.named_modules():
            if compiled_inner(module) is not None:
                self._handles.append(module.register_forward_hook(_output_hook(check, name or "<root>")))

    def begin(self) -> None:
        """A new window: the calls of the last one are forgotten."""
        self._calls = []
        self.graphs.begin()

    def first_bad(self) -> dict[str, Any] | None:
        """The first compiled module call of the window with a non-finite output (one read)."""
        if not self._calls:
            return None
        flags = torch.stack([flag.to(self._calls[0][1].device) for _, flag in self._calls]).tolist()
        counts: dict[str, int] = {}
        for (name, _), bad in zip(self._calls, flags, strict=True):
            counts[name] = counts.get(name, 0) + 1
            if bad:
                return {"module": name, "call": counts[name], "compiled_calls": len(self._calls)}
        return None

    def close(self) -> None:
        self.graphs.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def note(self, name: str, output: Any) -> None:
        tensors = [t for t in tensors_in(output) if (t.is_floating_point() or t.is_complex()) and t.numel()]
        if tensors:
            # a flag that writes nothing: autograd may have saved these outputs for the backward
            self._calls.append((name, nonfinite_of([t.detach() for t in tensors if t.numel()])))


def _output_hook(check: weakref.ref[OutputCheck], name: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        owner = check()
        if owner is None or dynamo.compiling():
            return
        with contextlib.suppress(Exception):  # the observer never kills the job: this call goes unchecked
            owner.note(name, output)

    return hook
