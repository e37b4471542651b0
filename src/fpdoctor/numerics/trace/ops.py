"""What the trace needs to know about an aten op: which values it can make non-finite, which
arguments it writes, which it reads only for their shape.
"""

from __future__ import annotations

from typing import Any

import torch

# Ops that cannot turn finite inputs into NaN/Inf: they move, select, compare or zero values.
# A copy into a narrower dtype is not among them: fp32 -> fp16 overflows (`values.narrows`).
VALUE_PRESERVING = frozenset({
    "_unsafe_view", "clone", "copy", "copy_", "_to_copy", "relu", "threshold_backward", "select_backward",
    "slice_backward", "embedding", "index_select", "gather", "cat", "stack", "where", "bernoulli", "bernoulli_",
    "repeat", "max", "min", "amax", "amin", "max_pool2d_with_indices", "index", "masked_select", "sort", "topk",
    "flip", "roll", "tril", "triu", "zero_", "zeros_like",
})  # fmt: skip
# Of those, the ones that select a part of their input (followed as its alias): a re-run of the chain
# above them selects the same part again from its recomputed values (engine.reruns.Window.select).
SELECTS = frozenset({"gather", "index", "index_select", "masked_select"})
# Fresh memory holds garbage until it is written: not a value to check.
_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# Ops that take a tensor only for its shape, dtype and device.
_SHAPE_ONLY = frozenset({
    "ones_like", "zeros_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_ones", "new_zeros", "new_empty", "new_full", "new_empty_strided",
})  # fmt: skip
# In-place ops whose result does not depend on what the written tensor held.
_OVERWRITES = frozenset({
    "copy_", "zero_", "fill_", "uniform_", "normal_", "random_", "exponential_", "bernoulli_", "set_", "resize_",
})  # fmt: skip


_UNDECLARED_STATS_WRITERS = frozenset({"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm"})


def tensor_args(values: Any, into: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments (tensors and lists of tensors: no deeper)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            into.append(value)
        elif isinstance(value, (list, tuple)):
            tensor_args(value, into)
    return into


GENERAL, VIEW, FUNCTIONAL, IN_PLACE = range(4)


class OpInfo:
    """What the tracer needs to know about an aten overload, worked out once."""

    __slots__ = (
        "collective", "func", "is_view", "lists", "name", "op", "overwrites", "path", "preserving", "reads_inputs",
        "rebuilds", "scales", "uninitialised", "writes",
    )  # fmt: skip

    def __init__(self, func: Any) -> None:
        self.func = func  # held: the tracer keys these by id(func)
        self.op = str(func)
        self.name = func.overloadpacket.__name__
        self.is_view = bool(func.is_view)
        # (position, name) of every argument the op writes: in-place, out=, foreach and fused ops
        self.writes = tuple(
            (i, arg.name)
            for i, arg in enumerate(func._schema.arguments)
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        # Batch norm writes its running statistics (arguments 3 and 4) without saying so in its
        # schema: without this they would be read after the write and taken for inputs that
        # already held the batch's NaN.
        if not self.writes and self.name in _UNDECLARED_STATS_WRITERS:
            self.writes = ((3, "running_mean"), (4, "running_var"))
        self.preserving = self.name in VALUE_PRESERVING
        self.uninitialised = self.name in _UNINITIALISED
        self.reads_inputs = self.name not in _SHAPE_ONLY and not self.uninitialised
        self.overwrites = self.name in _OVERWRITES
        # Tensors can only hide in list arguments (cat, stack, index, foreach): the others are
        # found among the top-level arguments without a recursive walk.
        self.lists = any("List[" in str(arg.type) and "Tensor" in str(arg.type) for arg in func._schema.arguments)
        # mul by a scalar of magnitude <= 1 or div by one >= 1: never larger than a finite input
        self.scales = 1 if self.name in ("mul", "mul_") else -1 if self.name in ("div", "div_") else 0
        # torch.distributed's ops: what they write or return holds other ranks' values, ready
        # only when the work completes (after the op returns)
        self.collective = getattr(func, "namespace", "") in ("c10d", "_c10d_functional", "c10d_functional")
        # set_ onto a storage: a tensor rebuilt from memory made elsewhere (a DataLoader worker's batch, shared
        # memory), whose values come from outside the trace as an input's do
        self.rebuilds = self.name == "set_" and "Storage" in str(func._schema.arguments[1].type)
        self.path = self._path(func)

    def _path(self, func: Any) -> int:
        """Which of the tracer's paths records this op: VIEW, the plain FUNCTIONAL one (values
        out, nothing written), IN_PLACE on its first argument only, or GENERAL for the rest."""
        if self.is_view and not self.collective:
            return VIEW
        if self.collective or self.preserving or self.uninitialised or not self.reads_inputs:
            return GENERAL
        if not self.writes:
            return FUNCTIONAL
        if self.writes == ((0, "self"),) and not self.overwrites and str(func._schema.arguments[0].type) == "Tensor":
            return IN_PLACE
        return GENERAL

    def written(self, args: Any, kwargs: Any) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        for position, name in self.writes:
            value = args[position] if position < len(args) else kwargs.get(name)
            if value is not None:
                tensor_args((value,), found)
        return found
