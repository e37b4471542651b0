"""MODEL arguments: `path/to/file.py:factory` or `package.module:factory` -> (model, inputs).

The factory returns `(model, example_inputs)`; inputs are one tensor, a tuple of positional
arguments, or a dict of keyword arguments. Every way this can fail is a one-line usage error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from fpdoctor.cli.errors import UsageError

USAGE = "MODEL must be path/to/file.py:factory or package.module:factory, the factory returning (model, inputs)"


def load(spec: str) -> tuple[Any, Any]:
    target, sep, factory_name = spec.rpartition(":")
    if not sep or not target or not factory_name.isidentifier():
        raise UsageError(f"{spec!r}: {USAGE}")
    if target.endswith(".py") or os.sep in target:
        if not os.path.isfile(target):
            raise UsageError(f"{target}: no such file ({USAGE})")
        name = f"fpdoctor_model_{abs(hash(os.path.abspath(target)))}"
        module_spec = importlib.util.spec_from_file_location(name, target)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"{target}: cannot be imported as Python ({USAGE})")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        try:
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise UsageError(f"importing {target} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            sys.path.pop(0)
    else:
        try:
            module = importlib.import_module(target)
        except Exception as exc:
            raise UsageError(f"importing {target} failed: {type(exc).__name__}: {exc}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise UsageError(f"{target} has no factory {factory_name!r}; {USAGE}")
    try:
        made = factory()
    except Exception as exc:
        raise UsageError(f"the factory {spec} raised {type(exc).__name__}: {exc}") from exc
    import torch

    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        raise UsageError(f"the factory {spec} returned {type(made).__name__}; it must return (model, example_inputs)")
    return made


def to_device(model: Any, inputs: Any, device: str) -> tuple[Any, Any]:
    from fpdoctor.precision.candidates import cast_inputs, check_device

    try:
        target = check_device(device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return model.to(target), cast_inputs(inputs, None, target)
