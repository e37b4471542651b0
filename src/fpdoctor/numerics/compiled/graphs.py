"""Each graph torch.compile makes, checked where it runs: which one first returned NaN/Inf.

TorchDynamo cuts a compiled function into graphs and hands each to the backend (Inductor, or
the user's own); the backend's compiled callable is what runs at each call. While a `GraphCheck`
is open, every graph Dynamo compiles gets its callable wrapped once, at compile time (Dynamo
calls the wrapper in place of the callable: no guard, no recompile, nothing traced), and fpdoctor
keeps a copy of the graph as Dynamo captured it (torch-level ops, before the backend's passes).
Per call the wrapper adds one finite check of the graph's floating outputs, left on the device
(each output's smallest and largest value: it writes nothing, so autograd's saved outputs are
left as they were); `first_bad` reads the window's flags once, on a bad step only. `capturing()` reads
them at each call instead, and keeps a copy of the inputs of the first graph whose finite inputs
gave non-finite outputs: what the eager re-run, the recompiles and the reproducer of
numerics/compiled/rerun.py start from.

The backward graphs AOTAutograd makes run inside autograd, not through this wrapper: their
NaN/Inf shows in the gradients the step check reads. Graphs compiled before a check (or
`watching()`, which `watch` opens at its start) was opened are not wrapped: their callables are
Dynamo's already.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import itertools
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from fpdoctor.numerics.observe import dynamo
from fpdoctor.torchprivate import current_compile_id, dynamo_output_graph
from fpdoctor.userframes import is_user_file

# Re-entrant: closing a check collects the stale ones (gc.collect() under the lock), and a stale owner's
# finalizer closes its own check on the same thread, inside that collection.
_lock = threading.RLock()
_open: weakref.WeakSet[GraphCheck] = weakref.WeakSet()  # the checks that want each graph's calls
_patched: list[Any] = []  # (OutputGraph, its own call_user_compiler) while any check is open
_on_import: list[bool] = []  # a check asked to wrap graphs from when torch._dynamo is imported
_holders = [0]  # `watching()` blocks open: graphs compiled meanwhile are wrapped for checks opened later
# while only `watching()` is open: the calls' flags, handed to the next check opened (its first window)
_pending: collections.deque[tuple[CompiledGraph, torch.Tensor]] = collections.deque(maxlen=4096)
_numbers = itertools.count()
_runners: list[Callable[[CompiledGraph, Callable[[], Any]], Any]] = []  # `run_through`: what graph calls run in
_MAX_CALLS = 65536  # graph calls one check keeps per window
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


@dataclass
class CompiledGraph:
    """One Dynamo graph, as captured and as compiled."""

    number: int  # the order fpdoctor saw it compiled in, from 0
    compile_id: str  # Dynamo's own id ("frame/attempt", as TORCH_LOGS prints it)
    gm: torch.fx.GraphModule  # a copy of the captured graph: the backend's passes never reach it
    backend: Any  # the backend as Dynamo called it
    backend_name: str
    placeholders: list[str] = field(default_factory=list)

    def covers(self) -> dict[str, Any]:
        """What of the user's code the graph holds: its user lines, modules and ops."""
        lines: list[str] = []
        modules: list[str] = []
        ops: list[str] = []
        for node in self.gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            ops.append(op_name(node))
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                path = list(stack.values())[-1][0]
                name = _module_path(str(path))
                if name and name not in modules:
                    modules.append(name)
            line = user_line(node)
            if line and line not in lines:
                lines.append(line)
        return {
            "id": self.compile_id,
            "number": self.number,
            "backend": self.backend_name,
            "lines": lines[:20],
            "modules": modules[:20],
            "ops": list(dict.fromkeys(ops))[:40],
        }


def op_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    module = {"_operator": "operator", "torch._C._nn": "torch.nn.functional"}.get(module, module)
    name = getattr(target, "__name__", None) or str(target)
    return f"{module}.{name}".lstrip(".")


def user_line(node: torch.fx.Node) -> str | None:
    """The innermost user frame of the node's recorded stack: "file:line in function"."""
    for path, line, func in reversed(_FRAME.findall(node.meta.get("stack_trace") or "")):
        if is_user_file(path):
            return f"{path}:{line} in {func}"
    return None


def _module_path(path: str) -> str:
    """Dynamo's module path (L['self'].layers[0].attn) as the model names it (layers.0.attn)."""
    path = re.sub(r"^L\['(self|fn|mod)'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".") or "<root>"


@dataclass
class Captured:
    """The first graph call whose finite inputs gave non-finite outputs, with copies of its inputs."""

    graph: CompiledGraph
    inputs: list[Any]
    bad_outputs: list[int]  # which outputs were non-finite


class GraphCheck:
    """Watches the calls of every graph Dynamo compiles while it is open (see the module's text)."""

    def __init__(self, *, on_import: bool = False) -> None:
        """`on_import`: where the program has not imported torch._dynamo yet (a script `trace`
        runs compiles later), graphs are wrapped from when it does."""
        self.graphs: list[CompiledGraph] = []
        self._calls: list[tuple[CompiledGraph, torch.Tensor]] = []
        self._capture: list[Captured] | None = None  # while capturing: the first bad call, once found
        self._thread = threading.get_ident()
        with _lock:
            # the calls made before this check opened, under `watching()`: its first window's
            self._calls = list(_pending)
            _pending.clear()
            _open.add(self)
            _install()
        if on_import and not _on_import:  # once per process: the callback is the same for every check
            _on_import.append(True)
            dynamo.when_imported(_install_locked)

    def begin(self) -> None:
        """A new window: the calls of the last one are forgotten."""
        self._calls = []

    def first_bad(self) -> dict[str, Any] | None:
        """The first graph call of the window with a non-finite output (one read), and what it covers."""
        if not self._calls:
            return None
        device = self._calls[0][1].device
        flags = torch.stack([flag.to(device) for _, flag in self._calls]).tolist()
        counts: dict[int, int] = {}
        for at, ((graph, _), bad) in enumerate(zip(self._calls, flags, strict=True)):
            counts[graph.number] = counts.get(graph.number, 0) + 1
            if bad:  # the graph's call count, and the place of the call among all graph calls
                return {
                    **graph.covers(),
                    "call": counts[graph.number],
                    "at_call": at + 1,
                    "graph_calls": len(self._calls),
                }
        return None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[list[Captured]]:
        """Within the block every graph call is read at once; the list yielded gets the first call
        whose inputs were finite and whose outputs were not (its inputs copied)."""
        found: list[Captured] = []
        self._capture = found
        try:
            yield found
        finally:
            self._capture = None

    def close(self) -> None:
        with _lock:
            _open.discard(self)
            if _open and not _holders[0]:  # a check whose owner is gone, held only by a reference cycle
                gc.collect()
            if not _open and not _holders[0]:
                _uninstall()

    def _compiled(self, graph: CompiledGraph) -> None:
        self.graphs.append(graph)

    def _wants_inputs(self) -> bool:
        """Capturing, and no bad call found yet: the next call's inputs are copied before it runs."""
        return self._capture is not None and not self._capture and threading.get_ident() == self._thread

    def _called(self, graph: CompiledGraph, before: list[Any] | None, out: Any, flag: Callable[[], Any]) -> None:
        """One call of `graph`; `before` its inputs as they were before it ran (copied while
        capturing only); `flag()` is the call's non-finite flag, computed once for all checks."""
        if threading.get_ident() != self._thread:
            return
        if self._capture is not None:
            outputs = floats(out)
            if before is None or self._capture or not outputs or all_finite(outputs) or not all_finite(floats(before)):
                return  # not the first call whose finite inputs gave non-finite outputs
            bad = [i for i, o in enumerate(flat(out)) if isinstance(o, torch.Tensor) and not all_finite([o])]
            self._capture.append(Captured(graph, before, bad))
            return
        if len(self._calls) < _MAX_CALLS:  # a check nobody reads any more must not grow without end
            value = flag()
            if value is not None:
                self._calls.append((graph, value))


def watching() -> Callable[[], None]:
    """From now on (or from when the program imports torch._dynamo) every graph compiled is
    wrapped, so that a check opened later (a judge made at the first optimizer step, after the
    first forward compiled its graphs) sees their calls. Nothing is recorded until a check opens.
    Returns what ends it."""
    with _lock:
        _holders[0] += 1
    dynamo.when_imported(_install_locked)
    done = [False]

    def release() -> None:
        with _lock:
            if done[0]:
                return
            done[0] = True
            _holders[0] -= 1
            if not _holders[0]:
                _pending.clear()
                if _open:  # a check whose owner is gone, held only by a reference cycle not yet collected
                    gc.collect()
                if not _open:
                    _uninstall()

    return release


def _install_locked() -> None:
    with _lock:
        if _holders[0] or _open:
            _install()


def flat(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def floats(values: Any) -> list[torch.Tensor]:
    return [
        v.detach()
        for v in flat(values)
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) and v.numel()
    ]


def nonfinite_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """float32 0-d flag on the first tensor's device: 1.0 when any value is NaN or Inf. The
    smallest and largest value of each (NaN propagates through both) are finite exactly when all
    values are; nothing is written to the tensors, and no sum can overflow."""
    device = tensors[0].device
    with torch.no_grad():
        ends = [torch.stack(torch.aminmax(torch.view_as_real(t) if t.is_complex() else t)) for t in tensors]
        return torch.cat([e.float().to(device) for e in ends]).isfinite().all().logical_not().float()


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return not tensors or not bool(nonfinite_of(tensors).item())


def copy_value(value: Any) -> Any:
    """A graph input as it was at the call. Parameters are the model's own, left as they are: a
    forward graph does not write them and the bad step is not applied, so no copy of the
    weights is made (a large model's would double their memory)."""
    if isinstance(value, torch.nn.Parameter):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    return value


@contextlib.contextmanager
def run_through(runner: Callable[[CompiledGraph, Callable[[], Any]], Any]) -> Iterator[None]:
    """Within the block each graph call, with its checks, runs as `runner(graph, call)`: the trace steps
    its dispatch mode aside there (numerics/compiled/under_trace.py), so that the compiled program runs
    as compiled and our checks are not traced as the user's ops."""
    _runners.append(runner)
    try:
        yield
    finally:
        _runners.remove(runner)


def _wrap(compiled_fn: Callable[..., Any], graph: CompiledGraph) -> Callable[..., Any]:
    def checked(*args: Any, **kwargs: Any) -> Any:
        if _runners:
            return _runners[-1](graph, lambda: _checked_call(compiled_fn, graph, args, kwargs))
        return _checked_call(compiled_fn, graph, args, kwargs)

    for attr in ("_boxed_call", "zero_grad"):
        if hasattr(compiled_fn, attr):
            with contextlib.suppress(Exception):
                setattr(checked, attr, getattr(compiled_fn, attr))
    return checked


def _checked_call(compiled_fn: Callable[..., Any], graph: CompiledGraph, args: Any, kwargs: Any) -> Any:
    """One call of a compiled graph, with one non-finite flag for whichever checks want it."""
    before = None
    with contextlib.suppress(Exception):  # inputs not copied: no call is captured, the call still runs
        if any(check._wants_inputs() for check in list(_open)):
            # copied before the call: a graph may write into its inputs (BatchNorm's running
            # statistics, an in-place op on an argument); the re-runs start from them as they were
            before = [copy_value(a) for a in args]
    out = compiled_fn(*args, **kwargs)
    if not _open and not _holders[0]:
        return out
    made: list[Any] = []

    def flag() -> Any:  # one reduction per call, whichever checks want it
        if not made:
            outputs = floats(out)
            made.append(nonfinite_of(outputs) if outputs else None)
        return made[0]

    for check in list(_open):
        with contextlib.suppress(Exception):  # the observer never kills the job
            check._called(graph, before, out, flag)
    if _holders[0]:  # for the check a front end opens later (its first window)
        with contextlib.suppress(Exception):
            if flag() is not None:
                _pending.append((graph, flag()))
    return out


def _install() -> None:
    """Wrap what each backend returns from now on (Dynamo's one place that calls the backend)."""
    if _patched:
        return
    if "torch._dynamo" not in sys.modules:  # nothing compiles yet; importing it costs seconds
        return
    try:
        OutputGraph = dynamo_output_graph()
    except Exception:
        return
    own = OutputGraph.call_user_compiler

    def call_user_compiler(self: Any, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        kept = None
        if (_open or _holders[0]) and not getattr(self, "export", False):  # torch.export wants its own graph back
            with contextlib.suppress(Exception):  # a graph we cannot copy is run unchecked
                kept = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        compiled_fn = own(self, gm, example_inputs)
        if kept is None:
            return compiled_fn
        try:
            backend = self.compiler_fn
            graph = CompiledGraph(
                number=next(_numbers),
                compile_id=str(current_compile_id() or "?"),
                gm=kept,
                backend=backend,
                backend_name=backend_name(backend),
                placeholders=[n.name for n in kept.graph.nodes if n.op == "placeholder"],
            )
            for check in list(_open):
                check._compiled(graph)
            return _wrap(compiled_fn, graph)
        except Exception:
            return compiled_fn

    dynamo.never_compile([call_user_compiler])
    OutputGraph.call_user_compiler = call_user_compiler
    _patched.append((OutputGraph, own))


def _uninstall() -> None:
    while _patched:
        cls, own = _patched.pop()
        cls.call_user_compiler = own


def backend_name(backend: Any) -> str:
    """The backend's name as torch.compile takes it ("inductor", "aot_eager", a function's name)."""
    inner = getattr(backend, "_torchdynamo_orig_backend", backend)  # Dynamo's debug wrapper
    name = getattr(inner, "compiler_name", None) or getattr(inner, "__name__", None)
    return str(name or type(inner).__name__)
