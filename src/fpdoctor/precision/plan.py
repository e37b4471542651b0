"""`fpdoctor.plan(model, inputs, candidate=...)`: the smallest keep-in-fp32 set, verified.

1. compare() ranks modules by isolated error against the noise floor.
2. Greedy: keep the divergent modules in fp32 (worst first), adding the next worst leaves until
   the candidate's final output is finite and within tolerance of the fp64 output.
3. Bisection: drop kept modules again, halves first, while the result stays within tolerance.
4. Verify: run the candidate with the final set, report its end-to-end error.
The plan is data (`Plan`) that `apply_plan(model, plan)` applies in place, plus pasteable code.
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.boundary import keep_in_fp32
from fpdoctor.precision.candidates import (
    cast_inputs,
    check_name,
    compute_dtype,
    make_run,
    model_device,
    run_flags,
    split_inputs,
    uncompiled,
)
from fpdoctor.precision.compare import compare
from fpdoctor.precision.metrics import flat_sample, rel_error
from fpdoctor.precision.names import PLAN_CANDIDATES
from fpdoctor.precision.noise import ReplayNoise
from fpdoctor.precision.profile import DIVERGENCE_RATIO
from fpdoctor.preserve import RngState
from fpdoctor.report.model import Report

# real dtypes (fp16-accumulate's fix is fp16 with the kept modules in fp32); fp8 belongs to the user's recipe
_APPLICABLE = ("fp16", "bf16", "fp16-accumulate")


@dataclass
class Plan:
    candidate: str
    keep_fp32: list[str]
    fp32_outputs: list[str]  # kept modules whose outputs stay fp32: their range does not fit the candidate
    verified: bool
    final_error: float  # relative L2 error of the final output against fp64, with the plan applied
    tolerance: float
    baseline_error: float  # the same without any exception

    def to_code(self) -> str:
        names = ", ".join(repr(n) for n in self.keep_fp32)
        if self.candidate.startswith("fp8"):
            return (
                f"# {self.candidate} ran in fpdoctor's own fp8 Linear layers; keep these modules in high\n"
                f"# precision in your fp8 recipe, e.g. torchao's module_filter_fn:\nKEEP_HIGH_PRECISION = {{{names}}}\n"
                "def module_filter_fn(module, fqn):\n    return fqn not in KEEP_HIGH_PRECISION\n"
            )
        dtype = "torch.bfloat16" if self.candidate == "bf16" else "torch.float16"
        lines = ["import torch", "from fpdoctor.precision.boundary import keep_in_fp32", "", f"model.to({dtype})"]
        if self.candidate == "fp16-accumulate":
            lines[3:3] = [
                "# cuBLAS: no fp16 reductions in fp16 GEMMs; the modules kept below accumulate in fp32 with any kernel",
                "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False",
            ]
        for name in self.keep_fp32:
            if name in self.fp32_outputs:
                lines.append(
                    f"keep_in_fp32(model.get_submodule({name!r}), back_to=None)  # its outputs need fp32's range"
                )
            else:
                lines.append(f"keep_in_fp32(model.get_submodule({name!r}), back_to={dtype})")
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "keep_fp32": self.keep_fp32,
            "fp32_outputs": self.fp32_outputs,
            "verified": self.verified,
            "final_error": self.final_error,
            "tolerance": self.tolerance,
            "baseline_error": self.baseline_error,
            "code": self.to_code(),
        }


@dataclass
class PlanResult:
    plan: Plan
    report: Report
    tried: list[tuple[list[str], float]] = field(default_factory=list)


def _candidate_with(
    model: nn.Module, candidate: str, keep: list[str], fp32_outputs: set[str], fp8_kernel: str = "auto"
) -> nn.Module:
    run = make_run(model, candidate, fp8_kernel)
    dtype = compute_dtype(candidate)
    modules = dict(model.named_modules())
    for name in keep:
        fp32_module = copy.deepcopy(modules[name]).float()  # the original module, not a simulated one
        parent, _, child = name.rpartition(".")
        holder = run.get_submodule(parent) if parent else run
        setattr(holder, child, keep_in_fp32(fp32_module, back_to=None if name in fp32_outputs else dtype))
    return run


def _replaying(noise: list[torch.Tensor] | None) -> contextlib.AbstractContextManager[Any]:
    """The random draws compare recorded, replayed from the first (see noise.py); nothing without."""
    return ReplayNoise(noise) if noise is not None else contextlib.nullcontext()


def _final_error(
    model: nn.Module,
    inputs: Any,
    candidate: str,
    keep: list[str],
    *,
    fp32_outputs: set[str],
    truth: torch.Tensor,
    fp8_kernel: str = "auto",
    noise: list[torch.Tensor] | None = None,
) -> float:
    run = _candidate_with(model, candidate, keep, fp32_outputs, fp8_kernel).eval()
    args, kwargs = split_inputs(cast_inputs(inputs, compute_dtype(candidate), copy=True))
    try:
        with torch.no_grad(), _replaying(noise):
            out = flat_sample(run(*args, **kwargs))
    except RuntimeError:  # an fp32 output reached a module still in the candidate dtype
        return math.inf
    return math.inf if out is None or out.numel() != truth.numel() else rel_error(out, truth)


def plan(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str = "fp16",
    reference: str = "fp32",
    tolerance: float | None = None,
    fp8_kernel: str = "auto",
) -> PlanResult:
    """Find and verify the smallest set of modules to keep in fp32 for `candidate`.

    `fp8_kernel`: how fp8 candidates multiply, as in compare()."""
    candidate = check_name(candidate, PLAN_CANDIDATES, "candidate")
    model = uncompiled(model)  # module names as compare reports them
    rng = RngState.capture()  # every run starts from it, as compare's passes do; the user's is left as it was
    try:
        return _plan(
            model, inputs, candidate=candidate, reference=reference, tolerance=tolerance, fp8_kernel=fp8_kernel, rng=rng
        )
    finally:
        rng.restore()


def _plan(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str,
    reference: str,
    tolerance: float | None,
    fp8_kernel: str,
    rng: RngState,
) -> PlanResult:
    result = compare(model, inputs, candidate=candidate, reference=reference, fp8_kernel=fp8_kernel)
    truth_run = make_run(model, "fp64").eval()
    args, kwargs = split_inputs(cast_inputs(inputs, torch.float64, copy=True))
    flags = run_flags(candidate, model_device(model))  # module by module, as compare ran them
    rng.restore()
    with torch.no_grad(), flags, _replaying(result.noise):
        truth = flat_sample(truth_run(*args, **kwargs))
    if truth is None:
        raise ValueError("the model's output has no floating tensor to judge")
    # Modules whose fp64 output does not fit the candidate's range keep fp32 outputs when kept.
    fp32_outputs = {r.module for r in result.rows if r.out_of_range and r.module}
    if tolerance is None:
        # The output's noise floor: rounding it to the candidate, or the reference's end-to-end error.
        final_floor = next((r.floor for r in reversed(result.rows) if r.module == ""), result.rows[-1].floor)
        if reference != "fp64":
            rng.restore()
            with run_flags(reference, model_device(model)):
                reference_error = _final_error(
                    model, inputs, reference, [], fp32_outputs=set(), truth=truth, noise=result.noise
                )
            final_floor = max(final_floor, reference_error if math.isfinite(reference_error) else 0.0)
        tolerance = DIVERGENCE_RATIO * final_floor
    tried: list[tuple[list[str], float]] = []

    def error(keep: list[str]) -> float:
        rng.restore()
        with run_flags(candidate, model_device(model)):  # the backend flags compare ran the candidate under
            value = _final_error(
                model,
                inputs,
                candidate,
                keep,
                fp32_outputs=fp32_outputs,
                truth=truth,
                fp8_kernel=fp8_kernel,
                noise=result.noise,
            )
        tried.append((list(keep), value))
        return value

    def ok(value: float) -> bool:
        return math.isfinite(value) and value <= tolerance

    baseline = error([])
    ranked = sorted(
        (r for r in result.rows if r.ratio is not None and r.module and not r.inherited),
        key=lambda r: -(r.ratio if r.ratio is not None else 0.0),
    )
    keep: list[str] = []
    current = baseline
    if not ok(current):
        for row in ranked:  # greedy: worst first, divergent ones and then the next worst leaves
            if row.module in keep or any(row.module.startswith(k + ".") for k in keep):
                continue
            keep.append(row.module)
            current = error(keep)
            if ok(current):
                break
    if ok(current) and len(keep) > 1:  # bisection: drop what is not needed, halves first
        chunk = len(keep) // 2
        while chunk >= 1:
            i = 0
            while i < len(keep):
                trial = keep[:i] + keep[i + chunk :]
                value = error(trial)
                if ok(value):
                    keep, current = trial, value
                else:
                    i += chunk
            chunk //= 2
    verified_error = error(keep)
    the_plan = Plan(
        candidate, keep, [k for k in keep if k in fp32_outputs], ok(verified_error), verified_error, tolerance, baseline
    )
    return PlanResult(the_plan, _report(the_plan, result.report), tried)


def apply_plan(model: nn.Module, the_plan: Plan) -> nn.Module:
    """Put `model` in the plan's dtype, with its modules kept in fp32 behind boundary casts (in place)."""
    if the_plan.candidate not in _APPLICABLE:
        raise ValueError(
            f"{the_plan.candidate} ran in fpdoctor's own fp8 layers; apply the plan in your fp8 recipe "
            "instead (Plan.to_code() shows a module filter)"
        )
    dtype = compute_dtype(the_plan.candidate)
    inner = uncompiled(model)  # the plan names modules inside a torch.compile wrapper
    inner.to(dtype)
    for name in the_plan.keep_fp32:
        keep_in_fp32(inner.get_submodule(name), back_to=None if name in the_plan.fp32_outputs else dtype)
    return model


def _report(the_plan: Plan, compared: Report) -> Report:
    findings = list(compared.findings)
    if not the_plan.verified:
        findings.append(
            catalog.make(
                "precision-divergence",
                title="No keep-in-fp32 set brought the candidate within tolerance",
                message=(
                    f"Even with {len(the_plan.keep_fp32)} module(s) in fp32 the end-to-end error is "
                    f"{the_plan.final_error:.3g} (tolerance {the_plan.tolerance:.3g})."
                ),
                where={"module": None, "op": None, "phase": "forward"},
                evidence={"kind": "divergence", "count": len(the_plan.keep_fp32), "numel": None, "dtype": None},
            )
        )
    summary = [
        ("candidate", the_plan.candidate),
        ("without exceptions", f"end-to-end error {the_plan.baseline_error:.3g}"),
        ("keep in fp32", ", ".join(f"`{n}`" for n in the_plan.keep_fp32) or "nothing"),
        (
            "verified",
            f"{'yes' if the_plan.verified else 'NO'}: end-to-end error {the_plan.final_error:.3g} "
            f"(tolerance {the_plan.tolerance:.3g})",
        ),
    ]
    return Report(
        command="plan",
        findings=findings,
        data={
            "summary": summary,
            "plan": the_plan.as_dict(),
            "table": compared.data.get("table"),  # compare's profile: why these modules
            "modules": compared.data.get("modules", []),
        },
    )
