"""Keeping the op recorder out of what torch.compile compiles (used by crash/breadcrumbs.py).

`fpdoctor run --breadcrumbs` re-runs a crash to name its op; a recorder that changed the graphs
Dynamo builds (graph breaks in its hooks, frames of its own compiled, recompiles) would change
the very kernels that crashed. Only imported once the program has imported torch._dynamo.
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any


def never_compile(objects: Iterable[Any]) -> None:
    """Dynamo runs every function and method of `objects` (functions and classes), and whatever
    they call, as plain Python: when it runs the code around a graph break it would otherwise
    compile the recorder's hooks and dispatch-mode functions as frames of their own."""
    try:  # this frame and every frame it calls (the standard library's helpers included)
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        def skip(code: types.CodeType) -> None:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

    except ImportError:  # an older torch: this frame only
        from torch._dynamo.eval_frame import skip_code as skip

    todo = []
    for obj in objects:
        members = list(vars(obj).values()) if isinstance(obj, type) else [obj]
        todo += [getattr(m, "__code__", None) for m in members]
    seen: set[types.CodeType] = set()
    while todo:
        code = todo.pop()
        if not isinstance(code, types.CodeType) or code in seen:
            continue
        seen.add(code)
        skip(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]  # closures, comprehensions


def quiet_wrapper_warning() -> None:
    """torch.compile(module) warns, at each call, that global module hooks fire once more for its
    wrapper; the recorder's hooks handle that (they name the wrapped model), and a warning the
    program would not print without fpdoctor is not the program's."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
