"""`fpdoctor.compare(model, inputs, reference="fp32", candidate="fp16")`: layerwise A/B against fp64.

Two passes over copies of the model. The fp64 pass (the truth) keeps an evenly strided sample of
every module's output and re-runs the candidate's and the reference's copy of each leaf module on
the same fp64 inputs; the candidate pass then reduces its outputs to error numbers against those
samples as it goes. Memory is one forward at a time plus SAMPLE values per module call - never
all activations.

Per module:
  propagated  the candidate run's output against the fp64 output (errors accumulated so far)
  isolated    the candidate's module fed the fp64 run's inputs, against the fp64 output (leaf
              modules; ROWS evenly spread rows of those whose rows are independent): what this
              module adds by itself
  floor       the error that rounding the fp64 output to the candidate's format causes, or the
              reference's own error (its module fed the same fp64 inputs) if that is larger
A module diverges when its isolated error is non-finite or more than DIVERGENCE_RATIO times the
floor: rounding of inputs and outputs stays within a few floors, while accumulation loss,
overflow and cancellation land orders of magnitude above it. Relative L2 error, SQNR and cosine
similarity are reported for both. A container's own ops (attention scores, a residual add) are
re-run in one more fp64 pass, only where the candidate's error jumps inside it.

With `device=`, the candidate runs on another device (device A vs device B): `candidate="fp32",
device="cuda"` judges the GPU's fp32 kernels (TF32, another summation order) against the same
floor, so only what goes beyond the reference's own rounding is called a divergence.
"""

from __future__ import annotations

import math
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
    FP8_KERNELS,
    REFERENCES,
    Fp8Linear,
    Fp16AccumulateLinear,
    cast_inputs,
    check_device,
    check_name,
    compute_dtype,
    fp8_quantize,
    make_run,
    model_device,
    run_flags,
    split_inputs,
)
from fpdoctor.report.model import Report

# 16x the floor is 12 dB: input and output rounding plus fp32 accumulation stay below it on every
# healthy layer we measured (MiniLM in fp16 and bf16), accumulation loss and overflow do not.
DIVERGENCE_RATIO = 16.0


class ReferenceFailed(RuntimeError):
    """The model fails in the reference run: nothing to compare against."""


# Errors are measured on an evenly strided sample of at most SAMPLE values per module output:
# the relative L2 error of 8192 values is within a few percent of the full tensor's, far finer
# than the 16x divergence threshold, and the cost and memory per module stay independent of the
# activation size. Non-finite values are detected exactly, on every element.
SAMPLE = 8192

# The isolated re-run of a leaf whose rows are computed independently of each other (Linear, norms,
# activations) computes ROWS of them, evenly spread, instead of all: at 1024 rows that is 1/16 of
# the GEMM work, and 64 rows of a layer give a relative error as steady as the whole output's.
# A non-finite value in a row left out is still caught: the candidate pass sees every element,
# and such a leaf is re-run in full.
ROWS = 64
# Exact types: a subclass may override forward with something that mixes rows (it is re-run in full).
_ROW_LOCAL = {
    nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, Fp8Linear, Fp16AccumulateLinear,
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Hardtanh, nn.Softplus, nn.Dropout, nn.Identity,
}  # fmt: skip
_NORMS = {t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None}


def _row_width(module: nn.Module) -> int | None:
    """How many trailing dims make one independent row of `module`; None when rows interact."""
    if type(module) in _ROW_LOCAL:
        return 1
    if type(module) in _NORMS:
        shape: tuple[int, ...] = module.normalized_shape  # type: ignore[assignment]
        return len(shape)
    return None


def _row_subset(
    module: nn.Module, args: Any, kwargs: Any, output: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]] | None:
    """(ROWS input rows, the fp64 output's same rows, keyword arguments for the re-run) for a
    row-local leaf called on one tensor."""
    width = _row_width(module)
    if width is None or kwargs or len(args) != 1 or not isinstance(output, torch.Tensor):
        return None
    (x,) = args
    if not isinstance(x, torch.Tensor) or x.dim() <= width or x.shape[:-width] != output.shape[:-width]:
        return None
    n = math.prod(x.shape[:-width])
    if n <= ROWS:
        return None
    index = torch.linspace(0, n - 1, ROWS, dtype=torch.float64).round().long().to(x.device)
    # a tensorwise fp8 scale comes from all rows, so the re-run gets the whole input's amax
    extra = {"input_amax": x.abs().amax()} if isinstance(module, Fp8Linear) and not module.rowwise else {}
    return x.reshape(n, *x.shape[-width:])[index], output.reshape(n, *output.shape[-width:])[index], extra


def _flat(value: Any, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    parts = [
        t.detach().reshape(-1)
        for t in _tensors(value)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0
    ]
    if not parts:
        return None
    step = max(1, sum(p.numel() for p in parts) // SAMPLE)
    # Each part is sampled before it is converted (never a full-size copy), and the result is always
    # a copy: a strided view would keep the whole activation alive for the entire run.
    if len(parts) == 1:
        return parts[0][::step].to(device="cpu", dtype=dtype, copy=True)
    return torch.cat([p[::step].to(device="cpu", dtype=dtype) for p in parts])


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

    Operands are float64 samples, so an fp32 candidate's ~1e-7 errors are resolved too."""
    norm = _norm(truth) if truth_norm is None else truth_norm
    diff = _norm(a - truth)
    if not math.isfinite(diff):
        return math.inf
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def _cosine(a: torch.Tensor, truth: torch.Tensor, truth_norm: float) -> float | None:
    """Cosine similarity in float64; None when a is non-finite or either side is all zeros."""
    a64 = a.double()
    a_norm = _norm(a64)
    if not math.isfinite(a_norm) or a_norm == 0 or truth_norm == 0:
        return None
    return float(torch.dot(a64, truth)) / (a_norm * truth_norm)


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
    reference: float | None
    nonfinite: int
    out_of_range: bool = False
    cosine: float | None = None  # of the propagated output, against fp64
    isolated_cosine: float | None = None
    isolated_rows: int | None = None  # rows of the output the isolated error was measured on; None: all

    @property
    def ratio(self) -> float | None:
        if self.isolated is None:
            return None
        return math.inf if math.isinf(self.isolated) else self.isolated / max(self.floor, 1e-300)

    inherited: bool = False  # a container above the floor only because a module inside it diverges

    @property
    def exceeds(self) -> bool:
        return self.ratio is not None and (math.isinf(self.ratio) or self.ratio > DIVERGENCE_RATIO)

    @property
    def diverged(self) -> bool:
        return self.exceeds and not self.inherited

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module or "<root>",
            "call": self.call,
            "leaf": self.leaf,
            "numel": self.numel,
            "propagated_rel": self.propagated,
            "propagated_sqnr_db": _sqnr_db(self.propagated),
            "propagated_cosine": self.cosine,
            "isolated_rel": self.isolated,
            "isolated_sqnr_db": None if self.isolated is None else _sqnr_db(self.isolated),
            "isolated_cosine": self.isolated_cosine,
            "isolated_rows": self.isolated_rows,
            "floor_rel": self.floor,
            "reference_rel": self.reference,
            "ratio": self.ratio,
            "diverged": self.diverged,
            "inherited": self.inherited,
            "nonfinite": self.nonfinite,
            "out_of_range": self.out_of_range,
        }


@dataclass
class CompareResult:
    report: Report
    rows: list[ModuleRow] = field(default_factory=list)
    first_divergent: str | None = None
    peak_extra_bytes: int = 0  # the fp64 samples kept (one forward's working set and the weight copies aside)


@dataclass
class _Seen:
    """What the fp64 pass keeps of one module call: samples and a few numbers, never the tensors."""

    truth: torch.Tensor  # float64 sample of the output
    norm: float
    rounding: float  # relative error of rounding the sample to the candidate's format
    leaf: bool
    numel: int
    isolated: float | None = None
    isolated_cosine: float | None = None
    cosine: float | None = None
    inputs: torch.Tensor | None = None  # float64 sample of the inputs, for the jump test of containers
    isolated_rows: int | None = None  # rows the isolated re-run computed, None for all
    reference: float | None = None  # the reference's isolated error; None: not measured
    propagated: float | None = None
    candidate_inputs: float = 0.0  # the candidate's input error at this module
    nonfinite: int = 0


def _hooked(
    run: nn.Module,
    inputs: Any,
    dtype: torch.dtype,
    *,
    pre: Callable[..., None] | None,
    post: Callable[..., None],
    device: torch.device | None = None,
) -> None:
    """Run `run` on `inputs` (cast to `dtype`) with hooks that get (name, call index, ...)."""
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
    args, kwargs = split_inputs(cast_inputs(inputs, dtype, device))
    try:
        with torch.no_grad():
            run(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()


def compare(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str = "fp16",
    reference: str = "fp32",
    device: str | None = None,
    fp8_kernel: str = "auto",
) -> CompareResult:
    """Layerwise error of `candidate` against fp64, judged against the fp64 noise floor.

    Two passes at full speed with every core: fp64 (keeping a strided sample of every module
    output, with the candidate's and the reference's leaf modules re-run on the same fp64
    inputs) and the candidate (reduced to error numbers against those samples at once).
    Memory: one forward at a time plus SAMPLE values per module call - never all activations.

    `device` runs the candidate on another device (device A vs device B): e.g. the model on CPU,
    `candidate="fp32", device="cuda"` shows which modules a GPU's kernels (TF32, reduced-precision
    reductions, another summation order) change beyond the reference's own error.

    `fp8_kernel` (fp8 candidates): "scaled_mm" multiplies with the real fp8 GEMM where it runs,
    "fake" dequantizes before an fp32 matmul, "auto" (default) is scaled_mm on GPUs with fp8
    tensor cores; the report says which ran, and why a layer fell back."""
    candidate = check_name(candidate, CANDIDATES, "candidate")
    reference = check_name(reference, REFERENCES, "reference")
    check_name(fp8_kernel, FP8_KERNELS, "fp8 kernel")
    cand_device = check_device(device) if device is not None else None
    on = cand_device or model_device(model)  # where the candidate runs: its kernels and flags are chosen for it
    with run_flags(candidate, on) as flags:
        result = _compare(
            model,
            inputs,
            candidate=candidate,
            reference=reference,
            cand_device=cand_device,
            on=on,
            fp8_kernel=fp8_kernel,
        )
    if flags:
        allowed = flags["allow_fp16_reduced_precision_reduction"]
        result.report.data["flags"] = flags
        result.report.data["summary"].append(
            (
                "fp16 GEMM reductions (CUDA)",
                f"{'fp16 allowed' if allowed else 'fp32'} (allow_fp16_reduced_precision_reduction={allowed}; "
                f"yours is {flags['yours']})",
            )
        )
    return result


def _compare(
    model: nn.Module,
    inputs: Any,
    *,
    candidate: str,
    reference: str,
    cand_device: torch.device | None,
    on: torch.device,
    fp8_kernel: str,
) -> CompareResult:
    was_training = model.training
    model.eval()
    try:
        truth_run = make_run(model, "fp64")
        cand_run = make_run(model, candidate, fp8_kernel, on)
        ref_run = make_run(model, reference) if reference != "fp64" else None
        if cand_device is not None:
            cand_run = cand_run.to(cand_device)
    finally:
        model.train(was_training)
    cand_dtype = compute_dtype(candidate)
    label = candidate if cand_device is None else f"{candidate} on {cand_device}"
    leaves = {name for name, m in truth_run.named_modules() if not list(m.children())}
    cand_modules = dict(cand_run.named_modules())
    # the user's own weights (not the fp64 copies): the fp8 statistics convert them to float32 anyway
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    fp8_dtype = (
        (torch.float8_e5m2 if "e5m2" in candidate else torch.float8_e4m3fn) if candidate.startswith("fp8") else None
    )
    seen: dict[tuple[str, int], _Seen] = {}
    fp8_rows: list[dict[str, Any]] = []

    ref_modules = dict(ref_run.named_modules()) if ref_run is not None else {}
    ref_dtype = compute_dtype(reference)
    notes: dict[str, str] = {}
    # On another device the kernels are picked by shape, so a few rows would not run the same ones.
    subsets = cand_device is None or cand_device.type == "cpu"

    def isolated(name: str, args: Any, kwargs: Any, entry: _Seen, output: Any = None) -> None:
        """Re-run the candidate's and the reference's `name` on the fp64 inputs (all rows, or ROWS)."""
        rows = _row_subset(cand_modules[name], args, kwargs, output) if subsets and output is not None else None
        if rows is not None:
            x, truth, extra = rows[0], rows[1].reshape(-1), rows[2]
            norm = _norm(truth)
            entry.isolated_rows = ROWS
        else:
            x, truth, norm, extra = None, entry.truth, entry.norm, {}
            entry.isolated_rows = None
        try:
            entry.isolated, entry.isolated_cosine = _rerun(
                cand_modules[name],
                x,
                args,
                kwargs | extra,
                dtype=cand_dtype,
                device=cand_device,
                truth=truth,
                norm=norm,
            )
        except Exception as exc:  # e.g. an op without a kernel for the candidate's dtype here
            notes.setdefault("isolated re-run", f"`{name}` raised {type(exc).__name__} in {label}: {exc}")
            entry.isolated = entry.isolated_cosine = None
        if name in ref_modules:
            try:
                entry.reference = _rerun(
                    ref_modules[name], x, args, kwargs, dtype=ref_dtype, device=None, truth=truth, norm=norm
                )[0]
            except Exception as exc:
                raise ReferenceFailed(
                    f"the model fails in the {reference} reference run, at `{name}`: {type(exc).__name__}: {exc}"
                ) from exc

    pending_inputs: dict[tuple[str, int], tuple[Any, Any]] = {}

    def truth_pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        pending_inputs[(name, index)] = (args, kwargs)

    def truth_post(name: str, index: int, args: Any, output: Any) -> None:
        key = (name, index)
        call_args, call_kwargs = pending_inputs.pop(key, (args, {}))
        if isinstance(output, torch.Tensor) and any(a is output for a in call_args):
            return  # an identity in this mode (Dropout in eval, Identity): nothing new to judge
        t = _flat(output)
        if t is None:
            return
        entry = _Seen(
            t,
            _norm(t),
            0.0,
            name in leaves,
            sum(x.numel() for x in _tensors(output) if isinstance(x, torch.Tensor)),
        )
        entry.rounding = _rel(_round_to(t, candidate), t, entry.norm)
        if entry.leaf:
            isolated(name, call_args, call_kwargs, entry, output)
            if fp8_dtype is not None and name in linears and call_args:
                fp8_rows.append(fp8.linear_stats(name, call_args[0], linears[name].weight, fp8_dtype))
        else:
            entry.inputs = _flat((call_args, call_kwargs))
        seen[key] = entry

    try:
        _hooked(truth_run, inputs, torch.float64, pre=truth_pre, post=truth_post)
    except ReferenceFailed:
        raise
    except Exception as exc:
        raise ReferenceFailed(
            f"the model fails in the reference run (its fp64 copy): {type(exc).__name__}: {exc}"
        ) from exc

    cand_inputs: dict[tuple[str, int], Any] = {}

    def cand_pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
        if name not in leaves:
            cand_inputs[(name, index)] = (args, kwargs)

    def cand_post(name: str, index: int, args: Any, output: Any) -> None:
        key = (name, index)
        entry = seen.get(key)
        call = cand_inputs.pop(key, None)
        c = _flat(output) if entry is not None else None
        if entry is None or c is None or c.numel() != entry.truth.numel():
            return
        finite = _all_finite(output)
        entry.propagated = _rel(c, entry.truth, entry.norm) if finite else math.inf
        entry.cosine = _cosine(c, entry.truth, entry.norm) if finite else None
        if not finite:
            entry.nonfinite = sum(
                int((~torch.isfinite(x)).sum())
                for x in _tensors(output)
                if isinstance(x, torch.Tensor) and x.is_floating_point()
            )
            if entry.leaf:  # for the jump test: did the non-finite values come in, or start here?
                entry.candidate_inputs = 0.0 if _all_finite(args) else math.inf
        if call is not None and entry.inputs is not None:
            c_in = _flat(call)
            if c_in is not None and c_in.numel() == entry.inputs.numel():
                entry.candidate_inputs = _rel(c_in, entry.inputs) if _all_finite(call) else math.inf

    try:
        _hooked(cand_run, inputs, cand_dtype, pre=cand_pre, post=cand_post, device=cand_device)
    except Exception as exc:  # the candidate failing is a finding, not a usage error
        notes["candidate run"] = f"the {label} run raised {type(exc).__name__}: {exc}"

    rows = _rows(seen)
    # A container's own ops (attention scores, a residual add) are judged when the error jumps
    # inside it and no child diverged: one more fp64 pass re-runs just those in the candidate.
    # So is a leaf that turned finite inputs non-finite when its isolated re-run saw only some rows.
    suspects = {
        (r.module, r.call)
        for r in rows
        if _jumped(r, seen[(r.module, r.call)])
        and (
            not any(c.diverged for c in _children(rows, r.module, r.call))
            if not r.leaf
            else seen[(r.module, r.call)].isolated_rows is not None and math.isinf(r.propagated) and not r.diverged
        )
    }
    if suspects:

        def suspect_pre(name: str, index: int, mod: nn.Module, args: Any, kwargs: Any) -> None:
            if (name, index) in suspects:
                isolated(name, args, kwargs, seen[(name, index)])

        _hooked(truth_run, inputs, torch.float64, pre=suspect_pre, post=lambda *a: None)
        rows = _rows(seen)
        for row in rows:  # post-order: a container comes after everything inside it
            if not row.leaf and row.exceeds:
                row.inherited = any(c.exceeds for c in _children(rows, row.module, row.call))
    result = _report(
        rows,
        candidate=candidate,
        device=cand_device,
        reference=reference,
        notes=notes,
        # the samples stay until the end, so their total is the peak of what compare itself keeps
        peak=sum(e.truth.nbytes + (0 if e.inputs is None else e.inputs.nbytes) for e in seen.values()),
    )
    if fp8_dtype is not None:
        result.report.findings.extend(fp8.findings(fp8_rows))
        result.report.data["fp8"] = fp8_rows
        kernels = _fp8_kernels(cand_run)
        result.report.data["fp8_kernel"] = kernels
        result.report.data["summary"].append(("fp8 GEMM", kernels["text"]))
    return result


def _fp8_kernels(run: nn.Module) -> dict[str, Any]:
    """Which fp8 GEMM the candidate's Linear layers ran: the real kernel or the simulation, and why."""
    layers = [m for m in run.modules() if isinstance(m, Fp8Linear)]
    real = sum(1 for m in layers if m.kernel == "scaled_mm" and m.fallback is None)
    reasons = sorted({m.fallback for m in layers if m.fallback})
    if real == len(layers):
        text = f"torch._scaled_mm (the real fp8 kernel) in all {real} Linear layer(s)"
    elif not reasons:
        text = f"simulated (fake-quant: quantized, dequantized, fp32 GEMM) in all {len(layers)} Linear layer(s)"
    else:
        text = (
            f"torch._scaled_mm in {real} of {len(layers)} Linear layer(s), simulated (fake-quant) in the rest; "
            f"the kernel did not run: {reasons[0]}"
        )
    return {"layers": len(layers), "scaled_mm": real, "fake": len(layers) - real, "fallback": reasons, "text": text}


def _rerun(
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
        sample = _flat(out)
    if sample is None or sample.numel() != truth.numel():
        return None, None
    if not _all_finite(out):
        return math.inf, None
    return _rel(sample, truth, norm), _cosine(sample, truth, norm)


def _jumped(row: ModuleRow, entry: _Seen) -> bool:
    if row.propagated is None:
        return False
    if math.isinf(row.propagated):
        return not math.isinf(entry.candidate_inputs)
    return row.propagated > DIVERGENCE_RATIO * max(entry.candidate_inputs, row.floor)


def _rows(seen: dict[tuple[str, int], _Seen]) -> list[ModuleRow]:
    rows = []
    for (name, call), e in seen.items():  # insertion order: the fp64 pass's post-order
        if e.propagated is None:
            continue  # the candidate never produced this output
        out_of_range = math.isinf(e.rounding)
        floor = max(0.0 if out_of_range else e.rounding, e.reference or 0.0, 1e-300)
        rows.append(
            ModuleRow(
                name,
                call,
                e.leaf,
                e.numel,
                e.propagated,
                e.isolated,
                floor,
                e.reference,
                e.nonfinite,
                out_of_range,
                e.cosine,
                e.isolated_cosine,
                e.isolated_rows,
            )
        )
    return rows


def _children(rows: list[ModuleRow], name: str, call: int) -> list[ModuleRow]:
    """Rows of `name`'s descendants from this call: in post-order they come right before it."""
    position = next((k for k, r in enumerate(rows) if r.module == name and r.call == call), len(rows))
    prefix = f"{name}." if name else ""
    found = []
    for row in reversed(rows[:position]):
        if not row.module.startswith(prefix) or row.module == name:
            break
        found.append(row)
    return found


def _report(
    rows: list[ModuleRow],
    *,
    candidate: str,
    device: torch.device | None,
    reference: str,
    notes: dict[str, str],
    peak: int,
) -> CompareResult:
    label = candidate if device is None else f"{candidate} on {device}"
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
                    f"In {label}, module `{first.module or '<root>'}` adds an error of "
                    f"{_fmt(first.isolated)} by itself ({why}); {len(diverged)} module(s) diverge in all. "
                    f"The end-to-end error there is {_fmt(first.propagated)} "
                    f"({_sqnr_db(first.propagated):.1f} dB SQNR)."
                ),
                where={"module": first.module, "op": None, "phase": "forward", "iteration": first.call},
                evidence={
                    "kind": "divergence",
                    "candidate": candidate,
                    "device": None if device is None else str(device),
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
                fix=_fix(first.module, candidate),
            )
        )
    final = rows[-1] if rows else None
    summary = [
        ("candidate / reference", f"{label} / {reference}, judged against fp64"),
        ("modules compared", str(len(rows))),
        ("first divergent module", f"`{first.module or '<root>'}`" if first else "none"),
        ("end-to-end error", _fmt_error(final.propagated, final.cosine) if final else "-"),
    ]
    ranked = sorted(
        (r for r in rows if r.ratio is not None and not r.inherited), key=lambda r: r.ratio or 0.0, reverse=True
    )
    if ranked:
        worst = ", ".join(
            f"`{r.module or '<root>'}` " + ("non-finite" if math.isinf(r.ratio or 0.0) else f"{r.ratio:.2g}x")
            for r in ranked[:3]
        )
        summary.append(("largest isolated error / floor", worst))
    report = Report(
        command="compare",
        findings=findings,
        data={
            "summary": summary,
            "modules": [r.as_dict() for r in rows],
            "not_checked": notes,
            "table": _table(rows),
            "divergence_ratio": DIVERGENCE_RATIO,
            "peak_compare_bytes": peak,
        },
    )
    return CompareResult(report, rows, first.module if first else None, peak)


TABLE_ROWS = 24  # text, markdown and html show at most this many modules; JSON has them all


def _table(rows: list[ModuleRow]) -> dict[str, Any]:
    """The per-module error profile, in model order; for large models the rows that matter most."""
    shown = rows
    title = "Per module, in model order: SQNR against fp64 in dB (higher is better)"
    if len(rows) > TABLE_ROWS:
        worst = sorted(range(len(rows)), key=lambda k: -(rows[k].ratio or 0.0))[: TABLE_ROWS - 1]
        shown = [rows[k] for k in sorted({*worst, len(rows) - 1})]  # and the output, last in post-order
        title += f"; the {len(shown)} of {len(rows)} with the largest isolated error / floor (JSON has all)"

    def db(value: float | None) -> str:
        return "-" if value is None else "non-finite" if math.isinf(value) else f"{_sqnr_db(value):.1f}"

    def ratio(r: ModuleRow) -> str:
        if r.ratio is None:
            return "-"
        verdict = " diverges" if r.diverged else " (from inside)" if r.inherited else ""
        return ("non-finite" if math.isinf(r.ratio) else f"{r.ratio:.2g}x") + verdict

    return {
        "title": title,
        "columns": ["module", "propagated", "isolated", "floor", "isolated/floor", "NaN/Inf"],
        "rows": [
            [
                (r.module or "<root>") + (f" #{r.call}" if r.call else ""),
                db(r.propagated),
                db(r.isolated),
                db(r.floor),
                ratio(r),
                str(r.nonfinite) if r.nonfinite else "",
            ]
            for r in shown
        ],
    }


def _fix(module: str, candidate: str) -> str:
    if candidate == "fp32":
        return (
            f"the device's fp32 kernels differ at `{module}`: turn off TF32 "
            "(torch.backends.cuda.matmul.allow_tf32 = False, torch.backends.cudnn.allow_tf32 = False, "
            "torch.set_float32_matmul_precision('highest')); `fpdoctor env` shows the flags in effect"
        )
    if candidate == "fp16-accumulate":
        return (
            f"accumulate `{module}` in fp32: on CUDA, torch.backends.cuda.matmul."
            "allow_fp16_reduced_precision_reduction = False (compare --candidate fp16 shows the result); "
            "for a custom fp16-accumulating kernel, keep this module in fp32 (fpdoctor plan)"
        )
    return (
        f"keep `{module}` in fp32 (fpdoctor plan finds the smallest such set), or use bf16 "
        "if the cause is range, fp32 accumulation if it is a long reduction"
    )


def _fmt_error(rel: float, cosine: float | None) -> str:
    if math.isinf(rel):
        return "non-finite"
    # Near 1 the digits that matter are in the distance from 1.
    cos = "" if cosine is None else f", cosine {cosine:.4f}" if cosine < 0.999 else f", cosine 1 - {1 - cosine:.1e}"
    return f"{_fmt(rel)} ({_sqnr_db(rel):.1f} dB SQNR{cos})"


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else ("non-finite" if math.isinf(value) else f"{value:.3g}")


def _fmt_ratio(ratio: float | None) -> str:
    return "n/a" if ratio is None else ("infinitely above" if math.isinf(ratio) else f"{ratio:.0f}x")
