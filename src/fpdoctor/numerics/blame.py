"""From trace records to findings: producers, the sinks they reach, inputs, masked values.

Roles of a record with a non-finite output:
  nan-producer  NaN out, no NaN in (Inf in is allowed: inf - inf, 0 * inf)
  inf-producer  Inf out, every input finite (overflow, division by zero, log(0))
  constant      no tensor inputs (torch.full(..., nan), an -inf attention mask)
  propagator    passes on what it received
`origins` of a record are the producers, constants and leaves its non-finite values come from.
A producer is blamed when a sink it reaches is non-finite; the first NaN producer and the first
Inf producer are reported separately. An -inf constant feeding a NaN producer (a mask row that
is entirely masked) is evidence for that producer, not an error of its own.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from fpdoctor import catalog
from fpdoctor.numerics.trace import Leaf, Record, Tracer
from fpdoctor.report.model import Finding

Origin = tuple[str, int]  # ("op", record index) or ("leaf", leaf index)


def _where_text(path: tuple[str, int, str] | None) -> str | None:
    return f"{path[0]}:{path[1]} in {path[2]}" if path else None


def _module_text(module: str | None) -> str:
    """'in module `enc.0`', 'in the root module' or 'outside any module'."""
    if module is None:
        return "outside any module"
    return f"in module `{module}`" if module else "in the root module"


class Analysis:
    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.records = tracer.records
        self.leaves = tracer.leaves
        self.roles: dict[int, str] = {}
        self.origins: dict[int, frozenset[Origin]] = {}
        self.reached: dict[Origin, list[str]] = defaultdict(list)
        self._classify()
        self._reach()

    def kind_of(self, src: tuple[str, int]) -> str | None:
        return self.records[src[1]].kind if src[0] == "op" else self.leaves[src[1]].kind

    def _classify(self) -> None:
        for r in self.records:
            if not r.kind:
                continue
            bad_inputs = [(src, k) for src in r.inputs if (k := self.kind_of(src))]
            if not r.inputs:
                role = "constant"
            elif r.kind == "nan" and not any(k == "nan" for _, k in bad_inputs):
                role = "nan-producer"
            elif r.kind != "nan" and not bad_inputs:
                role = "inf-producer"
            else:
                role = "propagator"
            origins: set[Origin] = {("op", r.index)} if role != "propagator" else set()
            for src, _ in bad_inputs:
                origins |= self.origins.get(src[1], frozenset()) if src[0] == "op" else {src}
            self.roles[r.index] = role
            self.origins[r.index] = frozenset(origins)

    def _reach(self) -> None:
        for kind, index, description in self.tracer.sinks:
            if kind == "op" and self.records[index].kind:
                for origin in self.origins.get(index, ()):
                    if description not in self.reached[origin] and len(self.reached[origin]) < 8:
                        self.reached[origin].append(description)

    # -- describing -----------------------------------------------------------------------------
    def source_text(self, src: tuple[str, int]) -> str:
        if src[0] == "leaf":
            leaf = self.leaves[src[1]]
            return f"parameter {leaf.name}" if leaf.name != "input" else "an input tensor"
        r = self.records[src[1]]
        return f"{r.op} ({_module_text(r.module)})"

    def input_stats(self, record: Record) -> list[dict[str, Any]]:
        if record.input_stats is not None:  # measured on the live inputs when the op ran
            return [
                {"from": self.source_text(src), **st, "nonfinite": self.kind_of(src)}
                for src, st in zip(record.inputs, record.input_stats, strict=False)
            ]
        stats = []
        for src in record.inputs[:6]:
            lo: float | None
            hi: float | None
            item: Leaf | Record = self.leaves[src[1]] if src[0] == "leaf" else self.records[src[1]]
            if isinstance(item, Leaf):
                lo, hi, dtype, shape, kind = item.lo, item.hi, item.dtype, item.shape, item.kind
            else:
                out = item.outputs[0]
                lo, hi, dtype, shape, kind = out.lo, out.hi, out.dtype, out.shape, item.kind
            stats.append(
                {
                    "from": self.source_text(src),
                    "dtype": dtype,
                    "shape": list(shape),
                    "min": lo,
                    "max": hi,
                    "nonfinite": kind,
                }
            )
        return stats

    def where(self, r: Record) -> dict[str, Any]:
        where: dict[str, Any] = {"module": r.module, "op": r.op, "phase": r.phase, "iteration": r.call}
        if r.node:
            where["autograd_node"] = r.node
        if r.forward_op:
            where["forward_op"] = r.forward_op
        if r.recompute:
            where["recompute"] = True
        return where

    def producer_finding(self, r: Record, label: str, others: list[Record]) -> Finding:
        out = next(o for o in r.outputs if o.kind)
        kinds = [k for k in ("nan", "+inf", "-inf") if out.counts and out.counts.get(k)] or [str(out.kind)]
        count = sum(out.counts.values()) if out.counts else None
        numel = math.prod(out.shape)
        reaches = self.reached.get(("op", r.index), [])
        fed = [s for s in r.inputs if self.kind_of(s)]
        from_text = ""
        if fed:
            from_text = " from " + ", ".join(f"{self.kind_of(s)} in {self.source_text(s)}" for s in fed[:2])
        else:
            from_text = " from finite inputs"
        location = _where_text(r.location)
        phase = r.phase + (" (activation-checkpoint recompute)" if r.recompute else "")
        message = (
            f"{r.op} {_module_text(r.module)} ({phase}"
            + (f", call {r.call}" if r.call else "")
            + f") produced {count if count is not None else 'some'} {'/'.join(kinds)} of {numel} values"
            f"{from_text}; they reach {', '.join(reaches[:3]) or 'a sink'}."
            + (f" Source: {location}." if location else "")
        )
        evidence: dict[str, Any] = {
            "kind": kinds[0],
            "count": count,
            "numel": numel,
            "dtype": out.dtype,
            "shape": list(out.shape),
            "counts": out.counts,
            "inputs": self.input_stats(r),
            "reaches": reaches,
            "location": location,
            "first": label,
        }
        if others:
            evidence["other_producers"] = [f"{o.op} {_module_text(o.module)} ({o.phase})" for o in others[:5]]
        return catalog.make(
            "nonfinite-produced",
            title=f"{label}: {r.op} produced {kinds[0]} from finite inputs"
            if not fed
            else f"{label}: {r.op} turned {self.kind_of(fed[0])} into {kinds[0]}",
            message=message,
            where=self.where(r),
            evidence=evidence,
            fix=_fix_for(r, self),
        )

    def findings(self) -> list[Finding]:
        found: list[Finding] = []
        blamed = [r for r in self.records if r.index in self.roles and ("op", r.index) in self.reached]
        nan_producers = [r for r in blamed if self.roles[r.index] == "nan-producer"]
        inf_producers = [r for r in blamed if self.roles[r.index] == "inf-producer"]
        if inf_producers:
            found.append(self.producer_finding(inf_producers[0], "first Inf", inf_producers[1:]))
        if nan_producers:
            found.append(self.producer_finding(nan_producers[0], "first NaN", nan_producers[1:]))
        producers_reached = bool(nan_producers or inf_producers)
        # Inputs, parameters and constants: always when they hold NaN, otherwise only when no op
        # is to blame (an -inf attention mask that feeds an all-masked row is the producer's story).
        for origin, reaches in self.reached.items():
            if origin[0] == "leaf":
                leaf = self.leaves[origin[1]]
                if leaf.kind == "nan" or not producers_reached:
                    found.append(self._input_finding(leaf, reaches))
            elif self.roles.get(origin[1]) == "constant":
                r = self.records[origin[1]]
                if r.kind == "nan" or not producers_reached:
                    found.append(self._constant_finding(r, reaches))
        masked = [
            r
            for r in self.records
            if self.roles.get(r.index) in ("nan-producer", "inf-producer") and ("op", r.index) not in self.reached
        ]
        if masked:
            r = masked[0]
            found.append(
                catalog.make(
                    "nonfinite-masked",
                    message=(
                        f"{r.op} {_module_text(r.module)} ({r.phase}) produced {r.kind}, but nothing downstream "
                        f"received it ({len(masked)} such op(s) in total)."
                        + (f" Source: {_where_text(r.location)}." if r.location else "")
                    ),
                    where=self.where(r),
                    evidence={
                        "kind": r.kind,
                        "count": len(masked),
                        "location": _where_text(r.location),
                        "numel": None,
                        "dtype": r.outputs[0].dtype,
                    },
                )
            )
        return found

    def _input_finding(self, leaf: Leaf, reaches: list[str]) -> Finding:
        first = (
            self.records[leaf.first_use] if leaf.first_use is not None and leaf.first_use < len(self.records) else None
        )
        what = f"parameter {leaf.name}" if leaf.name != "input" else "an input tensor"
        count = sum(leaf.counts.values()) if leaf.counts else None
        numel = math.prod(leaf.shape)
        return catalog.make(
            "nonfinite-input",
            message=(
                f"{what} {list(leaf.shape)} {leaf.dtype} already held {count} {leaf.kind} value(s) when it was "
                f"first used"
                + (f" by {first.op} {_module_text(first.module)}" if first else "")
                + f"; it reaches {', '.join(reaches[:3])}."
            ),
            where={
                "module": first.module if first else None,
                "op": first.op if first else None,
                "phase": first.phase if first else None,
                "input": leaf.name,
            },
            evidence={
                "kind": leaf.kind,
                "count": count,
                "numel": numel,
                "dtype": leaf.dtype,
                "shape": list(leaf.shape),
                "counts": leaf.counts,
                "origin": "parameter" if leaf.name != "input" else "input",
                "reaches": reaches,
            },
        )

    def _constant_finding(self, r: Record, reaches: list[str]) -> Finding:
        out = next(o for o in r.outputs if o.kind)
        return catalog.make(
            "nonfinite-input",
            message=(
                f"A constant created by {r.op} {_module_text(r.module)} holds {r.kind}; it reaches "
                f"{', '.join(reaches[:3])}." + (f" Source: {_where_text(r.location)}." if r.location else "")
            ),
            where=self.where(r),
            evidence={
                "kind": r.kind,
                "count": sum(out.counts.values()) if out.counts else None,
                "numel": math.prod(out.shape),
                "dtype": out.dtype,
                "origin": "constant",
                "reaches": reaches,
                "location": _where_text(r.location),
            },
        )


_OP_ADVICE = {
    "div": "guard the denominator (x / (d + eps), or torch.where(d != 0, x / d, 0) with the division masked too)",
    "log": "clamp the argument (torch.log(x.clamp_min(eps)))",
    "sqrt": "clamp the argument at zero and add eps (torch.sqrt(x.clamp_min(0) + eps))",
    "rsqrt": "add eps before rsqrt",
    "exp": "subtract the max before exp (use softmax/logsumexp), or compute it in fp32",
    "pow": "check the exponent and the base range, or compute it in fp32",
    "softmax": "check for rows that are entirely masked (-inf) and for overflowing scores; compute softmax in fp32",
    "mm": "the matmul overflowed: scale inputs down, keep it in fp32, or use bf16",
    "matmul": "the matmul overflowed: scale inputs down, keep it in fp32, or use bf16",
    "bmm": "the matmul overflowed: scale the scores (1/sqrt(d) before the product), or keep it in fp32",
    "addmm": "the linear layer overflowed: keep it in fp32 or rescale its input",
}


def _fix_for(r: Record, analysis: Analysis) -> str:
    base = r.op.split(".")[1] if r.op.startswith("aten.") else r.op
    base = base.rstrip("_").lstrip("_")
    for key, advice in _OP_ADVICE.items():
        if base == key or base.startswith(key):
            text = advice
            break
    else:
        text = catalog.get("nonfinite-produced").fix
    dtypes = {o.dtype for o in r.outputs}
    if dtypes & {"torch.float16", "torch.bfloat16"}:
        text += f"; this op ran in {', '.join(sorted(dtypes))}: keeping it (or its module) in fp32 is the quickest test"
    return text
