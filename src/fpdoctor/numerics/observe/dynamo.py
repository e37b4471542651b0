"""Keeping fpdoctor's own code out of what torch.compile traces and compiles.

Every observer fpdoctor installs (the trace's dispatch mode and module hooks, the sentinel's and
`watch`'s global module and optimizer hooks, the swapped `torch.autograd.backward`, the breadcrumb
recorder) can be called from code that Dynamo is tracing or running. Two rules keep the user's
compiled program the one it would be without fpdoctor (no graph break, no recompile, no warning
of ours):

- while Dynamo *traces*, a hook returns at once (`compiling()`), so Dynamo inlines it as nothing;
- when Dynamo *runs* the code around a graph break, it must not compile fpdoctor's functions as
  frames of their own: their code objects are marked to be skipped (`keep_out`).

torch._dynamo costs seconds and ~77 MiB to import, so nothing here imports it: `keep_out` marks
the code now if the program has imported it, or as soon as it does.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

from fpdoctor.imports import after_import

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
_waiting: list[Any] = []  # objects to skip once torch._dynamo is imported
_then: list[Callable[[], None]] = []  # what else runs once it is imported
_done: set[int] = set()  # ids of the objects kept out (or waiting to be) already


_IS_COMPILING: list[Callable[[], bool]] = []  # torch.compiler.is_compiling, once torch is imported here


def compiling() -> bool:
    """True while Dynamo traces (or torch.export exports) the calling code: a hook that returns at
    once then adds nothing to the graph. Cheap: a flag read (torch's function looked up once, as
    hooks call this several times a step); imports nothing."""
    if not _IS_COMPILING:
        import torch

        _IS_COMPILING.append(torch.compiler.is_compiling)
    return bool(_IS_COMPILING[0]())


def keep_out(objects: Iterable[Any]) -> None:
    """`never_compile(objects)` now if torch._dynamo is imported, else when the program imports it
    (torch.compile imports it when it is first called). Never raises."""
    try:
        objects = [o for o in objects if id(o) not in _done]
        _done.update(id(o) for o in objects)  # modules and classes live as long as the process
        if not objects:
            return
        if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "eval_frame"):
            never_compile(objects)
            return
        with _lock:
            _waiting.extend(objects)
            if not any(getattr(f, "then", None) is _skip_waiting for f in sys.meta_path):
                after_import(_DYNAMO, _skip_waiting)
    except Exception:  # the observer never kills the job
        pass


def _skip_waiting() -> None:
    with _lock:
        objects, _waiting[:] = list(_waiting), []
        then, _then[:] = list(_then), []
    never_compile(objects)
    for call in then:
        with contextlib.suppress(Exception):  # the observer never kills the job
            call()


def when_imported(call: Callable[[], None]) -> None:
    """`call()` now if torch._dynamo is imported, else as soon as the program imports it."""
    if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "eval_frame"):
        call()
        return
    with _lock:
        if call not in _then:  # asked again by each watch while the program has not imported it yet
            _then.append(call)
        if not any(getattr(f, "then", None) is _skip_waiting for f in sys.meta_path):
            after_import(_DYNAMO, _skip_waiting)


def never_compile(objects: Iterable[Any]) -> None:
    """Dynamo runs every function and method of `objects` (functions, classes and modules), and
    whatever they call, as plain Python: when it runs the code around a graph break it would
    otherwise compile fpdoctor's hooks and dispatch-mode functions as frames of their own."""
    from fpdoctor.torchprivate import dynamo_skipper

    skip = dynamo_skipper()

    todo = []
    for obj in objects:
        if isinstance(obj, types.ModuleType):  # its own functions and classes, not what it imported
            members = [v for v in vars(obj).values() if getattr(v, "__module__", None) == obj.__name__]
            todo += [getattr(m, "__code__", None) for m in members]
            members = [m for m in members if isinstance(m, type)]
            todo += [getattr(f, "__code__", None) for cls in members for f in _functions_of(cls)]
            continue
        members = _functions_of(obj) if isinstance(obj, type) else [obj]
        todo += [getattr(m, "__code__", None) for m in members]
    seen: set[types.CodeType] = set()
    while todo:
        code = todo.pop()
        if not isinstance(code, types.CodeType) or code in seen:
            continue
        seen.add(code)
        skip(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]  # closures, comprehensions


def _functions_of(cls: type) -> list[Any]:
    """A class's functions, those under staticmethod, classmethod and property included."""
    out: list[Any] = []
    for member in vars(cls).values():
        value = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        if isinstance(value, property):
            out += [value.fget, value.fset, value.fdel]
            continue
        out.append(value)
    return out


def quiet_wrapper_warning() -> Callable[[], None]:
    """torch.compile(module) warns, at each call, that global module hooks fire once more for its
    wrapper; fpdoctor's hooks handle that (they name the wrapped model), and a warning the
    program would not print without fpdoctor is not the program's. Returns what takes the filter
    away again (and no filter the program added meanwhile)."""
    import warnings

    warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
    added = warnings.filters[0]

    def remove() -> None:
        filters: list[Any] = warnings.filters  # type: ignore[assignment]  # a list at run time
        with contextlib.suppress(ValueError, AttributeError):
            filters.remove(added)
            warnings._filters_mutated()  # type: ignore[attr-defined]  # the module's cache of decisions

    return remove


# fpdoctor's modules as last listed, with the count of sys.modules then: a trace entered every step
# (`with fpdoctor.trace(model):` around each) would walk thousands of modules each time
_listed: tuple[tuple[int, str | None], list[types.ModuleType]] = ((-1, None), [])


def fpdoctor_modules() -> list[types.ModuleType]:
    """fpdoctor's modules imported so far: what its hooks call (a module imported later runs from
    frames of these, and a skipped frame's callees are skipped too). Listed again only where the
    process imported a module since."""
    global _listed  # noqa: PLW0603  # the process's one list, as sys.modules is
    try:  # one removed and another added: a new last key
        count = (len(sys.modules), next(reversed(sys.modules), None))
    except RuntimeError:  # another thread importing as the key is read: listed again
        count = (-1, None)
    if count != _listed[0]:
        found = [m for name, m in list(sys.modules.items()) if name.partition(".")[0] == "fpdoctor" and m is not None]
        _listed = (count, found)
    return _listed[1]


def is_compiled(model: Any) -> bool:
    """The model, or a module in it, runs through torch.compile (`torch.compile(model)`'s wrapper
    or `module.compile()`)."""
    try:
        from fpdoctor.torchprivate import is_compiled_module

        modules = model.modules() if hasattr(model, "modules") else []
        return any(is_compiled_module(m) for m in modules)
    except Exception:
        return False
