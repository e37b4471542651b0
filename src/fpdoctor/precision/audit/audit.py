"""`fpdoctor.audit(model, inputs=None)`: mixed dtypes and devices, and dtype errors explained.

Static: every floating parameter and buffer, grouped by dtype and device; the minority is named
by module. Normalisation layers kept in fp32 inside an fp16/bf16 model are a deliberate recipe
and are left alone. Dynamic (with inputs): the forward runs under a dispatch mode that knows
where every tensor came from - a parameter, a buffer, an input, or a state tensor an op made
(and from what) - so a "mat1 and mat2 must have the same dtype" error becomes: this op, in this
module, got this operand from there, and here is the smallest fix.
"""

from __future__ import annotations

import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.formats import DTYPE_FORMAT, FORMATS
from fpdoctor.numerics.trace.mismatch import (
    dtype_hint,
    explain_mismatch,
    failure_from_traceback,
    mismatch_error,
    module_expr,
    operand,
    what_failed,
)
from fpdoctor.numerics.trace.modules import ModuleTracker
from fpdoctor.precision.audit.fixcheck import checked, follow_fixes
from fpdoctor.precision.candidates import cast_inputs, split_inputs, uncompiled
from fpdoctor.precision.fit import describe as describe_misfit
from fpdoctor.precision.fit import misfits
from fpdoctor.precision.inputs import describe
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import Reads, largest
from fpdoctor.preserve import preserved
from fpdoctor.provenance import Provenance
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Report, Severity
from fpdoctor.torchprivate import TorchDispatchMode
from fpdoctor.userframes import user_location


def _is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__


@dataclass
class AuditResult:
    report: Report
    dtypes: dict[str, int]  # dtype -> number of parameter/buffer elements
    devices: dict[str, int]


def _entries(model: nn.Module) -> list[dict[str, Any]]:
    rows = []
    for mname, module in model.named_modules():
        own = [("parameter", n, t) for n, t in module.named_parameters(recurse=False)]
        own += [("buffer", n, t) for n, t in module.named_buffers(recurse=False)]
        for kind, name, t in own:
            if t is None or not (t.is_floating_point() or t.is_complex()):
                continue
            rows.append(
                {
                    "module": mname,
                    "name": f"{mname}.{name}" if mname else name,
                    "kind": kind,
                    "dtype": str(t.dtype),
                    "device": str(t.device),
                    "numel": t.numel(),
                    "norm": _is_norm(module),
                    "class": type(module).__name__,
                }
            )
    return rows


def static_findings(model: nn.Module) -> tuple[list[Finding], Counter[str], Counter[str]]:
    rows = _entries(model)
    dtypes: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    for r in rows:
        dtypes[r["dtype"]] += r["numel"]
        devices[r["device"]] += r["numel"]
    findings: list[Finding] = []
    if len(dtypes) > 1:
        main = dtypes.most_common(1)[0][0]
        half = main in ("torch.float16", "torch.bfloat16")
        odd = [r for r in rows if r["dtype"] != main and not (half and r["norm"] and r["dtype"] == "torch.float32")]
        by_module: dict[str, set[str]] = defaultdict(set)
        for r in odd:
            by_module[r["module"]].add(r["dtype"])
        if odd:
            listing = "; ".join(f"`{m or '<root>'}` ({', '.join(sorted(d))})" for m, d in list(by_module.items())[:8])
            breaking = _would_break(model, main, {r["name"] for r in odd})
            kept = sorted({e["module"] for e in breaking})
            top = sorted(
                {r["module"].split(".")[0] for r in odd if r["module"]}
                - {k.split(".")[0] for k in kept}  # a module holding such a tensor is not cast whole
            )
            harmonize = (
                f"fpdoctor.harmonize(model, device, keep_fp32={kept!r})   # one dtype per device, these in fp32"
                if kept
                else "fpdoctor.harmonize(model, device)   # one dtype per device"
            )
            warning = (
                f" Casting them to {main} would break the model: "
                + "; ".join(describe_misfit(e) for e in breaking[:3])
                + ". Keep "
                + ", ".join(f"`{k}`" for k in kept)
                + " in fp32."
                if breaking
                else ""
            )
            findings.append(
                catalog.make(
                    "mixed-dtype-parameters",
                    message=(
                        f"Most of the model is {main} ({dtypes[main]:,} elements) but {len(odd)} parameter(s) or "
                        f"buffer(s) in {len(by_module)} module(s) are not: {listing}.{warning}"
                    ),
                    where={"module": next(iter(by_module)) or None, "op": None, "phase": None},
                    evidence={
                        "kind": "dtype",
                        "dtype": main,
                        "count": len(odd),
                        "numel": sum(r["numel"] for r in odd),
                        "dtypes": dict(dtypes),
                        "modules": {m: sorted(d) for m, d in by_module.items()},
                    },
                    fix="\n".join([harmonize, *(f"{module_expr(m)}.to({main})" for m in top[:4])]),
                )
            )
    nonfinite = _nonfinite(model)
    if nonfinite:
        findings.append(_nonfinite_finding(nonfinite))
    if len(devices) > 1:
        main_dev = devices.most_common(1)[0][0]
        odd = [r for r in rows if r["device"] != main_dev]
        modules = sorted({r["module"] for r in odd})
        findings.append(
            catalog.make(
                "device-mismatch",
                severity=Severity.WARNING,
                message=(
                    f"Most parameters are on {main_dev}, but {len(odd)} are elsewhere: "
                    + ", ".join(f"{r['name']} ({r['device']})" for r in odd[:6])
                    + "."
                ),
                where={"module": modules[0] or None, "op": None, "phase": None},
                evidence={"kind": "device", "devices": dict(devices), "count": len(odd), "numel": None, "dtype": None},
                fix=f"model.to('{main_dev}')   # after every submodule is attached",
            )
        )
    return findings, dtypes, devices


def _would_break(model: nn.Module, main: str, names: set[str]) -> list[dict[str, Any]]:
    """Of the tensors `names`, those whose values do not fit `main`'s format (fp16, bf16)."""
    fmt = FORMATS.get(DTYPE_FORMAT.get(main, ""))
    if fmt is None or main not in ("torch.float16", "torch.bfloat16"):
        return []
    return [e for e in misfits(model, fmt, skip=(main,)) if e["tensor"] in names]


def _nonfinite(model: nn.Module) -> list[dict[str, Any]]:
    """Parameters and buffers that hold NaN or Inf."""
    tensors = []
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in items:
            if t is None or not t.is_floating_point() or t.numel() == 0 or t.is_meta:
                continue
            # a sparse tensor (an adjacency in COO or CSR): its stored values
            stored = t if t.layout is torch.strided else t._values() if t.is_sparse else t.values()
            tensors.append((kind, name, stored))
    # each tensor's largest magnitude (NaN or Inf when one is there), read together: one kernel per
    # tensor and one wait per device; the counts only for a tensor that holds NaN or Inf
    reads, biggest = Reads(), list[float]()
    for *_, t in tensors:
        reads.later([largest(t.detach())], biggest.append)
    reads.read()
    found = []
    for (kind, name, t), big in zip(tensors, biggest, strict=True):
        if math.isfinite(big):
            continue
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        if nan or inf:
            found.append(
                {"kind": kind, "tensor": name, "dtype": str(t.dtype), "nan": int(nan), "inf": int(inf),
                 "numel": t.numel()}
            )  # fmt: skip
    return found


def _nonfinite_finding(found: list[dict[str, Any]]) -> Finding:
    first = found[0]
    module = first["tensor"].rpartition(".")[0]
    limits = {"torch.float16": " (fp16's max is 65504: a larger value cast to fp16 becomes Inf)"}
    listing = "; ".join(
        f"{e['kind']} {e['tensor']} ({e['dtype']}) holds "
        + " and ".join(f"{n} {what}" for n, what in ((e["nan"], "NaN"), (e["inf"], "Inf")) if n)
        + f" of {e['numel']}"
        for e in found[:4]
    )
    return catalog.make(
        "nonfinite-input",
        message=(
            f"{listing}{limits.get(first['dtype'], '')}: every op that reads it returns NaN/Inf. It came from the "
            "checkpoint, a cast, or an earlier step that diverged."
        ),
        where={"module": module, "op": None, "phase": None},
        evidence={
            "kind": "nan" if first["nan"] else "+inf",
            "count": sum(e["nan"] + e["inf"] for e in found),
            "numel": sum(e["numel"] for e in found),
            "dtype": first["dtype"],
            "tensors": found[:10],
        },
        fix=(
            f"reload {first['tensor']} from an fp32 checkpoint and keep `{module or '<root>'}` in fp32 "
            f"(fpdoctor.harmonize(model, device, keep_fp32=[{module!r}])), or use bf16, which has fp32's range"
        ),
    )


class _Origins(TorchDispatchMode):
    """Records where every op output came from, and explains dtype/device errors.

    The record is this run's own side table (`Provenance`), never an attribute: op outputs
    include the user's tensors (a buffer updated in place, a tensor a module keeps), and a tag
    on them would travel into `torch.save` and mislead a later audit."""

    def __init__(self, tracker: ModuleTracker, inputs: dict[int, str]) -> None:
        super().__init__()
        self.tracker = tracker
        self.inputs = inputs
        self.failure: dict[str, Any] | None = None
        self.origins = Provenance()

    def origin(self, t: torch.Tensor) -> dict[str, Any]:
        tagged: dict[str, Any] | None = self.origins.get(t)  # a view falls back to its base's entry
        if tagged is not None:
            return tagged
        name = self.tracker.param_names.get(t) if t._base is None else self.tracker.param_names.get(t._base)
        if name is not None:
            kind = (
                "parameter"
                if isinstance(t, nn.Parameter) or (t._base is not None and isinstance(t._base, nn.Parameter))
                else "buffer"
            )
            return {"kind": kind, "name": name, "dtype": str(t.dtype)}
        key = self.inputs.get(id(t)) or (self.inputs.get(id(t._base)) if t._base is not None else None)
        if key is not None:
            return {"kind": "input", "name": key, "dtype": str(t.dtype)}
        return {"kind": "tensor", "name": "a tensor created outside the model", "dtype": str(t.dtype)}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:
            text = str(exc)
            what = mismatch_error(text)
            if self.failure is None and what is not None:
                module, call, _ = self.tracker.current
                tensors = tensors_in((args, kwargs))
                if what == "dtype":  # an index tensor's int64 is no side of a dtype mismatch
                    tensors = [t for t in tensors if t.is_floating_point() or t.is_complex()] or tensors
                self.failure = {
                    "error": text.splitlines()[0],
                    "op": str(func),
                    "module": module,
                    "call": call,
                    "operands": [operand(t, self.origin) for t in tensors],
                    "device": what == "device",
                    "location": user_location(sys._getframe(1)),
                }
            raise
        float_inputs = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]
        if not func.is_view:
            module, _, _ = self.tracker.current
            location = user_location(sys._getframe(1))
            sources = [self.origin(t) for t in float_inputs[:3]]
            for t in tensors_in(out):
                if t.is_floating_point():
                    self.origins.set(
                        t,
                        {
                            "kind": "state",
                            "op": str(func),
                            "module": module,
                            "dtype": str(t.dtype),
                            "from": sources,
                            "location": location,
                        },
                    )
        return out


def _name_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any], dict[int, str]]:
    # copies: the forward may write into its inputs, and the user's tensors stay as they were
    args, kwargs = split_inputs(cast_inputs(inputs, None, copy=True))
    names = {id(v): f"inputs[{k!r}]" for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    names.update({id(v): f"inputs[{i}]" for i, v in enumerate(args) if isinstance(v, torch.Tensor)})
    return args, kwargs, names


def _forward(model: nn.Module, inputs: Any) -> tuple[dict[str, Any] | None, BaseException | None, ModuleTracker]:
    """Run the forward under the origin-tracking mode: (the dtype/device failure explained, the
    error it raised, the tracker), the model's buffers and the RNG left as they were."""
    args, kwargs, names = _name_inputs(inputs)
    tracker = ModuleTracker([model])
    mode = _Origins(tracker, names)
    error: BaseException | None = None
    with torch.no_grad(), tracker, preserved(model):  # its dropout draws and running statistics stay here
        try:
            with mode:
                model(*args, **kwargs)
        except Exception as exc:  # the model's own error is the subject here
            error = exc
    failure = mode.failure
    if failure is None and error is not None:  # raised in Python or above the dispatcher
        failure = failure_from_traceback(error, name_of=tracker.name_of, origin=mode.origin, location=user_location)
    return failure, error, tracker


def explain_failure(model: nn.Module, inputs: Any) -> Finding | None:
    """audit's explanation of a forward that raises a dtype or device mismatch (which op, the
    operands, the line where the odd dtype entered, the cast that fixes it), for another command
    whose run of the model failed; None where the forward raises nothing of the kind."""
    failure, _, _ = _forward(model, inputs)
    if failure is None:
        return None
    dtypes = Counter(str(t.dtype) for t in [*model.parameters(), *model.buffers()] if t.is_floating_point())
    return explain_mismatch(failure, dtypes.most_common(1)[0][0] if dtypes else None, model)


def audit(model: nn.Module, inputs: Any = None) -> AuditResult:
    """Audit dtypes and devices; with `inputs`, run the forward and explain a dtype/device error
    (any other error the forward raises is a finding too: an error is never OK)."""
    model = uncompiled(model)  # names as the model's own; its forward runs eagerly under the dispatch mode
    findings, dtypes, devices = static_findings(model)
    summary = [
        ("parameter/buffer dtypes", ", ".join(f"{d} ({n:,})" for d, n in dtypes.most_common()) or "-"),
        ("devices", ", ".join(f"{d} ({n:,})" for d, n in devices.most_common()) or "-"),
    ]
    not_checked: dict[str, str] = {}
    if inputs is None:
        not_checked["forward"] = "no inputs given: only parameters and buffers were audited"
    else:
        summary.append(("inputs", inputs_text(describe(inputs))))
        failure, error, tracker = _forward(model, inputs)
        if failure is not None:
            main = dtypes.most_common(1)[0][0] if dtypes else None
            finding = explain_mismatch(failure, main, model)
            findings.append(checked(finding, follow_fixes(model, inputs, failure, main, forward=_forward)))
            summary.append(("forward", f"failed at {what_failed(failure)}"))
        elif error is not None:
            findings.append(forward_failed(error, tracker))
            summary.append(("forward", f"raised {type(error).__name__}, not a dtype or device mismatch"))
        else:
            summary.append(("forward", "ran without a dtype or device error"))
    report = Report(
        command="audit",
        findings=findings,
        data={"summary": summary, "not_checked": not_checked, "dtypes": dict(dtypes), "devices": dict(devices)},
    )
    return AuditResult(report, dict(dtypes), dict(devices))


def forward_failed(error: BaseException, tracker: ModuleTracker) -> Finding:
    """The forward-failed finding: the error as raised, the innermost module and the user's line."""
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    owner = next((f.f_locals["self"] for f in reversed(frames) if isinstance(f.f_locals.get("self"), nn.Module)), None)
    module = tracker.name_of(owner) if owner is not None else None
    location = user_location(frames[-1]) if frames else None
    text = str(error).splitlines()[0] if str(error) else ""
    hint = dtype_hint(str(error))
    at = f" at {location[0]}:{location[1]}" if location else ""
    return catalog.make(
        "forward-failed",
        message=(
            f"The forward raised {type(error).__name__}: {text[:300]}"
            + (f" (in module `{module}`{at})." if module is not None else f"{at}.")
        ),
        where={"module": module, "op": None, "phase": "forward"},
        evidence={
            "kind": "error",
            "error": type(error).__name__,
            "text": text[:1000],
            "location": f"{location[0]}:{location[1]}" if location else None,
            "count": 1,
            "numel": None,
            "dtype": None,
        },
        fix=hint or f"fix the error{at or ' the traceback ends in'}; check the inputs' shapes and dtypes",
    )


def as_given(model: nn.Module, inputs: Any) -> tuple[list[Finding], str | None]:
    """The model as the user gave it, before compare or plan convert it: when its parameters mix
    dtypes, whether it runs at all (audit's findings, and a line for the summary); nothing when
    its dtypes are uniform (one forward saved)."""
    findings, _, _ = static_findings(model)
    if not any(f.name == "mixed-dtype-parameters" for f in findings):
        return [], None
    report = audit(model, inputs).report
    errors = [f for f in report.findings if f.severity is Severity.ERROR]
    if errors:
        where = errors[0].where.get("module")
        at = f" at `{where}`" if where else ""
        return report.sorted_findings(), (
            f"does not run: {errors[0].name}{at} (audit's finding below); what follows is for the model "
            "converted to one precision"
        )
    return report.sorted_findings(), "runs, with mixed parameter dtypes (audit's finding below)"
