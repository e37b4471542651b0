"""Every top-level module call of the process, seen at the cost of the top-level calls alone.

torch calls a module's forward straight away (its fast path) when neither the module nor the
process has forward hooks. A global hook sends every call of every module, each submodule inside
a model included, through the slow path that runs hooks: about 2.5 us a call on a CPU before the
hook does anything, and the hook's own call beside it; 5 ms a step for an MLP of 1,000 modules
(torch 2.13, one thread). `fpdoctor watch` needs only the top-level calls (a training forward, a
loss module). So at a top-level call its global pre-hook takes the watch's two global hooks out of
torch's tables for as long as that call runs, and puts one hook on that module alone, first in its
order (where the global one ran), to see it end: the calls inside it take the fast path.

A module that takes no hook of its own, a program that runs code torch.compile made (Dynamo guards
on the global hooks: see `_take_out`), or a torch that keeps its tables elsewhere, leaves the
global hooks in for that call: its end is then seen by the global post-hook, which counts the nested calls (each thread
apart) as before. Other global hooks (a trace's, the breadcrumbs') stay where they are. The
hooks go back when the last top-level call in progress on any thread ends, and everything of the
watch's comes off the modules and torch's tables at `close`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn
from torch.nn.modules import module as module_hooks
from torch.utils.hooks import RemovableHandle

from fpdoctor.numerics.observe import dynamo
from fpdoctor.torchprivate import dynamo_frames_seen, global_forward_hook_tables, global_forward_hooks_with_kwargs

Pre = Callable[[nn.Module, tuple[Any, ...]], None]
Post = Callable[..., None]  # (module, args, kwargs, output); output None or missing when the forward raised


class _PerThread(threading.local):
    """Per thread: `depth` (global-hook calls in progress), `top` (module, handle, frames). Class
    defaults, so that reading a thread's unset value costs no AttributeError (getattr's default)."""

    depth = 0
    top: tuple[nn.Module, RemovableHandle, int] | None = None


class TopLevelCalls:
    """`pre(module, args)` before and `post(module, args, kwargs[, output])` after each top-level
    module call of any thread (`output` None or missing when the forward raised), from `start()` to
    `close()`."""

    def __init__(self, pre: Pre, post: Post) -> None:
        self._pre, self._post = pre, post
        self._local = _PerThread()
        self._lock = threading.Lock()
        self._inside = 0  # top-level calls in progress with the global hooks taken out, on all threads
        self._taken: list[tuple[dict[int, Any], int, Any]] = []  # (table, id, hook) while taken out
        self._tables: tuple[dict[int, Any], dict[int, Any]] | None = None
        self._handles: list[RemovableHandle] = []  # the two global hooks
        self._ids: tuple[int, int] = (-1, -1)  # their ids: their keys in torch's tables
        self._open: dict[int, RemovableHandle] = {}  # per-module hooks on calls in progress, by handle id
        self._stale: list[RemovableHandle] = []  # per-module hooks whose forward raised: removed later
        self._closed = False
        self._compiled_inside: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # see `_take_out`

    def start(self) -> None:
        self._closed = False
        self._handles = [
            module_hooks.register_module_forward_pre_hook(self._on_pre),
            # with its keyword arguments (a pre-hook gets none), and even when the forward raises
            module_hooks.register_module_forward_hook(self._on_post, with_kwargs=True, always_call=True),
        ]
        self._tables = global_forward_hook_tables(module_hooks)
        self._ids = (self._handles[0].id, self._handles[1].id)

    def close(self) -> None:
        """Everything off: the global hooks, and the per-module ones of calls still in progress."""
        with self._lock:
            self._closed = True
            self._taken = []
            handles, self._open = [*self._open.values(), *self._stale], {}
            self._stale = []
        for handle in [*handles, *self._handles]:
            handle.remove()
        if self._handles:
            # torch's handle leaves its with_kwargs mark behind: every torch.compile(module) call
            # after the watch would then warn of global hooks that are gone
            global_forward_hooks_with_kwargs(module_hooks).pop(self._handles[1].id, None)

    # -- torch's calls -------------------------------------------------------------------------
    def _on_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if dynamo.compiling():  # Dynamo inlines the hook as nothing; the compiled code never calls it
            return
        depth = self._local.depth
        if depth:  # inside a top-level call that kept the global hooks in
            self._local.depth = depth + 1
            return
        if not self._take_out(module):
            self._local.depth = 1  # its end is the global post-hook's
        self._pre(module, args)

    def _on_post(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any = None, *output: Any) -> None:
        """The global post-hook: the end of a call made while the global hooks were in."""
        if dynamo.compiling():
            return
        depth = self._local.depth
        if not depth:  # a call that began before the watch did, or a race with another thread's take-out
            return
        self._local.depth = depth - 1
        if depth == 1:
            self._post(module, args, kwargs, *output)

    def _on_end(self, module: nn.Module, args: tuple[Any, ...], kwargs: Any = None, *output: Any) -> None:
        """The per-module hook: the end of a top-level call made with the global hooks out."""
        top = self._local.top
        if top is None or top[0] is not module:  # another thread's hook on the same module
            return
        self._local.top = None
        if top[2] == 0 and dynamo_frames_seen() != 0:
            self._compiled_inside.add(module)
        try:
            self._post(module, args, kwargs, *output)
        finally:
            # torch calls a raising forward's hooks (output None) while it iterates the module's
            # table: the hook comes off at the next top-level call instead (or at close)
            self._end(top[1], remove=bool(output) and output[0] is not None)

    # -- the global hooks out and back ---------------------------------------------------------
    def _take_out(self, module: nn.Module) -> bool:
        # Dynamo guards on the global hooks: once the program runs compiled code, they stay in, but
        # for a module whose call was where compiling began (torch.compile(model) called at the top),
        # whose code was compiled with them out
        frames = dynamo_frames_seen()
        if self._tables is None or self._closed or (frames != 0 and module not in self._compiled_inside):
            return False
        try:
            handle = module.register_forward_hook(self._on_end, with_kwargs=True, always_call=True, prepend=True)
        except Exception:  # a module that takes no hook of its own (a ScriptModule)
            return False
        with self._lock:
            stale, self._stale = self._stale, []
            if self._inside == 0:
                for table, key in zip(self._tables, self._ids, strict=True):
                    if key in table:
                        self._taken.append((table, key, table.pop(key)))
            self._inside += 1
            self._open[handle.id] = handle
        for old in stale:
            old.remove()
        self._local.top = (module, handle, frames)
        return True

    def _end(self, handle: RemovableHandle, *, remove: bool) -> None:
        with self._lock:
            self._open.pop(handle.id, None)
            if remove:
                handle.remove()
            else:
                self._stale.append(handle)
            self._inside = max(self._inside - 1, 0)
            if self._inside == 0 and not self._closed:
                for table, key, hook in self._taken:
                    table[key] = hook
                self._taken = []
