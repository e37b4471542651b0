"""What Dynamo compiled in a block, for the compiled-model tests: its graphs, frames, recompiles and
graph breaks, with every warning and what reached stderr."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from typing import Any

import torch


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
