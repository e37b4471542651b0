"""Comparing one module of a large model: its inputs as the whole model computes them.

compare's weight copies (fp64 and the candidate's) are O(parameters); for a model that does not
fit twice more, `compare(model, inputs, module="layers.17")` copies only that module and feeds it
what it receives when the whole model runs on `inputs`, in the model's own dtype.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import Call, cast_inputs, map_tensors, split_inputs
from fpdoctor.precision.modes import eval_mode
from fpdoctor.preserve import preserved


class _Captured(Exception):
    """Stops the model's forward once the module's inputs are in hand."""


def find_module(model: nn.Module, name: str) -> nn.Module:
    """`model`'s submodule `name`, or ValueError naming what there is."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        top = ", ".join(n for n, _ in model.named_children()) or "none"
        raise ValueError(f"the model has no module {name!r}; its top-level modules: {top}") from None


def module_inputs(model: nn.Module, inputs: Any, target: nn.Module) -> Call:
    """The arguments of `target`'s first call while `model` runs on `inputs` (eval mode, no
    gradients; the model's buffers and the RNG are left as they were)."""
    captured: list[Call] = []

    def grab(module: nn.Module, args: Any, kwargs: Any) -> None:
        captured.append(map_tensors(Call(args, kwargs), lambda t: t.detach().clone()))
        raise _Captured

    args, kwargs = split_inputs(cast_inputs(inputs, None, copy=True))  # a forward may write into its inputs
    handle = target.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad(), eval_mode(model), preserved(model):
            model(*args, **kwargs)
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError("the module is never called when the model runs on these inputs")
    return captured[0]
