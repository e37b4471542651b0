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
from fpdoctor.formats import DTYPE_FORMAT, FORMATS, OVERFLOW_SHARE, UNDERFLOW_SHARE
from fpdoctor.numerics.trace.blame import module_text, where_text
from fpdoctor.numerics.trace.ops import VALUE_PRESERVING
from fpdoctor.numerics.trace.tracer import GROWS, Record, Tracer
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
        ops = op_overflow(records, self.targets)
        what_if = "fp16" in self.targets and not runs_low_precision(records)
        for row in rows:
            in_use = DTYPE_FORMAT.get(row["dtype"])
            where = _module_where(row)
            if in_use == "fp32" and what_if and row["fp16_max_share"] >= OVERFLOW_SHARE:
                evidence = {
                    "kind": "overflow",
                    "target": "fp16",
                    "share": row["fp16_max_share"],
                    "absmax": row["absmax"],
                    "dtype": row["dtype"],
                    "what_if": True,
                    "numel": row["numel"],
                }
                # the op that made this output, near the limit itself: one finding, with its line
                same = ops.pop((where["module"], str(where.get("op")), "fp16"), None)
                location = same[1].location if same is not None else None
                if location is not None:
                    where |= {"file": location[0], "line": location[1]}
                    evidence["location"] = where_text(location)
                found.append(
                    catalog.make(
                        "overflow-risk",
                        message=(
                            f"Module `{row['module']}`'s output reaches {row['fp16_max_share']:.0%} of the fp16 max "
                            f"(absmax {row['absmax']:.4g}): {_consequence(row['fp16_max_share'], 'fp16', True)}."
                            + (f" Source: {where_text(location)}." if location else "")
                        ),
                        where=where,
                        evidence=evidence,
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
                            where=_module_where(row),
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
        found += op_findings(ops)
        return found


# Op-level overflow-risk findings per trace: the worst (module, op, format) ones. A model has
# many ops near a limit when one is (everything downstream of a large activation): the first
# few, worst first, say where to act; the rest would bury them.
MAX_OP_FINDINGS = 10

_OpKey = tuple[str | None, str, str]  # (module, op, format judged against)


def op_overflow(records: list[Record], targets: tuple[str, ...] = ("fp16",)) -> dict[_OpKey, tuple[float, Record, int]]:
    """Per (module, op, format): the largest share of the format's max a forward op output
    reached, with its record and output position. Outputs in fp16/bf16/fp8 are judged against
    their own format; fp32 outputs of the ops in GROWS against fp16's when "fp16" is in
    `targets` and the model runs in fp32 (a what-if: the trace has their exact range with
    `Tracer.ranges`, or on an accelerator; module outputs get their own what-if in
    `Headroom.findings`). Non-finite outputs are nonfinite-produced's story, not a risk.
    Backward values are left out: a loss scaler raises fp16 gradients until they overflow and
    then backs off, so gradients near the max are its design, and the skipped step it handles."""
    worst: dict[_OpKey, tuple[float, Record, int]] = {}
    what_if = "fp16" in targets and not runs_low_precision(records)
    for r in records:
        if r.kind or r.phase != "forward" or r.recompute:
            continue
        name = r.op.split(".")[1] if r.op.count(".") >= 2 else r.op
        for position, out in enumerate(r.outputs):
            absmax = out.absmax
            if absmax is None:
                continue
            fmt = DTYPE_FORMAT.get(out.dtype)
            if fmt == "fp32" and what_if:
                fmt = "fp16"
                if name not in GROWS:  # as on a CPU, where the trace takes these ops' ranges alone
                    continue
            elif fmt in (None, "fp32") or not judged(name, cast=True):
                continue
            share = absmax / FORMATS[fmt].max
            key = (r.module, r.op, fmt)
            if share >= OVERFLOW_SHARE and share > worst.get(key, (0.0,))[0]:
                worst[key] = (share, r, position)
    return worst


def runs_low_precision(records: list[Record]) -> bool:
    """Some forward op made fp16/bf16/fp8 values: the model already runs in low precision, and
    its fp32 ops are fp32 by choice (autocast's fp32 list: sum, exp, pow, softmax; a module kept
    in fp32), so what they would do in fp16 is not a question to ask. The trace keeps the latest
    record of each kind of op, so every dtype it met is among `records`."""
    return any(
        r.phase == "forward" and DTYPE_FORMAT.get(o.dtype) not in (None, "fp32") for r in records for o in r.outputs
    )


# A cast is where values enter a narrower format: judged when its output is fp16/bf16/fp8.
_CASTS = frozenset({"_to_copy", "copy", "copy_"})
# Ops whose large values are chosen, not computed: a mask filled with the format's lowest value
# (attention masks use torch.finfo(dtype).min, -65504 in fp16), a constant.
_CONSTANT = frozenset({
    "fill", "fill_", "full", "full_like", "new_full", "masked_fill", "masked_fill_", "index_fill", "index_fill_",
    "scalar_tensor", "lift_fresh", "lift_fresh_copy",
})  # fmt: skip


def judged(name: str, *, cast: bool) -> bool:
    """Whether overflow-risk judges the outputs of the aten op `name` ("bmm", "relu"): not ops
    that only move or select values (a reshape's copy, cat, relu: they repeat what the op that
    made the values was judged on), except casts when `cast` (their output is in a narrower
    format), and not constant fills."""
    if name in _CONSTANT:
        return False
    return name not in VALUE_PRESERVING or (cast and name in _CASTS)


def op_findings(worst: dict[_OpKey, tuple[float, Record, int]], limit: int = MAX_OP_FINDINGS) -> list[Finding]:
    """overflow-risk findings for `op_overflow`'s entries: the `limit` largest shares, largest first."""
    ranked = sorted(worst.items(), key=lambda item: -item[1][0])[:limit]
    found = []
    for (module, op, target), (share, r, position) in ranked:
        out = r.outputs[position]
        absmax = out.absmax
        assert absmax is not None  # op_overflow keeps only outputs with a known range
        found.append(
            near_limit_finding(
                op=op,
                module=module,
                phase=r.phase,
                call=r.call,
                target=target,
                share=share,
                absmax=absmax,
                dtype=out.dtype,
                numel=math.prod(out.shape),
                location=r.location,
                what_if=DTYPE_FORMAT.get(out.dtype) == "fp32",
            )
        )
    return found


def near_limit_finding(
    *,
    op: str,
    module: str | None,
    phase: str,
    call: int | None,
    target: str,
    share: float,
    absmax: float,
    dtype: str,
    numel: int,
    location: tuple[str, int, str] | None,
    what_if: bool,
    ran_in: str | None = None,
    also: str | None = None,
    evidence: dict[str, Any] | None = None,
) -> Finding:
    """One op output at or above OVERFLOW_SHARE of `target`'s max: where (with the source line
    when known), how close, and the fix. `ran_in`: the run it was measured in, when that is not
    the user's own (compare's candidate copy); `also`: a note after the absmax (the value in
    another run); `evidence`: more facts for its evidence."""
    where: dict[str, Any] = {"module": module, "op": op, "phase": phase}
    if call is not None:
        where["iteration"] = call + 1  # counted from 1, as users count steps
    at = where_text(location)
    if location is not None:
        where |= {"file": location[0], "line": location[1]}
    fmt = FORMATS[target]
    measured = f" in the {ran_in} run" if ran_in else " in fp32" if what_if else ""
    size = f"absmax {absmax:.4g}" + (f" ({also})" if also else "")
    message = (
        f"{op} {module_text(module)} ({phase}{f', call {call + 1}' if call else ''}) reaches {share:.0%} of the "
        f"{target} max ({fmt.max:g}){measured}: {size}; {_consequence(share, target, what_if)}."
        + (f" Source: {at}." if at else "")
    )
    keep = f"in {target}, keep {op} in fp32" if what_if else f"compute {op} in fp32"
    # a sum of many terms (a matmul, a reduction) is scaled down by scaling an operand; an attention's
    # scores by dividing q by sqrt(d) before q·kᵀ, which is only one such matmul
    fix = (
        f"{keep}{f' ({at})' if at else ''}: its operands .float(), the result cast back after the ops that consume "
        "it; or scale its operands down before it (a mean where it sums, 1/sqrt(d) on q before an attention's "
        "q·kᵀ)" + ("; or use bf16, which has fp32's range" if target == "fp16" else "")
    )
    facts: dict[str, Any] = {
        "kind": "overflow",
        "target": target,
        "share": share,
        "absmax": absmax,
        "dtype": dtype,
        "what_if": what_if,
        # the largest magnitude, not how many values come close: no count
        "numel": numel,
    }
    if at:
        facts["location"] = at
    return catalog.make("overflow-risk", message=message, fix=fix, where=where, evidence=facts | (evidence or {}))


def _consequence(share: float, target: str, what_if: bool) -> str:
    """What a range at `share` of `target`'s max means: how much larger values overflow."""
    if share > 1:
        return f"in {target} these values would overflow to Inf"
    if share >= 1:
        return f"they sit at the {target} max: any larger value overflows"
    times = 1 / share  # 0.98 of the max: 1.02x, never "1x"
    factor = f"{times:.3g}x" if times < 100 else f"{times:,.0f}x"
    return (
        f"in {target}, values {factor} larger would overflow"
        if what_if
        else f"values {factor} larger overflow {target}"
    )


def _module_where(row: dict[str, Any]) -> dict[str, Any]:
    """A per-module row's where: the module, the op that produced its output, forward."""
    # the table shows the root as "<root>"; `where` speaks named_modules(), where it is ""
    where: dict[str, Any] = {"module": "" if row["module"] == "<root>" else row["module"], "phase": "forward"}
    if "op" in row:
        where["op"] = row["op"]
    return where
