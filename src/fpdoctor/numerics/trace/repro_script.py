"""One aten op, standalone: fpdoctor copies this file as DIR/repro.py beside DIR/repro.json.

It needs torch only (and safetensors when the inputs were saved in that format); it imports
nothing of fpdoctor, so it can be sent to whoever maintains the op. `python repro.py` calls the
recorded overload (torch.ops.aten.<op>.<overload>) with the recorded inputs and arguments on the
recorded device and exits 1 when the op makes the recorded non-finite values again, 0 when it
does not, 2 when it cannot run here (no such device, an op this torch lacks, arguments that were
not recorded). A crash reproducer reproduces by dying of the signal; returning is exit 0.
The last line printed is `RESULT {json}`, what the caller reads.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = ("nan", "+inf", "-inf")


def _saved(spec: dict[str, Any]) -> dict[int, torch.Tensor]:
    """The inputs whose values were kept, by position; they were written contiguous."""
    fmt = spec.get("format")
    found: dict[int, torch.Tensor] = {}
    if fmt == "safetensors":
        from safetensors.torch import load_file

        loaded = load_file(os.path.join(HERE, "inputs.safetensors"))
        return {int(name.removeprefix("input")): t for name, t in loaded.items()}
    if fmt == "raw":
        if sys.byteorder != "little":
            raise RuntimeError("the inputs are little-endian bytes; this machine is big-endian")
        for i, meta in enumerate(spec["tensors"]):
            if not meta.get("saved"):
                continue
            with open(os.path.join(HERE, f"input{i}.bin"), "rb") as fh:
                data = bytearray(fh.read())
            dtype = getattr(torch, meta["dtype"])
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            found[i] = flat.reshape(meta["shape"])
    return found


def _seeded(meta: dict[str, Any], seed: int) -> torch.Tensor:
    """Random values in the recorded range (the standard normal where no range was recorded)."""
    dtype = getattr(torch, meta["dtype"])
    shape = meta["shape"]
    g = torch.Generator().manual_seed(seed)
    lo, hi = meta.get("min"), meta.get("max")
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) < 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if not dtype.is_floating_point:
        low = int(lo) if lo is not None else 0
        high = int(hi) if hi is not None else 9
        return torch.randint(low, high + 1, shape, generator=g, dtype=torch.int64).to(dtype)
    if lo is None or hi is None:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return (lo + (hi - lo) * torch.rand(shape, generator=g, dtype=torch.float64)).to(dtype)


def _placed(values: torch.Tensor, meta: dict[str, Any], device: str) -> torch.Tensor:
    """On the recorded device with the recorded strides (contiguous where they cannot hold values)."""
    stride = meta.get("stride")
    if stride is not None and 0 not in stride:
        try:
            out = torch.empty_strided(meta["shape"], stride, dtype=values.dtype, device=device)
            out.copy_(values)
            return out
        except RuntimeError:
            pass  # overlapping strides: one element cannot hold two values
    return values.to(device)


def _decode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "$tensor" in value:
        return tensors[value["$tensor"]]
    if "$float" in value:
        return float(value["$float"])
    if "$dtype" in value:
        return getattr(torch, value["$dtype"])
    if "$device" in value:
        return torch.device(value["$device"])
    if "$layout" in value:
        return getattr(torch, value["$layout"])
    if "$memory_format" in value:
        return getattr(torch, value["$memory_format"])
    raise ValueError(f"unknown argument {value!r}")


def _from_schema(op: Any, tensors: list[torch.Tensor]) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for an op of which only the tensors were recorded (a crash): the tensors in
    schema order, every other argument at its default."""
    args: list[Any] = []
    left = list(tensors)
    for arg in op._schema.arguments:
        if arg.kwarg_only:
            if not arg.has_default_value():
                raise ValueError(f"{arg.name} was not recorded and has no default")
            continue
        kind = str(arg.type)
        if kind in ("Tensor", "Tensor?") and left:
            args.append(left.pop(0))
        elif arg.has_default_value():
            break
        elif kind == "Tensor?":
            args.append(None)
        else:
            raise ValueError(f"argument {arg.name} ({kind}) was not recorded and has no default")
    return args, {}


def _counts(out: Any) -> list[dict[str, int]]:
    found = []
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if not isinstance(t, torch.Tensor) or not (t.dtype.is_floating_point or t.dtype.is_complex):
            continue
        host = t.detach().cpu()
        real = torch.view_as_real(host) if host.dtype.is_complex else host
        found.append({
            "nan": int(torch.isnan(real).sum()),
            "+inf": int((real == float("inf")).sum()),
            "-inf": int((real == float("-inf")).sum()),
        })  # fmt: skip
    return found


def _call(spec: dict[str, Any], op: Any, saved: dict[int, torch.Tensor], *, seeded: bool) -> Any:
    device = spec["device"]
    tensors = []
    for i, meta in enumerate(spec["tensors"]):
        values = saved.get(i) if not seeded else None
        if values is None:
            values = _seeded(meta, spec["seed"] + i)
        tensors.append(_placed(values, meta, device))
    if spec.get("args") is None:
        args, kwargs = _from_schema(op, tensors)
    else:
        args = _decode(spec["args"], tensors)
        kwargs = {k: _decode(v, tensors) for k, v in (spec.get("kwargs") or {}).items()}
    shapes = ", ".join(f"{t.dtype}{list(t.shape)}" for t in tensors)
    print(f"calling {spec['op']}({shapes}) on {device}", flush=True)
    out = op(*args, **kwargs)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out


def _same(found: list[dict[str, int]], expected: list[dict[str, int]], exact: bool) -> bool:
    """The same non-finite values: the same counts with the recorded values, the same kinds with
    seeded ones (how many depends on the values)."""
    if exact:
        return found == expected
    return [{k for k in KINDS if c.get(k)} for c in found] == [{k for k in KINDS if c.get(k)} for c in expected]


def main() -> int:
    with open(os.path.join(HERE, "repro.json"), encoding="utf-8") as fh:
        spec = json.load(fh)
    result: dict[str, Any] = {"op": spec["op"], "reproduced": False}
    try:
        namespace, name, overload = spec["op"].split(".")
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
        if spec["device"].startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"the op ran on {spec['device']}; this machine has no CUDA device")
        saved = _saved(spec)
    except Exception as exc:
        return _finish(result, 2, f"cannot run here: {type(exc).__name__}: {exc}")
    try:
        out = _call(spec, op, saved, seeded=False)
    except (TypeError, ValueError) as exc:
        return _finish(result, 2, f"cannot call {spec['op']}: {exc}")
    except RuntimeError as exc:  # the op itself refused: that is an answer, not a reproduction
        return _finish(result, 0, f"{spec['op']} raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
    if spec.get("crash"):
        return _finish(result, 0, f"{spec['op']} returned: no {spec['crash']} here")
    found, expected = _counts(out), spec["expected"]
    exact = len(saved) == len(spec["tensors"])
    result["found"] = found
    if not _same(found, expected, exact):
        return _finish(result, 0, f"not reproduced: {spec['op']} made {found}, recorded {expected}")
    result["reproduced"] = True
    if exact:
        # Whether the values matter: the same shapes, dtypes and ranges with seeded values.
        again = _same(_counts(_call(spec, op, saved, seeded=True)), expected, False)
        result["values_matter"] = not again
        why = "seeded random values in the same ranges do not" if not again else "so do seeded random values"
    else:
        result["values_matter"] = False
        why = "with seeded random values in the recorded ranges (the values were not saved): shapes suffice"
    return _finish(result, 1, f"reproduced: {spec['op']} made {found} again; {why}")


def _finish(result: dict[str, Any], code: int, text: str) -> int:
    result["message"] = text
    result["fpdoctor_imported"] = "fpdoctor" in sys.modules  # standalone: nothing of fpdoctor is needed
    print(text)
    print("RESULT " + json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
