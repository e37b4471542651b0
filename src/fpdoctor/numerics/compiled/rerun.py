"""The first compiled graph that made NaN/Inf from finite inputs, run again apart from the step.

With the graph's inputs kept (numerics/compiled/graphs.py's `capturing`), the graph is run:
- eagerly, node by node (the torch ops Dynamo captured, each checked as it returns): the first
  node whose finite inputs gave NaN/Inf is the op of origin, with its user line;
- when eager is finite, compiled again by the same backend, apart from the step: non-finite
  again means the compiled program itself makes it (`compiled-only-nonfinite`);
- then with `torch._inductor.config.emulate_precision_casts=True` (Inductor rounding its
  low-precision intermediates as eager does): finite then means a precision difference;
- and, where that does not settle it, bisected with PyTorch's own `CompilerBisector` (backends
  eager, aot_eager, aot_eager with decompositions, Inductor; then Inductor's subsystems and
  passes one application at a time), with the environment variables that give each side.
Every compile here is of a copy of the graph, called directly (not through Dynamo: nothing is
added to the program's compiled code), and torch's own console output is kept off the user's.
"""

from __future__ import annotations

import contextlib
import copy
import io
from typing import Any

import torch

from fpdoctor.numerics.compiled.graphs import (
    Captured,
    CompiledGraph,
    all_finite,
    copy_value,
    flat,
    floats,
    op_name,
    user_line,
)
from fpdoctor.torchprivate import bisect_setting, compiler_bisector, inductor_config, lookup_backend


def eager_origin(captured: Captured) -> dict[str, Any] | None:
    """The graph run eagerly, node by node: None when every output is finite, else the first node
    whose inputs were finite and whose result was not (its op and user line)."""

    found: list[dict[str, Any]] = []

    class Checked(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if not found and n.op in ("call_function", "call_method", "call_module"):
                args = [a for a in n.all_input_nodes if a.name in self.env]
                ins = [t for a in args for t in floats(self.env[a])]
                outs = floats(result)
                if outs and not all_finite(outs) and all_finite(ins):
                    found.append({"op": op_name(n), "node": n.name, "line": user_line(n)})
            return result

    gm = fresh(captured.graph)
    with torch.no_grad():  # values only: no autograd graph kept for a backward that never runs
        outputs = Checked(gm).run(*[copy_value(a) for a in captured.inputs])
    if all_finite(floats(outputs)):
        return None
    return found[0] if found else {"op": None, "node": None, "line": None}


def fresh(graph: CompiledGraph) -> torch.fx.GraphModule:
    """A new copy of the graph: a backend's passes change the graph they are given."""
    return torch.fx.GraphModule(graph.gm, copy.deepcopy(graph.gm.graph))


def run_compiled(graph: CompiledGraph, inputs: list[Any], backend: Any, config: dict[str, Any] | None = None) -> bool:
    """Compile a copy of the graph with `backend` (Inductor's `config` patched on), run it on
    copies of `inputs`: True when an output is non-finite."""
    with inductor_config().patch(config or {}), _quiet():
        fn = backend(fresh(graph), [copy_value(a) for a in inputs])
        out = fn(*[copy_value(a) for a in inputs])  # as Dynamo calls it: the graph's inputs, positional
    return not all_finite(floats(flat(out)))


def settle(captured: Captured) -> dict[str, Any]:
    """Eager finite: the same graph recompiled alone, with emulate_precision_casts, then bisected.
    Returns what each run gave (evidence for the finding)."""
    graph, inputs = captured.graph, captured.inputs
    out: dict[str, Any] = {}
    try:
        again = run_compiled(graph, inputs, graph.backend)
    except Exception as exc:
        out["recompiled"] = f"could not be recompiled apart from the step: {type(exc).__name__}: {exc}"[:300]
        return out
    out["recompiled"] = "non-finite" if again else "finite"
    if not again:  # the fault needs the step around it (state, another graph): nothing to bisect
        return out
    if graph.backend_name != "inductor":
        out["emulate_precision_casts"] = f"not run: the backend is {graph.backend_name}, not Inductor"
    else:
        try:
            emulated = run_compiled(graph, inputs, graph.backend, {"emulate_precision_casts": True})
            out["emulate_precision_casts"] = "non-finite" if emulated else "finite"
            if not emulated:
                out["settled_by"] = "emulate_precision_casts"
                out["sides"] = {
                    "bad": {"torch._inductor.config.emulate_precision_casts": False},
                    "good": {"torch._inductor.config.emulate_precision_casts": True},
                }
                return out
        except Exception as exc:
            out["emulate_precision_casts"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    try:
        out["bisect"] = bisect(graph, inputs)
    except Exception as exc:
        out["bisect"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def bisect(graph: CompiledGraph, inputs: list[Any]) -> dict[str, Any]:
    """PyTorch's CompilerBisector on the graph: the backend, subsystem and pass application that
    first makes the outputs non-finite, and the environment variables that give each side."""
    CompilerBisector = compiler_bisector()

    def good() -> bool:
        name = CompilerBisector.get_backend() or "inductor"
        config = (CompilerBisector.get_config_change("inductor") or {}) if name == "inductor" else {}
        try:
            return not run_compiled(graph, inputs, lookup_backend(name), config)
        except Exception:
            return False  # a backend that fails on the graph is not a good side

    runs: list[int] = [0]

    def counted() -> bool:
        runs[0] += 1
        return good()

    with _quiet():
        result = CompilerBisector.do_bisect(counted)
    if result is None:
        return {"found": False, "runs": runs[0], "why": "every backend and subsystem gave the same non-finite output"}
    found: dict[str, Any] = {
        "found": True,
        "backend": result.backend,
        "subsystem": result.subsystem,
        "bisect_number": result.bisect_number,
        "debug_info": result.debug_info,
        "runs": runs[0],
    }
    found["sides"] = sides(result)
    return found


def sides(result: Any) -> dict[str, dict[str, str]]:
    """The environment variables that reproduce each side of the bisection (torch reads them
    when torch._inductor.compiler_bisector is imported)."""
    backends = ["eager", "aot_eager", "aot_eager_decomp_partition", "aot_eager_decomp_partition_crossref", "inductor"]
    if result.subsystem is None:
        at = backends.index(result.backend) if result.backend in backends else 0
        good = {"TORCH_BISECT_BACKEND": backends[at - 1]} if at > 0 else {}
        return {"bad": {"TORCH_BISECT_BACKEND": result.backend}, "good": good}
    base = {"TORCH_BISECT_BACKEND": result.backend, "TORCH_BISECT_SUBSYSTEM": result.subsystem}
    change = bisect_setting(result.backend, result.subsystem)
    if change is not None:  # a setting, not a counted subsystem: the config names it
        field = f"torch._{change.config_name}.config.{change.config_field}"
        return {"bad": {}, "good": {field: repr(change.config_value)}}
    number = int(result.bisect_number or 0)
    # TORCH_BISECT_MAX=N keeps applications 0..N of the subsystem and disables the rest
    return {
        "bad": {**base, "TORCH_BISECT_MAX": str(number)},
        "good": {**base, "TORCH_BISECT_MAX": str(number - 1)},
    }


@contextlib.contextmanager
def _quiet() -> Any:
    """torch's prints (the bisector reports each step on stdout) kept off the user's console."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def describe(evidence: dict[str, Any]) -> str:
    """One sentence for the finding's message."""
    parts = []
    if evidence.get("settled_by") == "emulate_precision_casts":
        parts.append(
            "recompiled with torch._inductor.config.emulate_precision_casts=True it was finite: Inductor's "
            "intermediates kept in another precision than eager's make it"
        )
    elif evidence.get("emulate_precision_casts") == "non-finite":
        parts.append("emulate_precision_casts did not change it")
    found = evidence.get("bisect") or {}
    if found.get("found"):
        where = found["backend"] + (f" / {found['subsystem']}" if found.get("subsystem") else "")
        if found.get("debug_info") and found.get("debug_info") != found.get("subsystem"):
            where += f" / {found['debug_info']}"
        if found.get("bisect_number") and found.get("subsystem"):
            where += f" (application {found['bisect_number']})"
        bad = " ".join(f"{k}={v}" for k, v in found["sides"]["bad"].items())
        good = " ".join(f"{k}={v}" for k, v in found["sides"]["good"].items())
        parts.append(
            f"CompilerBisector: {where}; bad with {bad or 'the defaults'}, finite with {good or 'the defaults'}"
        )
    elif found:
        parts.append(f"CompilerBisector found no backend or pass ({found.get('why') or found.get('error')})")
    if evidence.get("recompiled") == "finite":
        parts.append("the graph recompiled alone was finite (the fault needs the step around it)")
    return "; ".join(parts)
