"""Parameters and buffers that do not fit a format: a cause of divergence in themselves.

`.half()` turns a BatchNorm `running_var` above 65504 into Inf (and the normalised output into
zeros), and a weight below fp16's smallest subnormal into 0. Any value above the format's max
counts (one Inf is enough to poison a layer); flushing counts when at least FLUSH_SHARE of the
tensor's non-zero values flush, since any large weight has a few values near zero by chance.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fpdoctor.formats import FORMATS, Format
from fpdoctor.precision.metrics import Reads, largest
from fpdoctor.precision.names import PRECISIONS

# 1% of a tensor's non-zero values flushed to zero is a visible change of what it computes (a
# N(0, 0.02) weight has ~1e-6 of its values below fp16's flush threshold by chance).
FLUSH_SHARE = 0.01
# flushed values whose norm is below this share of the tensor's (fp16's unit roundoff) change it less than its
# rounding does: not what makes a divergence (fit.negligible)
LOST_NORM = 2.0**-11


def candidate_format(candidate: str) -> Format | None:
    """The storage format of a candidate's parameters (fp8 recipes scale theirs, fp32 holds all)."""
    name = PRECISIONS[candidate].storage
    return FORMATS[name] if name is not None else None


def misfits(model: nn.Module, fmt: Format, *, skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every floating parameter and buffer of `model` with values beyond `fmt`'s range (they
    become Inf) or with at least FLUSH_SHARE of its non-zero values below its flush threshold
    (they become 0); tensors whose dtype is in `skip` (e.g. already in that format) are left out."""
    tensors = []
    for module_name, module in model.named_modules():
        own = [("parameter", n, t) for n, t in module.named_parameters(recurse=False)]
        own += [("buffer", n, t) for n, t in module.named_buffers(recurse=False)]
        for kind, name, t in own:
            if t is None or not t.is_floating_point() or t.numel() == 0 or t.is_meta or str(t.dtype) in skip:
                continue
            tensors.append((module_name, name, kind, t.detach()))
    # three kernels' worth per tensor, read together: one wait per device, not three per tensor
    reads, counts = Reads(), []
    for *_, t in tensors:
        counted: list[Any] = []
        reads.later([largest(t), torch.count_nonzero(t), torch.count_nonzero(t.abs() < fmt.flush_threshold)],
                    lambda *got, counted=counted: counted.extend(got))  # fmt: skip
        counts.append(counted)
    reads.read()
    found = []
    for (module_name, name, kind, t), (biggest, nonzero, below) in zip(tensors, counts, strict=True):
        if math.isfinite(biggest) and biggest <= fmt.max:  # nothing beyond the max; the zeros are below
            over, flushed, count = 0, below - (t.numel() - nonzero), nonzero
        else:  # a value beyond the max, or NaN/Inf among them (then not every non-zero value counts)
            over, flushed, count = (int(v) for v in _counts(t, fmt).tolist())
        entry = _check(t, fmt, over, flushed, count)
        if entry:
            found.append(
                {"tensor": f"{module_name}.{name}" if module_name else name, "module": module_name, "kind": kind}
                | entry
            )
    return found


def _counts(t: torch.Tensor, fmt: Format) -> torch.Tensor:
    """(finite values beyond the format's max, finite non-zero values it flushes, finite non-zero values)."""
    magnitude = t.abs()
    finite = torch.isfinite(magnitude)
    nonzero = (magnitude > 0) & finite
    return torch.stack([((magnitude > fmt.max) & finite).sum(), (nonzero & (magnitude < fmt.flush_threshold)).sum(),
                        nonzero.sum()])  # fmt: skip


def _check(t: torch.Tensor, fmt: Format, over: int, flushed: int, count: int) -> dict[str, Any] | None:
    share = flushed / count if count else 0.0
    if not over and share < FLUSH_SHARE:
        return None
    magnitude = t.abs()
    finite = torch.isfinite(magnitude)
    nonzero = (magnitude > 0) & finite
    lost = 0.0
    if share >= FLUSH_SHARE:  # the flushed values' share of the tensor's norm (negligible: below LOST_NORM)
        whole = float(magnitude[finite].double().norm())
        lost = float(magnitude[nonzero & (magnitude < fmt.flush_threshold)].double().norm()) / whole if whole else 1.0
    entry: dict[str, Any] = {"numel": t.numel(), "format": fmt.name}
    if over:
        entry |= {"overflow": over, "max": float(magnitude[finite].max()), "limit": fmt.max}
    if share >= FLUSH_SHARE:
        entry |= {
            "flush": flushed,
            "flush_share": share,
            "smallest": float(magnitude[nonzero].min()),
            "flush_threshold": fmt.flush_threshold,
            "flush_norm_share": lost,
        }
    return entry


def describe(entry: dict[str, Any]) -> str:
    """`buffer bn.running_var holds values up to 1.2e+05, above fp16's max 65504 (3 value(s) become Inf)`."""
    parts = []
    if "overflow" in entry:
        parts.append(
            f"holds values up to {entry['max']:.3g}, above {entry['format']}'s max {entry['limit']:.6g} "
            f"({entry['overflow']} value(s) become Inf)"
        )
    if "flush" in entry:
        parts.append(
            f"has {entry['flush_share']:.0%} of its non-zero values below {entry['format']}'s smallest subnormal "
            f"(down to {entry['smallest']:.2g}; they become 0)"
        )
    return f"{entry['kind']} {entry['tensor']} " + " and ".join(parts)


def negligible(entry: dict[str, Any]) -> bool:
    """A flush alone whose values are a share of the tensor's norm below LOST_NORM (a DFT table's
    near-zeros beside entries near 1): it changes what a sum or product of the tensor computes less than
    its rounding does (a log of those entries still sees their 0: the non-finite checks keep it)."""
    return "overflow" not in entry and entry.get("flush_norm_share", 1.0) < LOST_NORM


def within(entries: list[dict[str, Any]], module: str) -> list[dict[str, Any]]:
    """The entries of `module` and the modules inside it."""
    return [e for e in entries if module == "" or e["module"] == module or e["module"].startswith(module + ".")]
