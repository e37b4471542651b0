"""One compiled graph, standalone: fpdoctor copies this file as DIR/repro.py beside DIR/graph.py
and DIR/repro.json.

It needs torch only (and safetensors when the inputs were saved in that format); it imports
nothing of fpdoctor, so it can go with a bug report to torch.compile's maintainers. `python
repro.py` loads the graph's inputs, runs the graph eagerly, then compiled with the recorded
backend and Inductor settings (custom passes imported by the recorded path), and exits 1 when
the compiled outputs are non-finite while the eager ones are finite, 0 when not, 2 when it cannot
run here. The environment variables of repro.json's "sides" (TORCH_BISECT_*) set before running
it give each side of the bisection. The last line printed is `RESULT {json}`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _inputs(spec: dict[str, Any]) -> list[Any]:
    saved: dict[int, torch.Tensor] = {}
    if spec["format"] == "safetensors":
        from safetensors.torch import load_file

        saved = {
            int(k.removeprefix("input")): t for k, t in load_file(os.path.join(HERE, "inputs.safetensors")).items()
        }
    elif sys.byteorder != "little":
        raise RuntimeError("the inputs are little-endian bytes; this machine is big-endian")
    out: list[Any] = []
    for i, meta in enumerate(spec["inputs"]):
        if "value" in meta:
            out.append(meta["value"])
            continue
        dtype = getattr(torch, meta["dtype"])
        flat = saved.get(i)
        if flat is None:
            with open(os.path.join(HERE, f"input{i}.bin"), "rb") as fh:
                flat = torch.frombuffer(bytearray(fh.read()), dtype=dtype)
        t = torch.empty_strided(meta["shape"], meta["stride"], dtype=dtype, device=meta["device"])
        t.copy_(flat.reshape(meta["shape"]))
        out.append(t.requires_grad_(meta["requires_grad"]))
    return out


def _configure(spec: dict[str, Any]) -> None:
    import torch._inductor.config  # the settings' lines name it

    for line in spec["inductor_config"]:
        exec(line, {"torch": torch})
    for p in spec["custom_passes"]:
        if p["path"] not in sys.path:
            sys.path.insert(0, p["path"])
        obj: Any = importlib.import_module(p["module"])
        for part in p["qualname"].split("."):
            obj = getattr(obj, part)
        setattr(torch._inductor.config, p["setting"], obj() if p["instance"] else obj)


def _nonfinite(out: Any) -> list[int]:
    outs = out if isinstance(out, (list, tuple)) else [out]
    return [
        i
        for i, o in enumerate(outs)
        if isinstance(o, torch.Tensor) and o.is_floating_point() and not bool(o.detach().isfinite().all())
    ]


def main() -> int:
    with open(os.path.join(HERE, "repro.json"), encoding="utf-8") as fh:
        spec = json.load(fh)
    sys.path.insert(0, HERE)
    from graph import Graph  # type: ignore[import-not-found]

    try:
        _configure(spec)
        eager = _nonfinite(Graph()(*_inputs(spec)))
        compiled = torch.compile(Graph(), backend=spec["backend"], fullgraph=True)
        bad = _nonfinite(compiled(*_inputs(spec)))
    except Exception as exc:
        result = {"reproduced": False, "message": f"could not run here: {type(exc).__name__}: {exc}"[:400]}
        print("RESULT " + json.dumps(result))
        return 2
    reproduced = bool(bad) and not eager
    if reproduced:
        message = f"compiled with {spec['backend']}: outputs {bad} non-finite; eager: finite"
    elif eager:
        message = f"eager outputs {eager} are non-finite too: not a compiled-only fault here"
    else:
        message = f"compiled with {spec['backend']}: every output finite"
    print("RESULT " + json.dumps({"reproduced": reproduced, "message": message, "eager_nonfinite": eager}))
    return 1 if reproduced else 0


if __name__ == "__main__":
    raise SystemExit(main())
