"""Dtype and device errors explained: which op, in which module, got which operand from where.

PyTorch words a dtype mismatch in many ways - `mat1 and mat2 must have the same dtype`, a loss
function's `Found dtype Float but expected Half`, an RNN's `input dtype ... does not match weight
dtype`, a convolution's `Input type ... and bias type ... should be the same`, scaled dot-product
attention's `Expected query, key, and value to have the same dtype`, index and scatter ops,
`expected scalar type Float but found Half` - and raises some of them in Python or in composite
ops above the dispatcher, where no dispatch mode sees the operands. Those are read from the
traceback instead: the call that raised, its argument names resolved in the frame that made it
(`F.scaled_dot_product_attention(q, k, v)` -> q, k and v), else the tensors that frame holds
and, in a module's own method, that module's parameters.
"""

from __future__ import annotations

import ast
import linecache
import re
from collections import Counter
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.report.model import Finding

_DTYPE_ERROR = re.compile(
    r"must have the same (?:scalar )?(?:dtype|type)|expected scalar type \w+ but found \w+"
    r"|type \(.+?\) and (?:weight|bias) type \(.+?\) should be the same"
    r"|expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype|dtype mismatch|found dtype \w+ but expected \w+"
    r"|mixed dtype|expect(?:ed)? parameter to have scalar type|does not match (?:\w+ )?dtype"
    r"|to have the same dtype|to have same dtypes?|source and destination dtypes match"
    r"|expected self\.dtype to be equal to src\.dtype|expected dtype \w+ for `\w+` but got dtype"
    r"|to have the same type as tensor|type promoting not supported",
    re.IGNORECASE,
)
_DEVICE_ERROR = re.compile(
    r"Expected all tensors to be on the same device|on different devices|device mismatch|to be on the same device"
    r"|is not on the expected device",
    re.IGNORECASE,
)
# dtype errors that are not a mismatch between operands: a hint for the forward-failed finding
_DTYPE_HINTS = (
    (
        re.compile(
            r"not implemented for '(\w+)'|low precision dtypes not supported\. got (\w+)|unsupported dtype (\w+)", re.I
        ),
        "this op has no kernel for {0} on this device: run it in fp32 (or bf16) here, or on a device that has one",
    ),
    (
        re.compile(r"expected target dtype to be (\w+)|to have one of the following scalar types: ([\w, ]+)", re.I),
        "an index or class-label tensor must be an integer dtype (Long): do not cast it with the model's dtype",
    ),
)


def mismatch_error(text: str) -> str | None:
    """'dtype' or 'device' when an op's error message is a dtype or device mismatch, else None."""
    if _DEVICE_ERROR.search(text):
        return "device"
    return "dtype" if _DTYPE_ERROR.search(text) else None


def dtype_hint(text: str) -> str | None:
    """What to do about a dtype error that is not a mismatch (a kernel missing for Half, a Float target)."""
    for pattern, hint in _DTYPE_HINTS:
        match = pattern.search(text)
        if match:
            return hint.format(*(g for g in match.groups() if g))
    return None


def module_expr(path: str) -> str:
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
        if _is_cast(origin):
            return f"a tensor cast to {origin['dtype']} by .to()/.float() ({origin['op']}){where}"
        return f"a tensor made by {origin['op']}{where}"
    return str(origin.get("name", "?"))


def _is_cast(origin: dict[str, Any]) -> bool:
    return str(origin.get("op", "")).startswith(("aten._to_copy", "aten.to.", "aten._to_dtype"))


def _entry(origin: dict[str, Any]) -> str:
    """Where an operand's dtype entered: the origin, and for op-made tensors the line."""
    text = _describe(origin)
    location = origin.get("location")
    if origin.get("kind") == "state":
        text += f" ({location[0]}:{location[1]})" if location else ""
        if not origin.get("from") and not _is_cast(origin):
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


def explain_mismatch(failure: dict[str, Any], main_dtype: str | None = None, model: nn.Module | None = None) -> Finding:
    """The dtype-mismatch / device-mismatch finding for an op that raised, as `audit` explains it.

    `failure`: error (first line), op, module, call, device (bool), location, and operands, each an
    origin (kind parameter|buffer|input|state|tensor, name, op, module, from, location) with its
    dtype, device and shape. Without `model` the fix casts the parameter's own module rather than
    its widest ancestor that is all one dtype (`fpdoctor trace` knows no model object)."""
    return _mismatch_finding(failure, main_dtype, model)


def what_failed(failure: dict[str, Any]) -> str:
    """`aten.addmm.default in module `head`` (the root is `<root>`)."""
    op = failure.get("op") or failure.get("callee") or "an op"
    module = failure.get("module")
    return f"{op} in module `{module or '<root>'}`" if module is not None else f"{op} outside any module"


def _culprit(
    failure: dict[str, Any], main_dtype: str | None
) -> tuple[str, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(the dtype expected, the operands that differ, the first of them, where its dtype entered)."""
    operands = failure["operands"]
    dtypes = Counter(o["dtype"] for o in operands)
    expected: str = main_dtype if main_dtype is not None and main_dtype in dtypes else dtypes.most_common(1)[0][0]
    odd = [o for o in operands if o["dtype"] != expected] or operands[-1:]
    culprit = odd[0]
    root = _root(culprit, culprit["dtype"]) if culprit.get("kind") == "state" else culprit
    return expected, odd, culprit, root


def _module_to_cast(root: dict[str, Any], model: nn.Module | None) -> str:
    module_path: str = root["name"].rsplit(".", 1)[0] if "." in root["name"] else ""
    return widest_module(model, module_path, root["dtype"]) if model is not None else module_path


def fix_action(failure: dict[str, Any], main_dtype: str | None, model: nn.Module) -> dict[str, str] | None:
    """What the dtype-mismatch fix does, as data audit can apply to check it: cast a module
    (`{"module": path, "dtype": ...}`) or an input (`{"input": name, "dtype": ...}`); None for a
    tensor the forward makes itself (only its source line can change)."""
    if failure["device"]:
        return None
    expected, _, _, root = _culprit(failure, main_dtype)
    if root.get("kind") in ("parameter", "buffer"):
        return {"module": _module_to_cast(root, model), "dtype": expected}
    if root.get("kind") == "input":
        return {"input": root["name"], "dtype": expected}
    return None


def _mismatch_finding(failure: dict[str, Any], main_dtype: str | None, model: nn.Module | None) -> Finding:
    operands = failure["operands"]
    if failure["device"]:
        devices = Counter(o["device"] for o in operands)
        odd = [o for o in operands if devices[o["device"]] == min(devices.values())] or operands
        return catalog.make(
            "device-mismatch",
            message=(
                f"{what_failed(failure)} failed ({failure['error']}). Operands: "
                + "; ".join(f"{_describe(o)} on {o['device']}" for o in operands[:4])
                + "."
            ),
            where={"module": failure["module"], "op": failure["op"], "phase": "forward"},
            evidence={"kind": "device", "operands": operands, "count": len(odd), "numel": None, "dtype": None},
            fix=f"move {_describe(odd[0])} to {operands[0]['device']}, or model.to(device) after building it",
        )
    expected, odd, culprit, root = _culprit(failure, main_dtype)
    torch_dtype = expected
    if root.get("kind") in ("parameter", "buffer"):
        module_path = _module_to_cast(root, model)
        fix = (
            f"{module_expr(module_path)}.to({torch_dtype})   # all of it is {root['dtype']}, like {root['name']}"
            if module_path
            else f"model.to({torch_dtype})"
        )
    elif root.get("kind") == "input":
        fix = f"cast the input: {root['name']}.to({torch_dtype})"
    elif root.get("kind") == "state":
        where = root.get("location")
        at = f" at {where[0]}:{where[1]}" if where else ""
        if _is_cast(root):
            # the dtype of the weights it meets, never a fixed one: a line that casts to torch.float32
            # runs the fp32 model and breaks it again in bf16, fp16 or fp64
            like = "next(self.parameters()).dtype" if where and len(where) > 2 and where[2] == "forward" else "w.dtype"
            fix = (
                f"cast that tensor to the dtype of the weights it meets, not a fixed {root['dtype']}{at}: "
                f"`.to({like})`"
                + (", w the weight it meets" if like == "w.dtype" else "")
                + f" ({torch_dtype} here; a fixed dtype breaks the model again in any other precision)"
            )
        else:
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
            f"{what_failed(failure)} got "
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


Origin = Callable[[torch.Tensor], dict[str, Any]]


def _call_arguments(frame: FrameType, lasti: int) -> tuple[str, list[Any]] | None:
    """(the callee as written, the values of its arguments) for the call that raised in `frame`
    (at instruction `lasti`): names and attribute chains (`self.weight`) resolved in the frame;
    None where the instruction is not a call that reads as one (Python < 3.11 has no column
    positions)."""
    positions = getattr(frame.f_code, "co_positions", None)
    if positions is None or lasti < 0:
        return None
    try:
        line, end_line, col, end_col = list(positions())[lasti // 2]
    except (IndexError, ValueError):
        return None
    if None in (line, end_line, col, end_col):
        return None
    lines = [linecache.getline(frame.f_code.co_filename, n) for n in range(line, end_line + 1)]
    if not all(lines):
        return None
    raw = [text.encode() for text in lines]  # column offsets count UTF-8 bytes
    raw[-1] = raw[-1][:end_col]
    raw[0] = raw[0][col:]
    try:
        node = ast.parse(b"\n".join(raw).decode().strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call):
        return None
    values = []
    for arg in [*node.args, *(k.value for k in node.keywords)]:
        value = _resolve(arg, frame)
        if value is not None:
            values.append(value)
    return ast.unparse(node.func), values


def _resolve(node: ast.expr, frame: FrameType) -> Any:
    if isinstance(node, ast.Name):
        return frame.f_locals.get(node.id, frame.f_globals.get(node.id))
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, frame)
        return getattr(owner, node.attr, None) if owner is not None else None
    return None


def _tensors(values: Any) -> list[torch.Tensor]:
    from fpdoctor.pytrees import tensors_in

    return [t for t in tensors_in(values) if t.is_floating_point() or t.is_complex()]


def failure_from_traceback(
    exc: BaseException, *, name_of: Callable[[nn.Module], str], origin: Origin, location: Callable[..., Any]
) -> dict[str, Any] | None:
    """A failure (as `explain_mismatch` takes it) for a dtype or device error raised where no
    dispatch mode saw the operands: in Python (an RNN's input check) or a composite op (a
    convolution's bias check, scaled dot-product attention). None when the text is not one."""
    text = str(exc)
    what = mismatch_error(text)
    if what is None:
        return None
    entries: list[tuple[FrameType, int]] = []
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        entries.append((tb.tb_frame, tb.tb_lasti))
        tb = tb.tb_next
    if not entries:
        return None
    frame, lasti = entries[-1]
    module_frame = next((f for f, _ in reversed(entries) if isinstance(f.f_locals.get("self"), nn.Module)), None)
    owner = module_frame.f_locals["self"] if module_frame is not None else None
    call = _call_arguments(frame, lasti)
    operands = _tensors(call[1]) if call else []
    if not operands:
        operands = _tensors([v for k, v in frame.f_locals.items() if k != "self"])
    if owner is not None and len({(t.dtype, t.device) for t in operands}) < 2:
        # the other side is the module's own (an RNN's weights): its parameters, in order, once each
        own = [p for p in owner.parameters(recurse=False) if p.is_floating_point()]
        operands += [p for p in own if all(p is not t for t in operands)][:2]
    if not operands:
        return None
    return {
        "error": text.splitlines()[0] if text else type(exc).__name__,
        "op": None,  # no aten op saw the operands: the callee as written says what raised
        "callee": call[0] if call else f"{frame.f_code.co_name}()",
        "module": name_of(owner) if owner is not None else None,
        "call": None,
        "operands": [operand(t, origin) for t in operands[:6]],
        "device": what == "device",
        "location": location(frame),
    }


def operand(t: torch.Tensor, origin: Origin) -> dict[str, Any]:
    """One operand for the report: its origin, dtype, device and shape. A parameter or buffer
    used through a view (Linear's weight as `t(weight)`) is shown with its own shape, the
    shape it was used in beside it."""
    found = origin(t)
    entry = {**found, "dtype": str(t.dtype), "device": str(t.device), "shape": list(t.shape)}
    base = t._base
    if found.get("kind") in ("parameter", "buffer") and base is not None and list(base.shape) != list(t.shape):
        entry["shape"], entry["shape_used"] = list(base.shape), list(t.shape)
    return entry
