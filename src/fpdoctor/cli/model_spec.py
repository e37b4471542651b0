"""MODEL arguments: `path/to/file.py:factory` or `package.module:factory` -> (model, inputs).

The factory takes no arguments and returns `(model, example_inputs)` (FACTORY_HELP says what
inputs may be). A module name is looked up from the current directory first, as `python -m`
does, so `fpdoctor compare my_factory:make` finds ./my_factory.py. Every way this can fail is a
one-line usage error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from fpdoctor.cli.errors import UsageError

USAGE = "MODEL must be path/to/file.py:factory or package.module:factory, the factory returning (model, inputs)"

FACTORY_HELP = """\
MODEL is path/to/file.py:factory or package.module:factory (a module in the current directory is
found, as `python -m` finds it). The factory takes no arguments and returns (model, inputs):

  def make():
      model = MyModel().eval()
      return model, torch.randn(8, 3, 224, 224)             # one tensor: model(x)
      # or (ids, mask)                                      # a tuple: model(ids, mask)
      # or {"input_ids": ids, "attention_mask": mask}       # a dict: model(**inputs)
      # or [(x, torch.tensor([10])), (x, torch.tensor([999]))]   # a list: several input sets,
      #    each judged (a sampler at several timesteps, several batch shapes); a generator works too

A model whose one argument is itself a list takes a tuple around it: ([img1, img2],).
The report names the inputs it used (shapes, dtypes and a digest of their values)."""


def _import_module(target: str) -> Any:
    # `python -m` puts the current directory first on sys.path; the console script does not
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(target)


def load(spec: str) -> tuple[Any, Any]:
    factory = _callable(spec, USAGE, "factory")
    try:
        made = factory()
    except Exception as exc:
        raise UsageError(f"the factory {spec} raised {type(exc).__name__}: {exc}") from exc
    import torch

    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
        what = type(made).__name__
        if isinstance(made, torch.nn.Module):
            what = "a model without inputs"
        raise UsageError(
            f"the factory {spec} returned {what}; it must return (model, inputs), e.g. (model, torch.randn(8, 64)) "
            "(see `fpdoctor compare --help`)"
        )
    return made


TRANSFORM_USAGE = (
    "--candidate FILE.py:FUNCTION (or package.module:FUNCTION) names a function that takes the model and returns the "
    "candidate it makes (quantize_dynamic, a pruning)"
)


def is_function_spec(value: str) -> bool:
    """`file.py:function` or `package.module:function`: a function of the user's, not a precision's name."""
    target, sep, name = value.rpartition(":")
    return bool(sep and target and name)


def load_function(spec: str) -> Any:
    """The function `spec` names (imported as MODEL's factory is), not called."""
    return _callable(spec, TRANSFORM_USAGE, "function")


def _callable(spec: str, usage: str, noun: str) -> Any:
    target, sep, factory_name = spec.rpartition(":")
    if not sep or not target or not factory_name.isidentifier():
        raise UsageError(f"{spec!r}: {usage}")
    if target.endswith(".py") or os.sep in target:
        if not os.path.isfile(target):
            raise UsageError(f"{target}: no such file ({usage})")
        name = f"fpdoctor_model_{abs(hash(os.path.abspath(target)))}"
        module_spec = importlib.util.spec_from_file_location(name, target)
        if module_spec is None or module_spec.loader is None:
            raise UsageError(f"{target}: cannot be imported as Python ({usage})")
        module = importlib.util.module_from_spec(module_spec)
        # its directory stays on sys.path, as for `python file.py`: the factory and the model's
        # forward may import their neighbours later
        folder = os.path.dirname(os.path.abspath(target))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        try:
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        except Exception as exc:
            raise UsageError(f"importing {target} failed: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = _import_module(target)
        except Exception as exc:
            raise UsageError(f"importing {target} failed: {type(exc).__name__}: {exc}") from exc
    found = getattr(module, factory_name, None)
    if not callable(found):
        raise UsageError(f"{target} has no {noun} {factory_name!r}; {usage}")
    return found


def to_device(model: Any, inputs: Any, device: str) -> tuple[Any, Any]:
    from fpdoctor.precision.candidates import cast_inputs, check_device

    try:
        target = check_device(device)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return model.to(target), cast_inputs(inputs, None, target)
