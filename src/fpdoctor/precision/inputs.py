"""Example inputs: one input set or several, and what the report says about them.

An input set is one tensor (`model(x)`), a tuple of positional arguments, a dict of keyword
arguments, or a `Call` with both. Several input sets are a list of them, or any other iterable
(a generator): a sampler judged at several timesteps, a model at several batch shapes. A model
whose single argument is a list takes a tuple around it: `([a, b],)`.

Every report names the inputs it was given: per set, each tensor's name, shape and dtype, and a
digest of the values, so two reports can be told apart by what they ran on.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fpdoctor.precision.candidates import Call, split_inputs


def input_sets(inputs: Any) -> list[Any]:
    """`inputs` as a list of input sets (one set: a one-element list)."""
    if isinstance(inputs, (torch.Tensor, tuple, Mapping, Call)) or inputs is None:
        return [inputs]
    if isinstance(inputs, list):
        sets = inputs
    elif isinstance(inputs, Iterable) and not isinstance(inputs, (str, bytes)):
        sets = list(inputs)
    else:
        return [inputs]
    if not sets:
        raise ValueError("inputs is an empty list: give one input set (a tensor, tuple or dict), or a list of them")
    return sets


def named_tensors(inputs: Any) -> list[tuple[str, torch.Tensor]]:
    args, kwargs = split_inputs(inputs)
    named: list[tuple[str, torch.Tensor]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            named.append((prefix, value))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}[{i}]", v)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(f"{prefix}[{k!r}]", v)

    for i, v in enumerate(args):
        walk(f"inputs[{i}]", v)
    for k, v in kwargs.items():
        walk(f"inputs[{k!r}]", v)
    return named


def digest(inputs: Any) -> str:
    """sha256 of every tensor's dtype, shape and values, in order; 12 hex digits."""
    h = hashlib.sha256()
    for name, t in named_tensors(inputs):
        h.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        data = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return h.hexdigest()[:12]


def describe(inputs: Any) -> dict[str, Any]:
    """One input set for the report: its tensors (name, shape, dtype) and the digest."""
    tensors = [
        {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
        for name, t in named_tensors(inputs)
    ]
    return {"tensors": tensors, "digest": digest(inputs)}


def text(described: dict[str, Any], limit: int = 4) -> str:
    """`x float32[4, 32, 64], t int64[4] (digest 1a2b3c4d5e6f)` for the summary."""
    tensors = described["tensors"]
    parts = [f"{t['name']} {t['dtype']}{t['shape']}" for t in tensors[:limit]]
    if len(tensors) > limit:
        parts.append(f"and {len(tensors) - limit} more")
    return f"{', '.join(parts) or 'no tensors'} (digest {described['digest']})"
