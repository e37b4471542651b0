"""Compiled code under `trace`: the compiled program runs as compiled, each graph call checked.

The trace's dispatch mode declares `ignore_compile_internals`, so Dynamo compiles and runs a frame
entered under the trace, with the mode off while it traces (nothing of ours enters a graph).
Around each graph call (numerics/compiled/graphs.py's wrapper, `run_through`) the mode steps aside: off
the dispatch stack while the compiled program and the graph's finite check run, back after. The
graph's backward (AOTAutograd's node in the autograd graph) runs with the mode aside too, through
a pre-hook and a hook on that node. The eager ops around the graphs are traced as ever; a
graph's outputs are told to the tracer as made by that graph, so an eager op that gets NaN/Inf
from one names the graph, not "an input tensor".

Every graph call is read at once (`GraphCheck.capturing`): the first one whose finite inputs
gave non-finite outputs keeps a copy of its inputs, and after the block it is run again apart
(numerics/compiled/step.py's `graph_evidence`, as for the sentinel): eagerly node by node (the op of
origin and its user line), else recompiled, with emulate_precision_casts, and bisected
(`compiled-only-nonfinite`), with a reproducer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.compiled import graphs
from fpdoctor.numerics.compiled import step as compiled
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Trial
from fpdoctor.torchprivate import DisableTorchDispatch, TorchDispatchMode, dynamo_output_codes, mode_stack
from fpdoctor.torchprivate import current_mode as _get_current_dispatch_mode
from fpdoctor.torchprivate import pop_mode as _pop_mode
from fpdoctor.torchprivate import push_mode as _push_mode

LABEL = "an output of compiled graph "  # the tracer's name for a tensor a compiled graph made
if TYPE_CHECKING:
    from fpdoctor.numerics.trace.tracer import Tracer

_DEPTH = 3  # autograd nodes searched under an output for the compiled backward (views, aliases)


def supported() -> bool:
    """This torch lets a dispatch mode ask Dynamo to compile under it (torch 2.8 and later)."""
    return hasattr(TorchDispatchMode, "ignore_compile_internals")


def compiled_before() -> bool:
    """Code Dynamo compiled before now is alive (until torch._dynamo.reset()): its graphs'
    callables are not wrapped (graphs.py), so the trace could not step aside around them."""
    if "torch._dynamo" not in sys.modules:
        return False
    return any(True for _ in dynamo_output_codes())


class CompiledUnderTrace:
    """Steps `tracer` aside around compiled graphs while open; `captured` gets the first bad call."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.calls = 0
        self.captured: list[graphs.Captured] = []
        self._weights_kept = False
        self._aside: list[Any] = []  # modes stepped aside for a compiled backward now running
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> CompiledUnderTrace:
        check = graphs.GraphCheck(on_import=True)
        self._stack.callback(check.close)
        self.captured = self._stack.enter_context(check.capturing())
        self._stack.enter_context(graphs.run_through(self._run))
        return self

    def __exit__(self, *exc: object) -> None:
        # A backward that raised between its node's pre-hook and hook: the autograd engine puts
        # back the dispatch stack it ran under, so the mode goes back only where it is missing
        # (a second copy would stay on the user's stack after the trace).
        while self._aside:
            mode = self._aside.pop()
            if not any(m is mode for m in mode_stack()):
                _push_mode(mode)
        self._stack.close()

    def _run(self, graph: graphs.CompiledGraph, call: Callable[[], Any]) -> Any:
        if _get_current_dispatch_mode() is not self.tracer:  # another thread, or a mode of the user's on top
            return call()
        mode = _pop_mode()
        try:
            out = call()
        finally:
            _push_mode(mode)
        self.calls += 1
        try:
            with DisableTorchDispatch():  # our bookkeeping is not the user's ops
                if self.captured and not self._weights_kept:
                    self._keep_weights(self.captured[0])
                self.tracer.made_by_compiled(list(tensors_in(out)), graph.compile_id)
                self._aside_in_backward(out, graph.compile_id)
        except Exception as exc:  # the observer never kills the job
            self.tracer.errors.append(f"compiled graph {graph.compile_id}: {type(exc).__name__}: {exc}")
        return out

    def _keep_weights(self, captured: graphs.Captured) -> None:
        """The bad call's parameters, copied now: unlike the sentinel's bad step, the traced one
        goes on to the optimizer step, which may write the weights before the graph is run again."""
        self._weights_kept = True
        captured.inputs = [
            v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.nn.Parameter) else v
            for v in captured.inputs
        ]

    def _aside_in_backward(self, out: Any, graph: str) -> None:
        """A pre-hook and a hook on the graph's backward node: the mode is aside while it runs,
        and the gradients it returns are told to the tracer as made by the graph's backward."""
        seen: set[int] = set()
        todo: list[tuple[Any, int]] = [(t.grad_fn, 0) for t in tensors_in(out) if t.grad_fn is not None]
        while todo:
            node, depth = todo.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if "CompiledFunction" in node.name():
                node.register_prehook(self._step_aside)
                node.register_hook(functools.partial(self._step_back, f"{graph} (its backward)"))
            elif depth < _DEPTH:
                todo.extend((n, depth + 1) for n, _ in node.next_functions)

    def _step_aside(self, grad_outputs: Any) -> None:
        if _get_current_dispatch_mode() is self.tracer:
            self._aside.append(_pop_mode())

    def _step_back(self, graph: str, grad_inputs: Any, grad_outputs: Any) -> None:
        if self._aside:
            _push_mode(self._aside.pop())
            with contextlib.suppress(Exception), DisableTorchDispatch():  # the observer never kills the job
                self.tracer.made_by_compiled([g for g in grad_inputs if isinstance(g, torch.Tensor)], graph)

    def findings(self, found: list[Finding], repro_dir: str | Callable[[], str] | None) -> list[Finding]:
        """`found` with the first bad graph's finding in place of the tracer's findings of its
        outputs (NaN/Inf that came into eager ops from the graph)."""
        if not self.captured:
            return found
        captured = self.captured[0]
        evidence = compiled.graph_evidence(captured, repro_dir)
        # NaN/Inf out of any compiled graph (or its backward) follows from the first bad one
        rest = [f for f in found if not (f.name == "nonfinite-input" and str(f.where.get("input")).startswith(LABEL))]
        return [graph_finding(evidence), *rest]


def graph_finding(evidence: dict[str, Any]) -> Finding:
    """The first compiled graph whose finite inputs gave NaN/Inf under the trace: the op of origin
    where its ops run eagerly make it too, else `compiled-only-nonfinite`."""
    covers = evidence.get("compiled_graph") or {}
    graph = f"Dynamo graph {covers.get('id')} ({covers.get('backend')})"
    origin = evidence.get("graph_eager_origin")
    if origin is not None:
        line = origin.get("line")
        return catalog.make(
            "nonfinite-produced",
            message=(
                f"{origin.get('op')} made NaN/Inf from finite inputs in compiled {graph}; its ops run eagerly on the "
                "same inputs make it too." + (f" Source: {line}." if line else "")
            ),
            where={"module": None, "op": origin.get("op"), "phase": "forward"},
            evidence={**evidence, "seen_in": compiled.COMPILED, "location": line},
            trial=Trial.untried(
                "the graph's ops were re-run eagerly on the same inputs and make it too; the op's advice was not "
                "re-run in another precision"
            ),
        )
    finding = catalog.make(
        "compiled-only-nonfinite",
        message=(
            f"The compiled program made NaN/Inf from finite inputs in {graph} while traced: the compiled kernels "
            "compute something the model's eager ops do not (a fusion, a decomposition, a lowering or a reduction "
            "in lower precision)."
        ),
        where={"module": None, "op": None, "phase": "forward"},
        evidence={**evidence, "seen_in": compiled.COMPILED},
    )
    return dataclasses.replace(finding, message=finding.message + compiled.graph_sentence(evidence))
