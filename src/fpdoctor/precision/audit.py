"""`fpdoctor.audit(model, inputs=None)`: mixed dtypes and devices, and dtype errors explained.

Static: every floating parameter and buffer, grouped by dtype and device; the minority is named
by module. Normalisation layers kept in fp32 inside an fp16/bf16 model are a deliberate recipe
and are left alone. Dynamic (with inputs): the forward runs under a dispatch mode that knows
where every tensor came from - a parameter, a buffer, an input, or a state tensor an op made
(and from what) - so a "mat1 and mat2 must have the same dtype" error becomes: this op, in this
module, got this operand from there, and here is the smallest fix.
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fpdoctor import catalog
from fpdoctor.numerics.modules import ModuleTracker
from fpdoctor.numerics.trace import user_location
from fpdoctor.precision.candidates import cast_inputs, split_inputs, uncompiled
from fpdoctor.preserve import preserved
from fpdoctor.provenance import Provenance
from fpdoctor.pytrees import tensors_in
from fpdoctor.report.model import Finding, Report, Severity

_DTYPE_ERROR = re.compile(
    r"must have the same dtype|expected scalar type \w+ but found \w+|Input type \(\S+\) and (?:weight|bias) type"
    r"|expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype|dtype mismatch|found dtype \w+ but expected \w+"
    r"|should be the same|mixed dtype|expect(?:ed)? parameter to have scalar type"
)
_DEVICE_ERROR = re.compile(r"Expected all tensors to be on the same device|on different devices|device mismatch")


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
            top = sorted({r["module"].split(".")[0] for r in odd if r["module"]})
            findings.append(
                catalog.make(
                    "mixed-dtype-parameters",
                    message=(
                        f"Most of the model is {main} ({dtypes[main]:,} elements) but {len(odd)} parameter(s) or "
                        f"buffer(s) in {len(by_module)} module(s) are not: {listing}."
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
                    fix=(
                        "fpdoctor.harmonize(model, device)   # one dtype per device\n"
                        + "\n".join(f"{_module_expr(m)}.to({main})" for m in top[:4])
                    ),
                )
            )
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
            if self.failure is None and (_DTYPE_ERROR.search(text) or _DEVICE_ERROR.search(text)):
                module, call, _ = self.tracker.current
                operands = [
                    {**self.origin(t), "dtype": str(t.dtype), "device": str(t.device), "shape": list(t.shape)}
                    for t in tensors_in((args, kwargs))
                ]
                self.failure = {
                    "error": text.splitlines()[0],
                    "op": str(func),
                    "module": module,
                    "call": call,
                    "operands": operands,
                    "device": bool(_DEVICE_ERROR.search(text)),
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


def _module_expr(path: str) -> str:
    """Python that names the submodule: `model.time_embed`, or `model.get_submodule("time_embed.2")`
    where a part is an index (`model.time_embed.2` is a syntax error)."""
    if all(part.isidentifier() for part in path.split(".")):
        return f"model.{path}"
    return f"model.get_submodule({path!r})"


def _describe(origin: dict[str, Any]) -> str:
    kind = origin.get("kind")
    if kind in ("parameter", "buffer", "input"):
        return f"{kind} {origin['name']}"
    if kind == "state":
        where = f" in module `{origin['module']}`" if origin.get("module") else ""
        return f"a tensor made by {origin['op']}{where}"
    return str(origin.get("name", "?"))


def _entry(origin: dict[str, Any]) -> str:
    """Where an operand's dtype entered: the origin, and for op-made tensors the line."""
    text = _describe(origin)
    location = origin.get("location")
    if origin.get("kind") == "state":
        text += f" ({location[0]}:{location[1]})" if location else ""
        if not origin.get("from"):
            text += ", from a new tensor (factories make float32 unless told otherwise)"
    return text


def _root(origin: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The first origin upstream that already had `dtype`: where the odd dtype entered."""
    for source in origin.get("from") or []:
        if source.get("dtype") == dtype:
            return _root(source, dtype)
    return origin


def widest_module(model: nn.Module, path: str, dtype: str) -> str:
    """The outermost ancestor of `path` whose floating parameters are all `dtype`: cast that whole."""
    parts = path.split(".") if path else []
    modules = dict(model.named_modules())
    for depth in range(1, len(parts) + 1):
        candidate = ".".join(parts[:depth])
        tensors = [
            t for t in [*modules[candidate].parameters(), *modules[candidate].buffers()] if t.is_floating_point()
        ]
        if tensors and all(str(t.dtype) == dtype for t in tensors):
            return candidate
    return path


def mismatch_error(text: str) -> str | None:
    """'dtype' or 'device' when an op's error message is a dtype or device mismatch, else None."""
    if _DEVICE_ERROR.search(text):
        return "device"
    return "dtype" if _DTYPE_ERROR.search(text) else None


def explain_mismatch(failure: dict[str, Any], main_dtype: str | None = None, model: nn.Module | None = None) -> Finding:
    """The dtype-mismatch / device-mismatch finding for an op that raised, as `audit` explains it.

    `failure`: error (first line), op, module, call, device (bool), location, and operands, each an
    origin (kind parameter|buffer|input|state|tensor, name, op, module, from, location) with its
    dtype, device and shape. Without `model` the fix casts the parameter's own module rather than
    its widest ancestor that is all one dtype (`fpdoctor trace` knows no model object)."""
    return _mismatch_finding(failure, main_dtype, model)


def _mismatch_finding(failure: dict[str, Any], main_dtype: str | None, model: nn.Module | None) -> Finding:
    operands = failure["operands"]
    if failure["device"]:
        devices = Counter(o["device"] for o in operands)
        odd = [o for o in operands if devices[o["device"]] == min(devices.values())] or operands
        return catalog.make(
            "device-mismatch",
            message=(
                f"{failure['op']} in module `{failure['module']}` failed ({failure['error']}). Operands: "
                + "; ".join(f"{_describe(o)} on {o['device']}" for o in operands[:4])
                + "."
            ),
            where={"module": failure["module"], "op": failure["op"], "phase": "forward"},
            evidence={"kind": "device", "operands": operands, "count": len(odd), "numel": None, "dtype": None},
            fix=f"move {_describe(odd[0])} to {operands[0]['device']}, or model.to(device) after building it",
        )
    dtypes = Counter(o["dtype"] for o in operands)
    expected: str = main_dtype if main_dtype is not None and main_dtype in dtypes else dtypes.most_common(1)[0][0]
    odd = [o for o in operands if o["dtype"] != expected] or operands[-1:]
    culprit = odd[0]
    root = _root(culprit, culprit["dtype"]) if culprit.get("kind") == "state" else culprit
    torch_dtype = expected
    if root.get("kind") in ("parameter", "buffer"):
        module_path = root["name"].rsplit(".", 1)[0] if "." in root["name"] else ""
        module_path = widest_module(model, module_path, root["dtype"]) if model is not None else module_path
        fix = (
            f"{_module_expr(module_path)}.to({torch_dtype})   # all of it is {root['dtype']}, like {root['name']}"
            if module_path
            else f"model.to({torch_dtype})"
        )
    elif root.get("kind") == "input":
        fix = f"cast the input: {root['name']}.to({torch_dtype})"
    elif root.get("kind") == "state":
        where = root.get("location")
        at = f" at {where[0]}:{where[1]}" if where else ""
        fix = (
            f"create that tensor in the model's dtype{at}: `.to({torch_dtype})`, or pass dtype= to the factory "
            f"({root['op']} in module `{root.get('module')}` makes {root['dtype']})"
        )
    else:
        fix = f"cast it to {torch_dtype} before the call"
    fix += "\n# or: fpdoctor.harmonize(model, device)"
    location = failure.get("location")
    entered = _entry(root)
    return catalog.make(
        "dtype-mismatch",
        message=(
            f"{failure['op']} in module `{failure['module']}` got "
            + " and ".join(f"{o['dtype']} ({_describe(o)})" for o in operands[:3])
            + f" ({failure['error']}). The {culprit['dtype']} operand's dtype entered at {entered}."
            + (f" Source: {location[0]}:{location[1]}." if location else "")
        ),
        where={"module": failure["module"], "op": failure["op"], "phase": "forward", "iteration": failure["call"]},
        evidence={
            "kind": "dtype",
            "dtype": culprit["dtype"],
            "expected": expected,
            "count": len(odd),
            "numel": None,
            "operands": [{k: v for k, v in o.items() if k != "from"} | {"origin": _describe(o)} for o in operands],
            "entered_at": entered,
        },
        fix=fix,
    )


def _name_inputs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any], dict[int, str]]:
    # copies: the forward may write into its inputs, and the user's tensors stay as they were
    args, kwargs = split_inputs(cast_inputs(inputs, None, copy=True))
    names = {id(v): f"inputs[{k!r}]" for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    names.update({id(v): f"inputs[{i}]" for i, v in enumerate(args) if isinstance(v, torch.Tensor)})
    return args, kwargs, names


def audit(model: nn.Module, inputs: Any = None) -> AuditResult:
    """Audit dtypes and devices; with `inputs`, run the forward and explain a dtype/device error."""
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
        if mode.failure is not None:
            main = dtypes.most_common(1)[0][0] if dtypes else None
            findings.append(_mismatch_finding(mode.failure, main, model))
            summary.append(("forward", f"failed at {mode.failure['op']} in `{mode.failure['module']}`"))
        elif error is not None:
            not_checked["forward"] = f"the forward raised {type(error).__name__}: {str(error).splitlines()[0][:300]}"
            summary.append(("forward", "raised an error that is not a dtype or device mismatch"))
        else:
            summary.append(("forward", "ran without a dtype or device error"))
    report = Report(
        command="audit",
        findings=findings,
        data={"summary": summary, "not_checked": not_checked, "dtypes": dict(dtypes), "devices": dict(devices)},
    )
    return AuditResult(report, dict(dtypes), dict(devices))


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
