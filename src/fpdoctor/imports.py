"""Run a function when the program imports a module, without importing it first.

fpdoctor waits for imports that are the program's to make: `fpdoctor run --breadcrumbs` starts
its recorder once torch is imported, and fpdoctor's code is kept out of Dynamo once torch._dynamo
is (torch.compile imports it; importing it ourselves would cost seconds). Torch-free.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """A meta-path finder that lets `name` import as usual, then calls `then` (once; what it raises
    is swallowed: the observer never kills the job).

    Only the module's loader is wrapped, and the real one is put back before the module's code runs,
    so its __loader__ and __spec__ are what they would be; a look-up that does not import
    (importlib.util.find_spec) leaves the finder waiting for the real import.
    """

    def __init__(self, name: str, then: Callable[[], None]) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return None
            spec.loader = _ThenLoader(spec.loader, self)  # type: ignore[assignment]  # a Loader by its methods
            return spec
        except Exception:
            return None

    def imported(self) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        with contextlib.suppress(Exception):  # the observer never kills the job
            self.then()


def after_import(name: str, then: Callable[[], None]) -> AfterImport:
    """Call `then` once the program has imported `name` (not now, even if it is imported already:
    the caller decides that). Returns the finder, first on sys.meta_path until the import."""
    finder = AfterImport(name, then)
    sys.meta_path.insert(0, finder)
    return finder


class _ThenLoader:
    def __init__(self, loader: Any, finder: AfterImport) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> Any:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: Any) -> None:
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            spec.loader = self._loader
        module.__loader__ = self._loader
        self._loader.exec_module(module)
        self._finder.imported()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)
