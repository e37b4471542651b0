"""`fpdoctor.compare(model, inputs, reference="fp32", candidate="fp16")`: layerwise A/B against fp64.

Three copies of the model run at once, one per thread: fp64 (the truth), the reference and the
candidate. Every module's forward hook waits at a barrier until the three copies have produced
that module's output; then the outputs are compared and released. Memory is therefore what one
forward needs plus one module's outputs three times - never all activations.

Per module:
  propagated  the candidate run's output against the fp64 output (errors accumulated so far)
  isolated    the candidate's module fed the fp64 run's inputs, against the fp64 output (leaf
              modules): what this module adds by itself
  floor       the error that rounding the fp64 output to the candidate's format causes, or the
              reference's own error against fp64 if that is larger
A module diverges when its isolated error is non-finite or more than DIVERGENCE_RATIO times the
floor: rounding of inputs and outputs stays within a few floors, while accumulation loss,
overflow and cancellation land orders of magnitude above it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.trace import _tensors
from fpdoctor.precision import fp8
from fpdoctor.precision.candidates import (
    CANDIDATES,
    REFERENCES,
    cast_inputs,
    check_name,
    compute_dtype,
    fp8_quantize,
    make_run,
)
from fpdoctor.report.model import Report

# 16x the floor is 12 dB: input and output rounding plus fp32 accumulation stay below it on every
# healthy layer we measured (MiniLM in fp16 and bf16), accumulation loss and overflow do not.
DIVERGENCE_RATIO = 16.0
BARRIER_TIMEOUT_S = 600.0


class ReferenceFailed(RuntimeError):
    """The model fails in the reference run: nothing to compare against."""


class _Abort(Exception):
    pass


# Errors are measured on an evenly strided sample of at most SAMPLE values per module output:
# the relative L2 error of 65536 values is within ~1% of the full tensor's, far finer than the
# 16x divergence threshold, and it keeps the cost per module independent of activation size.
# Non-finite values are detected exactly, on every element.
SAMPLE = 65536


def _flat(value: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    parts = [
        t.detach().reshape(-1)
        for t in _tensors(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
    ]
    if not parts:
        return None
    flat = parts[0] if len(parts) == 1 else torch.cat([p.to(dtype) for p in parts])
    step = max(1, flat.numel() // SAMPLE)
    return flat[::step].to(dtype)


def _all_finite(value: Any) -> bool:
    """Exact and cheap: a float32-accumulated sum is non-finite iff some element is."""
    return all(
        math.isfinite(float(t.detach().sum(dtype=torch.float32)))
        for t in _tensors(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
    )


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64))  # accumulated in float64


def _rel(a: torch.Tensor, truth: torch.Tensor, truth_norm: float | None = None) -> float:
    """Relative L2 error; inf when a holds NaN/Inf (its difference norm is then not finite).

    Differences are taken in the dtype of the operands: float64 for the reference (whose error
    is ~1e-7), float32 for the candidate (errors >= ~1e-4, far above float32's resolution)."""
    norm = _norm(truth) if truth_norm is None else truth_norm
    diff = _norm(a - truth)
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def _sqnr_db(rel: float) -> float:
    return math.inf if rel == 0 else (-math.inf if math.isinf(rel) else -20.0 * math.log10(rel))


def _round_to(t: torch.Tensor, candidate: str) -> torch.Tensor:
    """The output rounded to the candidate's format: the floor that rounding alone causes."""
    if candidate.startswith("fp8"):
        fp8 = torch.float8_e5m2 if "e5m2" in candidate else torch.float8_e4m3fn
        return fp8_quantize(t, fp8, rowwise=False).to(t.dtype)
    return t.to(compute_dtype(candidate)).to(t.dtype)


@dataclass
class ModuleRow:
    module: str
    call: int
    leaf: bool
    numel: int
    propagated: float
    isolated: float | None
    floor: float
    reference: float
    nonfinite: int
    out_of_range: bool = False

    @property
    def ratio(self) -> float | None:
        if self.isolated is None:
            return None
        return math.inf if math.isinf(self.isolated) else self.isolated / max(self.floor, 1e-300)

    @property
    def diverged(self) -> bool:
        return self.ratio is not None and (math.isinf(self.ratio) or self.ratio > DIVERGENCE_RATIO)

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module or "<root>",
            "call": self.call,
            "leaf": self.leaf,
            "numel": self.numel,
            "propagated_rel": self.propagated,
            "propagated_sqnr_db": _sqnr_db(self.propagated),
            "isolated_rel": self.isolated,
            "isolated_sqnr_db": None if self.isolated is None else _sqnr_db(self.isolated),
            "floor_rel": self.floor,
            "reference_rel": self.reference,
            "ratio": self.ratio,
            "diverged": self.diverged,
            "nonfinite": self.nonfinite,
            "out_of_range": self.out_of_range,
        }


@dataclass
class CompareResult:
    report: Report
    rows: list[ModuleRow] = field(default_factory=list)
    first_divergent: str | None = None
    peak_extra_bytes: int = 0


class _Lockstep:
    """A barrier per module call across the runs; the last to arrive runs the comparison."""

    def __init__(self, runs: list[str], compare: Callable[[tuple[str, int], dict[str, Any]], None]) -> None:
        self.runs = runs
        self.compare = compare
        self.cond = threading.Condition()
        self.pending: dict[str, tuple[tuple[str, int], Any]] = {}
        self.generation = 0
        self.failure: str | None = None
        self.error: BaseException | None = None
        self.done: set[str] = set()

    def arrive(self, run: str, key: tuple[str, int], payload: Any) -> None:
        with self.cond:
            if self.failure:
                raise _Abort
            self.pending[run] = (key, payload)
            if len(self.pending) == len(self.runs):
                keys = {k for k, _ in self.pending.values()}
                if len(keys) != 1:
                    self._abort(
                        f"the runs called different modules ({', '.join(sorted(f'{k[0]}#{k[1]}' for k in keys))}): "
                        "data-dependent control flow cannot be compared module by module"
                    )
                else:
                    try:
                        self.compare(key, {r: p for r, (_, p) in self.pending.items()})
                    except Exception as exc:
                        self.error = exc
                        self._abort(f"comparing {key[0]} failed: {type(exc).__name__}: {exc}")
                self.pending = {}
                self.generation += 1
                self.cond.notify_all()
            else:
                generation = self.generation
                deadline = time.monotonic() + BARRIER_TIMEOUT_S
                while self.generation == generation and not self.failure:
                    if len(self.done) + len(self.pending) == len(self.runs):  # a run finished early
                        self._abort(f"run(s) {', '.join(sorted(self.done))} finished while others were at {key[0]}")
                        break
                    woke = self.cond.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                    if not woke and time.monotonic() > deadline:
                        self._abort(f"timed out waiting at module {key[0]}")
            if self.failure:
                raise _Abort

    def _abort(self, why: str) -> None:
        if self.failure is None:
            self.failure = why
        self.cond.notify_all()

    def abort(self, why: str) -> None:
        with self.cond:  # an RLock: safe from inside arrive() too
            self._abort(why)

    def finished(self, run: str) -> None:
        with self.cond:
            self.done.add(run)
            self.cond.notify_all()


def compare(model: nn.Module, inputs: Any, *, candidate: str = "fp16", reference: str = "fp32") -> CompareResult:
    """Layerwise error of `candidate` against fp64, judged against the fp64 noise floor."""
    candidate = check_name(candidate, CANDIDATES, "candidate")
    reference = check_name(reference, REFERENCES, "reference")
    was_training = model.training
    model.eval()
    runs = {
        "truth": make_run(model, "fp64"),
        "reference": make_run(model, reference),
        "candidate": make_run(model, candidate),
    }
    model.train(was_training)
    dtypes = {"truth": torch.float64, "reference": compute_dtype(reference), "candidate": compute_dtype(candidate)}
    leaves = {name for name, m in runs["truth"].named_modules() if not list(m.children())}
    cand_modules = dict(runs["candidate"].named_modules())
    rows: list[ModuleRow] = []
    fp8_rows: list[dict[str, Any]] = []
    fp8_dtype = (
        (torch.float8_e5m2 if "e5m2" in candidate else torch.float8_e4m3fn) if candidate.startswith("fp8") else None
    )
    linears = {n: m for n, m in runs["truth"].named_modules() if isinstance(m, nn.Linear)}
    local = threading.local()  # set while the isolated re-run of a module is in progress
    peak = {"bytes": 0}

    def judge(key: tuple[str, int], payloads: dict[str, Any]) -> None:
        name, call = key
        truth_out, truth_in = payloads["truth"]
        ref_out, _ = payloads["reference"]
        cand_out, cand_in = payloads["candidate"]
        if isinstance(truth_out, torch.Tensor) and truth_in is not None and any(a is truth_out for a in truth_in[0]):
            return  # an identity in this mode (Dropout in eval, Identity): nothing new to judge
        t, r = _flat(truth_out), _flat(ref_out)
        c = _flat(cand_out, torch.float32)
        if t is None or r is None or c is None or not (t.numel() == r.numel() == c.numel()):
            return
        t32 = t.float()
        peak["bytes"] = max(peak["bytes"], t.numel() * (8 + 8 + 4 + 4))
        norm = _norm(t)
        reference_rel = _rel(r, t, norm)
        rounding = _rel(_round_to(t32, candidate), t32, norm)
        out_of_range = math.isinf(rounding)  # the fp64 values themselves do not fit the format
        floor = max(0.0 if out_of_range else rounding, reference_rel, 1e-300)
        finite = _all_finite(cand_out)
        propagated = _rel(c, t32, norm) if finite else math.inf
        isolated = None
        if name not in leaves and truth_in is not None and cand_in is not None:
            # A container's own ops (attention scores, a residual add) are judged only when the
            # error jumps inside it and no child diverged: then it is re-run on the fp64 inputs.
            t_in, c_in = _flat(truth_in), _flat(cand_in)
            in_rel = _rel(c_in, t_in) if t_in is not None and c_in is not None and t_in.numel() == c_in.numel() else 0.0
            in_rel = in_rel if _all_finite(cand_in) else math.inf
            jumped = (math.isinf(propagated) and not math.isinf(in_rel)) or (
                propagated > DIVERGENCE_RATIO * max(in_rel, floor)
            )
            child_diverged = any(r.diverged for r in _children(rows, name, call))
            if not (jumped and not child_diverged):
                truth_in = None
        if truth_in is not None:
            local.busy = True
            try:
                with torch.no_grad():
                    args, kwargs = truth_in
                    out = cand_modules[name](
                        *cast_inputs(args, dtypes["candidate"]), **cast_inputs(kwargs, dtypes["candidate"])
                    )
            finally:
                local.busy = False
            iso = _flat(out, torch.float32)
            isolated = (
                None
                if iso is None or iso.numel() != t.numel()
                else (_rel(iso, t32, norm) if _all_finite(out) else math.inf)
            )
        nonfinite = (
            0
            if finite
            else sum(
                int((~torch.isfinite(x)).sum())
                for x in _tensors(cand_out)
                if isinstance(x, torch.Tensor) and x.is_floating_point()
            )
        )
        if fp8_dtype is not None and name in linears and truth_in is not None and truth_in[0]:
            fp8_rows.append(fp8.linear_stats(name, truth_in[0][0], linears[name].weight, fp8_dtype))
        rows.append(
            ModuleRow(
                name,
                call,
                name in leaves,
                t.numel(),
                propagated,
                isolated,
                floor,
                reference_rel,
                nonfinite,
                out_of_range,
            )
        )

    lock = _Lockstep(list(runs), judge)
    errors: dict[str, BaseException] = {}

    def worker(run_name: str, run: nn.Module) -> None:
        calls: dict[str, int] = {}
        captured: dict[str, Any] = {}
        handles = []
        for name, module in run.named_modules():

            def pre(mod: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
                # fp64 inputs for isolated re-runs; candidate inputs to see whether error jumps
                keep = run_name == "truth" or (
                    run_name == "candidate" and name not in leaves
                )  # inputs are alive anyway
                if keep and not getattr(local, "busy", False):
                    captured[name] = (args, kwargs)

            def post(mod: nn.Module, args: Any, output: Any, name: str = name) -> None:
                if getattr(local, "busy", False):
                    return
                index = calls.get(name, 0)
                calls[name] = index + 1
                lock.arrive(run_name, (name, index), (output, captured.pop(name, None)))

            handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(module.register_forward_hook(post))
        args, kwargs = _split(cast_inputs(inputs, dtypes[run_name]))
        try:
            with torch.no_grad():
                run(*args, **kwargs)
        except _Abort:
            pass
        except BaseException as exc:
            errors[run_name] = exc
            lock.abort(f"the {run_name} run raised {type(exc).__name__}: {exc}")
        finally:
            lock.finished(run_name)
            for h in handles:
                h.remove()

    threads = [threading.Thread(target=worker, args=(n, m), name=f"fpdoctor-{n}") for n, m in runs.items()]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    # The hooks' closures reference the copies: drop them now rather than at the next cyclic GC.
    runs.clear()
    cand_modules.clear()
    linears.clear()
    if "reference" in errors or "truth" in errors:
        exc = errors.get("reference") or errors["truth"]
        raise ReferenceFailed(f"the model fails in the {reference} reference run: {type(exc).__name__}: {exc}") from exc
    if lock.error is not None:
        raise lock.error
    result = _report(
        rows,
        candidate=candidate,
        reference=reference,
        failure=lock.failure if "candidate" not in errors else None,
        candidate_error=errors.get("candidate"),
        peak=peak["bytes"],
    )
    if fp8_dtype is not None:
        result.report.findings.extend(fp8.findings(fp8_rows))
        result.report.data["fp8"] = fp8_rows
    return result


def _children(rows: list[ModuleRow], name: str, call: int) -> list[ModuleRow]:
    """Rows of `name`'s descendants from this call: they were judged just before it (post-order)."""
    prefix = f"{name}." if name else ""
    found = []
    for row in reversed(rows):
        if not row.module.startswith(prefix) or row.module == name:
            break
        found.append(row)
    return found


def _split(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, tuple):
        return inputs, {}
    return (inputs,), {}


def _report(
    rows: list[ModuleRow],
    *,
    candidate: str,
    reference: str,
    failure: str | None,
    candidate_error: BaseException | None,
    peak: int,
) -> CompareResult:
    findings = []
    first = next((r for r in rows if r.diverged), None)
    if first is not None:
        diverged = [r for r in rows if r.diverged]
        why = (
            f"its fp64 output does not even fit {candidate}'s range"
            if first.out_of_range
            else f"{_fmt_ratio(first.ratio)} the noise floor of {first.floor:.2g}"
        )
        findings.append(
            catalog.make(
                "precision-divergence",
                message=(
                    f"In {candidate}, module `{first.module or '<root>'}` adds an error of "
                    f"{_fmt(first.isolated)} by itself ({why}); {len(diverged)} module(s) diverge in all. "
                    f"The end-to-end error there is {_fmt(first.propagated)} "
                    f"({_sqnr_db(first.propagated):.1f} dB SQNR)."
                ),
                where={"module": first.module, "op": None, "phase": "forward", "iteration": first.call},
                evidence={
                    "kind": "divergence",
                    "candidate": candidate,
                    "reference": reference,
                    "out_of_range": first.out_of_range,
                    "isolated_rel": first.isolated,
                    "floor_rel": first.floor,
                    "ratio": first.ratio,
                    "propagated_rel": first.propagated,
                    "count": len(diverged),
                    "numel": first.numel,
                    "dtype": str(compute_dtype(candidate)),
                    "diverged": [r.module for r in diverged[:10]],
                },
                fix=(
                    f"keep `{first.module}` in fp32 (fpdoctor plan finds the smallest such set), or use bf16 "
                    "if the cause is range, fp32 accumulation if it is a long reduction"
                ),
            )
        )
    notes = {}
    if failure:
        notes["candidate run"] = failure
    if candidate_error is not None:
        notes["candidate run"] = f"the {candidate} run raised {type(candidate_error).__name__}: {candidate_error}"
    final = rows[-1] if rows else None
    summary = [
        ("candidate / reference", f"{candidate} / {reference}, judged against fp64"),
        ("modules compared", str(len(rows))),
        ("first divergent module", f"`{first.module or '<root>'}`" if first else "none"),
        ("end-to-end error", f"{_fmt(final.propagated)} ({_sqnr_db(final.propagated):.1f} dB SQNR)" if final else "-"),
    ]
    report = Report(
        command="compare",
        findings=findings,
        data={
            "summary": summary,
            "modules": [r.as_dict() for r in rows],
            "not_checked": notes,
            "divergence_ratio": DIVERGENCE_RATIO,
            "peak_compare_bytes": peak,
        },
    )
    return CompareResult(report, rows, first.module if first else None, peak)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else ("non-finite" if math.isinf(value) else f"{value:.3g}")


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else ("infinitely above" if math.isinf(ratio) else f"{ratio:.0f}x")
