"""Dtype headroom: how close value ranges come to the limits of fp16, bf16 and fp8.

Per op, the trace's `aminmax` already gives the largest magnitude (overflow). Per module output,
a histogram of binary exponents (`frexp`) says what share of non-zero values sits below any
power-of-two threshold, which is what underflow needs: every flush threshold of these formats
is a power of two. Histograms stay on the device and are read once at the end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor import catalog
from fpdoctor.numerics.limits import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE, UNDERFLOW_SHARE
from fpdoctor.numerics.trace import Record, _tensors
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
    absmax: float = 0.0
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
        top = absmax
        self.absmax = max(float(self.absmax), top)
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
        self._seen: set[tuple[int, int]] = set()

    def observe_module(self, name: str, output: Any, absmax_of: Any = None) -> None:
        for t in _tensors(output):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                key = (id(t), t._version)
                if key in self._seen:  # a container returning its last child's output: counted once
                    continue
                self._seen.add(key)
                stats = self.modules.get(name)
                if stats is None:
                    stats = self.modules[name] = ModuleStats(str(t.dtype))
                stats.add(t, absmax_of(t) if absmax_of is not None else None)

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
                "absmax": absmax,
                "smallest_nonzero": smallest_nonzero(hist),
                "zeros": hist[0] / max(1, sum(hist)),
            }
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
            if in_use == "fp32" and "fp16" in self.targets and row["fp16_max_share"] >= OVERFLOW_SHARE:
                found.append(
                    catalog.make(
                        "overflow-risk",
                        message=(
                            f"Module `{row['module']}`'s output reaches {row['fp16_max_share']:.0%} of the fp16 max "
                            f"(absmax {row['absmax']:.4g}): it would overflow if it ran in fp16."
                        ),
                        where={"module": row["module"], "op": None, "phase": "forward"},
                        evidence={
                            "kind": "overflow",
                            "target": "fp16",
                            "share": row["fp16_max_share"],
                            "absmax": row["absmax"],
                            "dtype": row["dtype"],
                            "what_if": True,
                            "count": None,
                            "numel": None,
                        },
                    )
                )
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
                            where={"module": row["module"], "op": None, "phase": "forward"},
                            evidence={
                                "kind": "underflow",
                                "target": target,
                                "share": share,
                                "dtype": row["dtype"],
                                "smallest_nonzero": row["smallest_nonzero"],
                                "count": None,
                                "numel": None,
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
                for target in [in_use]:
                    share = out.absmax / FORMATS[target].max
                    key = (r.module, r.op, target)
                    if share >= OVERFLOW_SHARE and share > worst.get(key, (0.0,))[0]:
                        worst[key] = (share, r, target)
        found = []
        for (module, op, target), (share, r, _) in list(worst.items())[:10]:
            what_if = DTYPE_FORMAT.get(r.outputs[0].dtype) != target
            found.append(
                catalog.make(
                    "overflow-risk",
                    message=(
                        f"{op} in module `{module}` reaches {share:.0%} of the {target} max ({FORMATS[target].max:g})"
                        + (" if it ran in that dtype" if what_if else "")
                        + f" ({r.phase})."
                    ),
                    where={"module": module, "op": op, "phase": r.phase, "iteration": r.call},
                    evidence={
                        "kind": "overflow",
                        "target": target,
                        "share": share,
                        "absmax": r.outputs[0].absmax,
                        "dtype": r.outputs[0].dtype,
                        "what_if": what_if,
                        "count": None,
                        "numel": None,
                    },
                )
            )
        return found
