"""For the compiled-model tests: whether a torch.compile backend works on this machine (asked when
a test runs, not when the suite is collected: every worker collects every file), and what Dynamo
compiled in a block: its graphs, frames, recompiles and graph breaks, with every warning and what
reached stderr."""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch


@functools.cache
def _cannot_compile(backend: str) -> str | None:
    try:
        torch.compile(lambda x: x.exp(), backend=backend)(torch.ones(2))
    except Exception as exc:  # no C++ compiler for Inductor, or a torch.compile that fails here
        return f"torch.compile with {backend} cannot run here: {type(exc).__name__}: {exc}"
    return None


def needs_backend(backend: str) -> None:
    """Skip the calling test, saying why, where `backend` cannot compile a one-op function."""
    reason = _cannot_compile(backend)
    if reason is not None:
        pytest.skip(reason)


@contextlib.contextmanager
def counted() -> Iterator[dict[str, Any]]:
    """From a Dynamo with nothing compiled; the dict is filled when the block ends."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    seen: dict[str, Any] = {}
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err):
        warnings.simplefilter("always")
        yield seen
    seen["graphs"] = counters["stats"]["unique_graphs"]
    seen["frames"] = dict(counters["frames"])
    seen["recompiles"] = sum(counters["recompiles"].values())
    seen["breaks"] = sum(counters["graph_break"].values())
    seen["text"] = err.getvalue() + "\n".join(f"{w.filename}: {w.message}" for w in caught)
