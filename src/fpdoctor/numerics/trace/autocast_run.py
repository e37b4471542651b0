"""`trace --dtype fp16|bf16`: run a script the user will not edit as a real autocast run would.

A real loop opens one `torch.autocast` region per forward (`with autocast(): loss = f(model(x))`),
calls `backward()` and `optimizer.step()` outside it, and so gets fresh casts of the weights on
every step. One region around the whole script differs in three ways, each measured on small
training loops:
  cache      autocast keeps its cast copy of each weight until the region exits: every later
             forward would use the step-0 weights, and the what-if trains nothing.
  backward   autograd runs backward with the autocast state of the `backward()` call: a region
             the user kept in fp32 (`autocast(enabled=False)`) would get a low-precision backward.
  optimizer  the step's own ops would be cast as well.
`AutocastWhatIf` keeps the cache (a weight used twice in one forward shares one cast copy, so its
gradients are summed in the low precision, as in a real run) but empties it where a real region
would have ended: at `backward()` / `autograd.grad()`, at every optimizer step, and at a top-level
module call whose parameters were written since the last one (a checkpoint loaded between two
evaluations). Backward and the optimizer step run with autocast off.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch


class AutocastWhatIf:
    """Context manager: autocast to `dtype` on `device` for everything it runs, as described above."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._region: Any = None
        self._off: list[Any] = []  # autocast(enabled=False) regions open around optimizer steps
        self._depth = 0  # module calls open in the entering thread
        self._versions: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        self._thread = threading.get_ident()
        self._handles: list[Any] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> AutocastWhatIf:
        from torch.nn.modules import module as module_mod
        from torch.optim import optimizer as optimizer_mod

        self._thread = threading.get_ident()
        self._region = torch.autocast(self.device, dtype=self.dtype)
        self._region.__enter__()
        for name in ("backward", "grad"):  # Tensor.backward calls torch.autograd.backward
            self._saved[name] = original = getattr(torch.autograd, name)
            setattr(torch.autograd, name, self._outside(original))
        self._handles = [
            optimizer_mod.register_optimizer_step_pre_hook(self._step_pre),
            optimizer_mod.register_optimizer_step_post_hook(self._step_post),
            module_mod.register_module_forward_pre_hook(self._forward_pre),
            module_mod.register_module_forward_hook(self._forward_post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for name, original in self._saved.items():
            setattr(torch.autograd, name, original)
        self._saved = {}
        while self._off:  # an optimizer step that raised never reached its post hook
            self._off.pop().__exit__(None, None, None)
        region, self._region = self._region, None
        if region is not None:
            region.__exit__(*exc)

    def _outside(self, original: Any) -> Any:
        @functools.wraps(original)
        def run_outside_autocast(*args: Any, **kwargs: Any) -> Any:
            # a real loop calls backward after its forward's region ended: no cast copies kept
            torch.clear_autocast_cache()
            with torch.autocast(self.device, enabled=False):
                return original(*args, **kwargs)

        return run_outside_autocast

    def _step_pre(self, *args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        torch.clear_autocast_cache()  # the step writes the weights: their cast copies are stale
        off = torch.autocast(self.device, enabled=False)
        off.__enter__()
        self._off.append(off)

    def _step_post(self, *args: Any) -> None:
        if threading.get_ident() == self._thread and self._off:
            self._off.pop().__exit__(None, None, None)

    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self._depth += 1
        if self._depth > 1:
            return
        # a new top-level forward: a real loop would be in a new region if weights changed since
        # the last (written in place outside an optimizer: load_state_dict, a manual update)
        version = sum(p._version for p in module.parameters())
        if self._versions.get(module, version) != version:
            torch.clear_autocast_cache()
        self._versions[module] = version

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == self._thread:
            self._depth = max(0, self._depth - 1)
