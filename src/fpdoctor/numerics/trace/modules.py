"""Which module is running: dotted paths as in `named_modules()`, call counts, phase.

Forward uses the global module hooks, so no model needs to be registered and every module is
seen; backward attribution comes from the autograd node that is executing, whose sequence number
the trace maps to the forward op that created it, so a backward op is blamed on that op's module.
Phase: backward while autograd runs a graph task, optimizer between the global optimizer step
hooks, forward otherwise. A module forward that runs during backward is an activation-checkpoint
recompute, not forward.

The hooks are global (every thread calls them) but a dispatch mode is per thread, so the module
stack and the optimizer phase are kept per thread: a model running in another thread never
lends its module to the traced thread's ops.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.observe.dynamo import compiling
from fpdoctor.provenance import Provenance
from fpdoctor.torchprivate import compiled_inner, graph_task_id

ModuleOutputHook = Callable[[str, int, Any, bool], None]


def in_backward() -> bool:
    return graph_task_id() != -1


class ThisThread(threading.local):
    """One thread's module stack and optimizer depth: each thread that reads it gets its own,
    made on first use (a `threading.local` subclass runs `__init__` once per thread)."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, int, bool]] = []  # (path, call index, recompute)
        self.in_optimizer = 0  # optimizer steps running (a step may call another)


class ModuleTracker:
    """Tracks the module stack in forward and the optimizer phase; installs global hooks on enter."""

    def __init__(self, roots: list[nn.Module] | None = None, on_output: ModuleOutputHook | None = None) -> None:
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self.param_names = Provenance()  # parameter/buffer -> dotted name (looked up on every in-place op)
        self.saw_compiled = False
        # told of parameters named late (a model first called after its weights were loaded)
        self.on_names: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None
        for root in roots or []:
            self._name_tree(root, "")
        self._have_root = bool(roots)
        # This thread's `.stack` and `.in_optimizer`. The trace reads them for every op it
        # records, directly: through the properties below each read would cost a call.
        self.this_thread = ThisThread()
        self.calls: Counter[str] = Counter()
        self.optimizer_steps = 0
        # the optimizers that stepped, by id: their state (Adam's moments) outlives the step, a sink as a
        # weight is. Held until the trace reads their state at its end (a script's may be gone by then).
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.on_output = on_output
        # told of each module call, with its positional arguments (which batch the step reads)
        self.on_call: Callable[[nn.Module, Any], None] | None = None
        self._handles: list[Any] = []

    def _name_tree(self, root: nn.Module, prefix: str) -> None:
        if compiled_inner(root) is not None:  # torch.compile's OptimizedModule: name the model inside it
            self.saw_compiled = True
            self._names.setdefault(root, prefix)
            root = compiled_inner(root)
        for name, module in root.named_modules(prefix=prefix, remove_duplicate=False):
            self._names.setdefault(module, name)
        named = []
        for name, tensor in [*root.named_parameters(prefix=prefix), *root.named_buffers(prefix=prefix)]:
            if tensor not in self.param_names:
                self.param_names.set(tensor, name)
                named.append((name, tensor))
        if self.on_names is not None and named:
            self.on_names(named)

    @property
    def stack(self) -> list[tuple[str, int, bool]]:
        """This thread's module stack: (path, call index, recompute)."""
        return self.this_thread.stack

    @property
    def in_optimizer(self) -> int:
        return self.this_thread.in_optimizer

    def name_of(self, module: nn.Module) -> str:
        name = self._names.get(module)
        if name is not None:
            return name
        stack = self.stack
        if stack:
            # A module built or called ad hoc inside another module's forward.
            name = f"{stack[-1][0]}.<{type(module).__name__}>".lstrip(".")
            self._names[module] = name
        else:
            # A new top-level module: the first one is the root (""), later ones go by class name.
            prefix = "" if not self._have_root else type(module).__name__
            self._have_root = True
            self._name_tree(module, prefix)
            name = self._names[module]
        return name

    def _pre(self, module: nn.Module, args: Any) -> None:
        if compiling():  # Dynamo inlines the hook as nothing: no graph break of ours, nothing traced
            return
        name = self.name_of(module)
        index = self.calls[name]
        self.calls[name] += 1
        self.stack.append((name, index, in_backward()))
        if self.on_call is not None:
            try:  # noqa: SIM105  (at every module call: a try costs nothing, suppress() a context manager)
                self.on_call(module, args)
            except Exception:  # the observer never raises into the user's forward; the rows go unnamed
                pass

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if compiling():
            return
        name = self.name_of(module)
        stack = self.stack
        while stack:  # pop to the matching entry even if an inner forward raised
            top = stack.pop()
            if top[0] == name:
                if self.on_output is not None:
                    self.on_output(name, top[1], output, top[2])
                return

    def _opt_pre(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.this_thread.in_optimizer += 1
        self.optimizer_steps += 1
        self.optimizers[id(optimizer)] = optimizer
        # a closure (LBFGS's; Lightning runs training_step in one) is the step's forward and backward, run
        # inside step(): its ops are the forward's and the backward's, not the optimizer's update
        given = "closure" in kwargs
        closure = kwargs["closure"] if given else args[1] if len(args) > 1 else None
        if not callable(closure):
            return None
        wrapped = self._outside_optimizer(closure)
        return (args, {**kwargs, "closure": wrapped}) if given else ((args[0], wrapped, *args[2:]), kwargs)

    def _outside_optimizer(self, closure: Callable[..., Any]) -> Callable[..., Any]:
        """`closure` run with this thread out of the optimizer's phase, which resumes after it."""
        state = self.this_thread

        def run(*args: Any, **kwargs: Any) -> Any:
            depth, state.in_optimizer = state.in_optimizer, 0
            try:
                return closure(*args, **kwargs)
            finally:
                state.in_optimizer = depth

        return run

    def _opt_post(self, *args: Any) -> None:
        state = self.this_thread
        state.in_optimizer = max(0, state.in_optimizer - 1)

    @property
    def current(self) -> tuple[str | None, int | None, bool]:
        stack = self.stack
        if not stack:
            return None, None, False
        return stack[-1]

    @property
    def phase(self) -> str:
        if in_backward():
            return "backward"
        if self.in_optimizer:
            return "optimizer"
        return "forward"

    def __enter__(self) -> ModuleTracker:
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        self._handles = [
            module_mod.register_module_forward_pre_hook(self._pre),
            module_mod.register_module_forward_hook(self._post, always_call=True),
            optimizer_mod.register_optimizer_step_pre_hook(self._opt_pre),
            optimizer_mod.register_optimizer_step_post_hook(self._opt_post),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
