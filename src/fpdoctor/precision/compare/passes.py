"""Running compare's copies of the model: a whole pass with hooks on every module, one module
re-run on the fp64 run's inputs, the input rounding floor, and the noise a forward draws itself."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fpdoctor.precision.candidates import cast_inputs, split_inputs
from fpdoctor.precision.compare.noise import RecordNoise, ReplayNoise
from fpdoctor.precision.metrics import all_finite, cosine, flat_sample, rel_error
from fpdoctor.preserve import RngState


def hooked(
    run: nn.Module,
    inputs: Any,
    dtype: torch.dtype,
    *,
    pre: Callable[..., None] | None,
    post: Callable[..., None],
    rng: RngState,
    device: torch.device | None = None,
    noise: ReplayNoise | None = None,
) -> None:
    """Run `run` on `inputs` (cast to `dtype`) with hooks that get (name, call index, ...), from
    RNG state `rng`, and with `noise` replaying the draws the fp64 run made (see noise.py)."""
    calls: dict[str, int] = {}
    handles = []
    for name, module in run.named_modules():
        if pre is not None:

            def on_pre(mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                pre(name, calls.get(name, 0), mod, args, kwargs)

            handles.append(module.register_forward_pre_hook(on_pre, with_kwargs=True))

        def on_post(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
            index = calls.get(name, 0)
            calls[name] = index + 1
            post(name, index, args, output)

        handles.append(module.register_forward_hook(on_post))
    args, kwargs = split_inputs(cast_inputs(inputs, dtype, device, copy=True))
    rng.restore()
    if noise is not None:
        noise.position = 0
    try:
        with torch.no_grad(), noise if noise is not None else contextlib.nullcontext():
            run(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def input_rounding_error(
    run: nn.Module,
    inputs: Any,
    *,
    cand_dtype: torch.dtype,
    dtype: torch.dtype,
    truth: torch.Tensor,
    norm: float,
    rng: RngState,
    noise: ReplayNoise | None,
) -> float | None:
    """The end-to-end error of `run` (the reference, in `dtype`) fed the inputs rounded to the
    candidate's dtype: what rounding the inputs alone costs, which no part kept in fp32 undoes."""
    args, kwargs = split_inputs(cast_inputs(cast_inputs(inputs, cand_dtype), dtype, copy=True))
    rng.restore()
    if noise is not None:
        noise.position = 0
    try:
        with torch.no_grad(), noise if noise is not None else contextlib.nullcontext():
            out = flat_sample(run(*args, **kwargs))
    except Exception:  # the rounded inputs take another path that fails: no floor to speak of
        return None
    if out is None or out.numel() != truth.numel():
        return None
    return rel_error(out, truth, norm)


def record_noise(run: nn.Module, inputs: Any, rng: RngState) -> list[torch.Tensor]:
    """The random draws a plain fp64 forward makes from RNG state `rng`, in order."""
    recorder = RecordNoise()
    args, kwargs = split_inputs(cast_inputs(inputs, torch.float64, copy=True))
    rng.restore()
    with torch.no_grad(), recorder:
        run(*args, **kwargs)
    return recorder.draws


def rerun(
    module: nn.Module,
    rows: torch.Tensor | None,
    args: Any,
    kwargs: Any,
    *,
    dtype: torch.dtype,
    device: torch.device | None,
    truth: torch.Tensor,
    norm: float,
) -> tuple[float | None, float | None]:
    """`module` in `dtype` on the fp64 inputs (or just their `rows`): (relative error, cosine)."""
    if rows is not None:
        out = module(cast_inputs(rows, dtype, device), **cast_inputs(kwargs, dtype, device))
        sample: torch.Tensor | None = out.detach().reshape(-1).double()
    else:
        out = module(*cast_inputs(args, dtype, device), **cast_inputs(kwargs, dtype, device))
        sample = flat_sample(out)
    if sample is None or sample.numel() != truth.numel():
        return None, None
    if not all_finite(out):
        return math.inf, None
    return rel_error(sample, truth, norm), cosine(sample, truth, norm)
