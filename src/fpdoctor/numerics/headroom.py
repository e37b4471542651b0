"""Dtype headroom: how close value ranges come to the limits of fp16, bf16 and fp8.

Per op, the trace's `aminmax` already gives the largest magnitude (overflow). Per module output,
a histogram of binary exponents (`frexp`) says what share of non-zero values sits below any
power-of-two threshold, which is what underflow needs: every flush threshold of these formats
is a power of two. Histograms stay on the device and are read once at the end.

A container that returns its last child's output hands the same tensor object to two module
hooks; it is counted once, for the child. Sameness is object identity in a weak table (an entry
dies with its tensor), never `id()`, which Python reuses as soon as a tensor is freed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from fpdoctor import catalog
from fpdoctor.numerics.blame import _module_text
from fpdoctor.numerics.limits import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE, UNDERFLOW_SHARE
from fpdoctor.numerics.trace import Record, Tracer
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding

_OFFSET = 160  # frexp exponents of float32 values lie in [-148, 128]
_BINS = 300
# Shares are estimated on an evenly strided sample: 8192 values put the standard error of a 1%
# share near 0.1%, far below the thresholds, at a fixed cost whatever the activation size.
SAMPLE = 8192


@dataclass
class ModuleStats:
    dtype: str
    calls: int = 0
    numel: int = 0  # values observed over all calls (the histogram holds a sample of them)
    absmax: float = 0.0
    op: str | None = None  # the op that produced the output (its last call)
    hist: Any = None  # int64 counts per exponent; bin 0 holds exact zeros

    @torch.no_grad()
    def add(self, t: torch.Tensor, absmax: float | None = None) -> None:
        n = t.numel()
        if n > SAMPLE:
            if t.is_contiguous():
                flat = t.view(-1)[:: n // SAMPLE]
            else:  # stride the first dimension, then flatten the (small) rest: no full copy
                rows = max(1, SAMPLE * t.shape[0] // n)
                flat = t[:: max(1, t.shape[0] // rows)].reshape(-1)[:SAMPLE]
        else:
            flat = t.reshape(-1)
        a = flat.abs().float()
        _, exponent = torch.frexp(a)
        index = torch.where(a > 0, exponent + _OFFSET, 0).clamp_(0, _BINS - 1)
        counts = torch.bincount(index, minlength=_BINS)
        self.hist = counts if self.hist is None else self.hist + counts
        # Exact: from the producing op's aminmax when it took one, else one aminmax here.
        if absmax is None:
            lo, hi = torch.aminmax(t.detach().float() if t.dtype not in (torch.float32, torch.float64) else t.detach())
            absmax = max(-float(lo), float(hi))
        top = float(absmax)
        # NaN must stick: Python's max(0.0, nan) is 0.0, which would show a NaN output as all zeros
        self.absmax = math.nan if math.isnan(top) or math.isnan(self.absmax) else max(float(self.absmax), top)
        self.numel += n
        self.calls += 1


def share_below(hist: list[int], threshold: float) -> float:
    """Share of non-zero values with magnitude < threshold (threshold rounded down to a power of 2)."""
    nonzero = sum(hist[1:])
    if nonzero == 0 or threshold <= 0:
        return 0.0
    # frexp: |v| in [2**(e-1), 2**e); all of bin e is below 2**k when e <= k.
    k = math.floor(math.log2(threshold))
    return sum(hist[1 : max(1, min(_BINS, k + _OFFSET + 1))]) / nonzero


def smallest_nonzero(hist: list[int]) -> float | None:
    for i in range(1, _BINS):
        if hist[i]:
            return 2.0 ** (i - _OFFSET - 1)  # lower edge of the first occupied bin
    return None


class Headroom:
    def __init__(self, targets: tuple[str, ...] = ("fp16", "bf16")) -> None:
        self.targets = targets
        self.modules: dict[str, ModuleStats] = {}
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> its _version when observed

    def observe_module(
        self,
        name: str,
        output: Any,
        absmax_of: Callable[[torch.Tensor], float | None] | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        """Add one module call's floating outputs; `tracer` names the op that produced each."""
        for t in tensors_in(output):
            if not (t.is_floating_point() and t.numel() > 0):
                continue
            if self._seen.get(t) == t._version:  # a container returning its child's output: counted once
                continue
            self._seen[t] = t._version
            stats = self.modules.get(name)
            if stats is None:
                stats = self.modules[name] = ModuleStats(str(t.dtype))
            stats.add(t, absmax_of(t) if absmax_of is not None else None)
            if tracer is not None and (index := tracer.producer_of(t)) is not None:
                stats.op = tracer.records[index].op

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for name, s in self.modules.items():
            hist = s.hist.tolist()
            absmax = float(s.absmax)
            if not math.isfinite(absmax):
                continue  # non-finite outputs are the trace's story, not headroom's
            row: dict[str, Any] = {
                "module": name or "<root>",
                "dtype": s.dtype,
                "calls": s.calls,
                "numel": s.numel,
                "sampled": sum(hist),
                "absmax": absmax,
                "smallest_nonzero": smallest_nonzero(hist),
                "zeros": hist[0] / max(1, sum(hist)),
            }
            if s.op is not None:
                row["op"] = s.op
            row["fp16_max_share"] = absmax / FORMATS["fp16"].max
            row["fp16_flush"] = share_below(hist, FORMATS["fp16"].flush_threshold)
            row["fp16_subnormal"] = share_below(hist, FORMATS["fp16"].smallest_normal)
            row["bf16_flush"] = share_below(hist, FORMATS["bf16"].flush_threshold)
            for fmt in ("fp8_e4m3", "fp8_e5m2"):
                f = FORMATS[fmt]
                # tensorwise scaling maps absmax to the format's max; what falls below its flush threshold?
                row[f"{fmt}_scaled_flush"] = share_below(hist, f.flush_threshold * absmax / f.max) if absmax else 0.0
            rows.append(row)
        return rows

    def findings(self, rows: list[dict[str, Any]], records: list[Record]) -> list[Finding]:
        found = []
        for row in rows:
            in_use = DTYPE_FORMAT.get(row["dtype"])
            where = _module_where(row)
            if in_use == "fp32" and "fp16" in self.targets and row["fp16_max_share"] >= OVERFLOW_SHARE:
                found.append(
                    catalog.make(
                        "overflow-risk",
                        message=(
                            f"Module `{row['module']}`'s output reaches {row['fp16_max_share']:.0%} of the fp16 max "
                            f"(absmax {row['absmax']:.4g}): it would overflow if it ran in fp16."
                        ),
                        where=where,
                        evidence={
                            "kind": "overflow",
                            "target": "fp16",
                            "share": row["fp16_max_share"],
                            "absmax": row["absmax"],
                            "dtype": row["dtype"],
                            "what_if": True,
                            "numel": row["numel"],
                        },
                    )
                )
            nonzero = row["sampled"] * (1 - row["zeros"])
            for target in self.targets:
                if target == in_use:
                    continue
                share = row.get(f"{target}_flush", 0.0)
                if share >= UNDERFLOW_SHARE:
                    found.append(
                        catalog.make(
                            "underflow-risk",
                            message=(
                                f"{share:.1%} of the non-zero values of module `{row['module']}`'s output would flush "
                                f"to zero in {target} (smallest non-zero magnitude {row['smallest_nonzero']:.3g})."
                            ),
                            where=where,
                            evidence={
                                "kind": "underflow",
                                "target": target,
                                "share": share,
                                "dtype": row["dtype"],
                                "smallest_nonzero": row["smallest_nonzero"],
                                # counted on an evenly strided sample of `sampled` of the `numel` values
                                "count": round(share * nonzero),
                                "sampled": row["sampled"],
                                "numel": row["numel"],
                            },
                        )
                    )
        found += self._overflow(records)
        return found

    def _overflow(self, records: list[Record]) -> list[Finding]:
        worst: dict[tuple[str | None, str, str], tuple[float, Record, str]] = {}
        for r in records:
            if r.kind or r.phase == "optimizer":
                continue
            for out in r.outputs:
                in_use = DTYPE_FORMAT.get(out.dtype)
                if out.absmax is None or in_use not in ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2"):
                    continue  # fp32 what-ifs are judged per module, where the exact absmax is taken
                share = out.absmax / FORMATS[in_use].max
                key = (r.module, r.op, in_use)
                if share >= OVERFLOW_SHARE and share > worst.get(key, (0.0,))[0]:
                    worst[key] = (share, r, in_use)
        found = []
        for (module, op, target), (share, r, _) in list(worst.items())[:10]:
            out = r.outputs[0]
            where: dict[str, Any] = {"module": module, "op": op, "phase": r.phase}
            if r.call is not None:
                where["iteration"] = r.call + 1  # counted from 1, as users count steps
            found.append(
                catalog.make(
                    "overflow-risk",
                    message=(
                        f"{op} {_module_text(module)} reaches {share:.0%} of the {target} max "
                        f"({FORMATS[target].max:g}) ({r.phase})."
                    ),
                    where=where,
                    # the op's aminmax gives the largest magnitude, not how many values come close: no count
                    evidence={
                        "kind": "overflow",
                        "target": target,
                        "share": share,
                        "absmax": out.absmax,
                        "dtype": out.dtype,
                        "what_if": False,
                        "numel": math.prod(out.shape),
                    },
                )
            )
        return found


def _module_where(row: dict[str, Any]) -> dict[str, Any]:
    """A per-module row's where: the module, the op that produced its output, forward."""
    # the table shows the root as "<root>"; `where` speaks named_modules(), where it is ""
    where: dict[str, Any] = {"module": "" if row["module"] == "<root>" else row["module"], "phase": "forward"}
    if "op" in row:
        where["op"] = row["op"]
    return where
