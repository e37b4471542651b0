"""A standalone reproducer of a compiled graph that makes NaN/Inf its eager ops do not.

DIR gets graph.py (the graph Dynamo captured, as Python source: a torch.nn.Module whose forward
is the graph's code, with the imports it needs), repro.json (each input's shape, strides, dtype
and device, the backend, the Inductor settings that differ from torch's defaults, the custom
passes by import path, the outputs that were non-finite, the environment variables of each side
of the bisection, the machine's facts), the inputs' values (inputs.safetensors where
safetensors is installed, else inputN.bin raw little-endian bytes; never a pickle) and repro.py
(repro_script.py's text: torch only, no fpdoctor), which runs the graph eagerly, then
compiled with the same backend and settings, and says whether the compiled outputs are
non-finite. fpdoctor runs it once in a fresh interpreter (numerics/trace/repro.py's `run_once`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from fpdoctor.numerics.compiled.graphs import Captured
from fpdoctor.numerics.trace import repro
from fpdoctor.torchprivate import dynamo_backends, fx_import_block, inductor_config

# Inductor's settings that hold a callable: carried by import path, not by value
_PASSES = (
    "pre_grad_custom_pass",
    "joint_custom_pre_pass",
    "joint_custom_post_pass",
    "post_grad_custom_pre_pass",
    "post_grad_custom_post_pass",
)


class NotScriptable(Exception):
    """The graph cannot be written as a standalone script; the message says why."""


def graph_source(gm: torch.fx.GraphModule) -> str:
    """graph.py's text: the imports the graph's code needs and a module whose forward is that code."""
    from torch.package import sys_importer

    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        raise NotScriptable("the graph reads module attributes (parameters not lifted to inputs)")
    code = gm.graph.python_code(root_module="self")
    try:
        imports = fx_import_block(code.globals, sys_importer)
    except Exception as exc:
        raise NotScriptable(f"a global of the graph's code cannot be imported by name: {exc}") from exc
    body = "\n".join("    " + line if line.strip() else "" for line in code.src.strip("\n").splitlines())
    return (
        '"""The graph torch.compile captured (Dynamo\'s FX graph), as written by fpdoctor."""\n'
        f"import torch\n{imports}\n\n\nclass Graph(torch.nn.Module):\n{body}\n"
    )


def inductor_settings() -> tuple[list[str], list[dict[str, Any]], list[str]]:
    """(Inductor settings that differ from the defaults as Python lines, custom passes by import
    path, what cannot be carried)."""
    config = inductor_config()
    lines = [line for line in config.codegen_config().splitlines() if not any(p in line for p in _PASSES)]
    passes, missing = [], []
    for name in _PASSES:
        value = getattr(config, name, None)
        if value is None:
            continue
        cls = value if isinstance(value, type) or (callable(value) and not hasattr(value, "uuid")) else type(value)
        module, qualname = getattr(cls, "__module__", ""), getattr(cls, "__qualname__", "")
        mod = sys.modules.get(module)
        if not module or module == "__main__" or "<locals>" in qualname or mod is None:
            missing.append(f"{name} ({qualname or value!r} cannot be imported by name)")
            continue
        depth = module.count(".") + 1
        root = Path(getattr(mod, "__file__", "") or ".").resolve().parents[depth - 1]
        passes.append(
            {"setting": name, "module": module, "qualname": qualname, "instance": cls is not value, "path": str(root)}
        )
    return lines, passes, missing


def write(target: str, captured: Captured, sides: dict[str, Any] | None, limit: int = repro.LIMIT) -> Path:
    """DIR with graph.py, repro.py, repro.json and the inputs' values; NotScriptable when it cannot."""
    graph = captured.graph
    source = graph_source(graph.gm)
    if graph.backend_name not in dynamo_backends():
        raise NotScriptable(f"the backend {graph.backend_name!r} is the program's own, not one torch.compile names")
    lines, passes, missing = inductor_settings()
    inputs: list[dict[str, Any]] = []
    values: dict[int, torch.Tensor] = {}
    total = sum(a.numel() * a.element_size() for a in captured.inputs if isinstance(a, torch.Tensor))
    if total > limit:
        raise NotScriptable(f"the graph's inputs hold {total:,} bytes, above the {limit:,} a reproducer keeps")
    for i, (name, value) in enumerate(zip(graph.placeholders, captured.inputs, strict=False)):
        if isinstance(value, torch.Tensor):
            inputs.append(
                {
                    "name": name,
                    "shape": list(value.shape),
                    "stride": list(value.stride()),
                    "dtype": str(value.dtype).removeprefix("torch."),
                    "device": str(value.device),
                    "requires_grad": value.requires_grad,
                }
            )
            values[i] = value.detach().contiguous().cpu()
        elif isinstance(value, (bool, int, float)):
            inputs.append({"name": name, "value": value})
        else:
            raise NotScriptable(f"input {name} is a {type(value).__name__}, not a tensor or a number")
    spec: dict[str, Any] = {
        "graph": graph.compile_id,
        "backend": graph.backend_name,
        "inputs": inputs,
        "inductor_config": lines,
        "custom_passes": passes,
        "not_carried": missing,
        "bad_outputs": captured.bad_outputs,
        "sides": sides or {},
        "facts": repro.machine_facts(),
        "byteorder": "little",
    }
    directory = repro.prepare(target, also=("graph.py",))
    repro.save_values(directory, spec, values)  # always: the script reads spec["format"]
    (directory / "graph.py").write_text(source, encoding="utf-8")
    (directory / "repro.json").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
    script = Path(__file__).with_name("repro_script.py").read_text(encoding="utf-8")
    (directory / "repro.py").write_text(script, encoding="utf-8")
    return directory


def write_and_run(target: str, captured: Captured, sides: dict[str, Any] | None) -> dict[str, Any]:
    """The reproducer written and run once in a fresh interpreter: what the finding says of it."""
    try:
        directory = write(target, captured, sides)
    except NotScriptable as why:
        return {"scripted": False, "why": str(why)}
    ran = repro.run_once(directory)
    return {
        "dir": str(directory),
        "command": f"python {directory / 'repro.py'}",
        "reproduced": bool(ran.get("reproduced")),
        "result": ran.get("message"),
    }
