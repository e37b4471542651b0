"""torch's private API is taken in fpdoctor.torchprivate only, and every name there works here.

A private torch name (a leading underscore) may change in any release; kept in one module, a new
torch release is checked by reading one file and running this test. The scan finds, outside that
module: imports of a private torch module or name (`from torch.utils._pytree import ...`), an
attribute chain under a name bound to torch with a private part (`torch._C._foo`), and the private
attributes fpdoctor reads from torch's objects (`scaler._scale`, `model._orig_mod`), by attribute
or by `getattr`'s string, and overrides of torch's private hooks (`def _should_skip_dynamo`).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fpdoctor import torchprivate as tp

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = SRC / "fpdoctor"
SHIM = ROOT / "torchprivate.py"

# Modules that may still touch torch's private API, each with why.
ALLOWED = {
    # runs as a script by its path (a child that may crash), with the standard library and torch only
    "fpdoctor/env/probe_child.py",
    # a graph reproducer's repro.py: copied beside graph.py and run in a fresh interpreter with torch
    # only, no fpdoctor (it goes with a bug report to torch.compile's maintainers)
    "fpdoctor/numerics/compiled/repro_script.py",
}

# Private attributes of torch's objects (not modules) that fpdoctor reads through the shim.
ON_OBJECTS = {
    "_buffers",
    "_comm_hooks",
    "_compiled_call_impl",
    "_execution_engine",
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_optimizer_post_hooks",
    "_global_optimizer_pre_hooks",
    "_orig_mod",
    "_per_optimizer_states",
    "_post_accumulate_grad_hooks",
    "_saved_other",
    "_scale",
    "_should_skip_dynamo",
    "_step_count",
    "_step_supports_amp_scaling",
    "_use_python_reducer",
    "_growth_tracker",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torch_path(node: ast.expr, bound: dict[str, str]) -> str | None:
    """`torch._C._foo` -> "torch._C._foo" when the chain starts at a name bound to torch."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in bound:
        return ".".join([bound[node.id], *reversed(parts)])
    return None


def touches(source: str) -> Iterator[tuple[int, str]]:
    """(line, what) for each use of torch's private API in `source`."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the torch module or object it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torch":
                    continue
                bound[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                if any(_private(p) for p in alias.name.split(".")):
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                bound[alias.asname or alias.name] = full
                if any(_private(p) for p in full.split(".")):
                    yield node.lineno, f"from {node.module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            path = _torch_path(node, bound)
            if path is not None and _private(node.attr):
                yield node.lineno, path
            elif node.attr in ON_OBJECTS and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                yield node.lineno, f"{ast.unparse(node.value)}.{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in ON_OBJECTS
        ):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ON_OBJECTS:
            yield node.lineno, f"def {node.name}"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ON_OBJECTS:
            yield node.lineno, repr(node.value)


def test_only_the_shim_touches_torchs_private_api():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        name = path.relative_to(SRC).as_posix()
        if path == SHIM or name in ALLOWED:
            continue
        found += [f"{name}:{line}: {what}" for line, what in touches(path.read_text())]
    assert found == [], "take it through fpdoctor.torchprivate (add a named function there):\n" + "\n".join(found)


def test_every_allowed_module_still_touches_it():
    """An entry whose use is gone is removed, so the list only ever shrinks."""
    idle = [name for name in ALLOWED if not list(touches((SRC / name).read_text()))]
    assert idle == []


@pytest.mark.parametrize(
    ("source", "caught"),
    [
        ("import torch\ntorch._C._DisableTorchDispatch()", True),
        ("import torch.utils._pytree as pytree", True),
        ("from torch.utils import _pytree as pytree", True),
        ("from torch.utils._python_dispatch import TorchDispatchMode", True),
        ("from torch import _C\n_C._foo()", True),
        ("import torch as t\nt.autograd.Variable._execution_engine", True),
        ("scale = scaler._scale", True),
        ("getattr(model, '_orig_mod', None)", True),
        ("class M:\n    @classmethod\n    def _should_skip_dynamo(cls):\n        return False", True),
        ("names = ('_global_optimizer_pre_hooks',)", True),
        ("import torch\ntorch.__version__, torch.autograd.grad", False),
        ("self._scale = 1.0", False),  # an attribute of fpdoctor's own
        ("import os\nos._exit(0)", False),
        ("t._base, t._version", False),  # read directly: tp.READ_DIRECTLY
    ],
)
def test_the_scan_catches_what_it_says(source, caught):
    assert bool(list(touches(source))) is caught


# -- every name of the shim on the installed torch -----------------------------------------------


class _Seen(tp.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.modes: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.modes.append(tp.current_mode())
        return func(*args, **(kwargs or {}))


def test_dispatch_mode_stack_names():
    x = torch.ones(2)
    with _Seen() as outer:
        assert tp.mode_stack() == [outer]
        inner = _Seen()
        with inner:
            assert tp.mode_stack() == [outer, inner]
            assert tp.pop_mode() is inner
            assert tp.mode_stack() == [outer]
            tp.push_mode(inner)
            assert tp.mode_stack() == [outer, inner]
        with tp.mode_popped():
            assert tp.mode_stack() == []
            x + 1  # not seen: the mode is off the stack
        with tp.DisableTorchDispatch():
            x + 2  # not seen: no mode sees fpdoctor's own ops
        x * 3
    assert outer.ops == ["aten.mul.Tensor"]
    assert tp.mode_stack() == []


def test_an_eager_mode_is_not_wrapped_for_dynamo():
    class Eager(tp.EagerDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    raw = Eager.__dict__["__torch_dispatch__"]
    assert isinstance(raw, types.FunctionType) and raw.__name__ == "__torch_dispatch__"
    assert raw.__code__.co_filename == __file__  # not dynamo's disable() wrapper
    with Eager():
        assert torch.ones(2).add(1).tolist() == [2.0, 2.0]


def test_pytree_round_trip():
    value = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    leaves, spec = tp.tree_flatten(value)
    assert len(leaves) == 3
    again = tp.tree_unflatten(leaves, spec)
    assert again["b"] == 3 and again["a"][1][0] is leaves[1]
    assert tp.pytree.tree_leaves(value) == leaves


def test_autograd_engine_names():
    x = torch.ones(2, requires_grad=True)
    assert tp.graph_task_id() == -1 and tp.current_autograd_node() is None
    number = tp.sequence_nr()
    y = x * 2
    assert y.grad_fn is not None and y.grad_fn._sequence_nr() == number
    seen: dict[str, object] = {}

    def hook(grad: torch.Tensor) -> None:
        seen["task"] = tp.graph_task_id()
        seen["node"] = tp.current_autograd_node()
        seen["queued"] = tp.queue_callback(lambda: seen.setdefault("after", seen.get("task")))

    y.register_hook(hook)
    y.sum().backward()
    assert seen["task"] != -1 and seen["node"] is not None
    assert seen["queued"] is True and seen["after"] == seen["task"]  # ran when that backward ended
    assert tp.graph_task_id() == -1


def test_constant_operand_of_a_scaled_loss():
    w = torch.ones(3, requires_grad=True)
    loss = (w * w).sum()
    assert tp.constant_operand((loss * 1024).grad_fn) == 1024.0
    assert tp.constant_operand((loss / 4).grad_fn) == 4.0
    assert tp.constant_operand((loss * torch.tensor(0.5)).grad_fn) == 0.5
    assert tp.constant_operand((loss * w.sum()).grad_fn) is None  # the other operand needs a gradient
    assert tp.constant_operand(loss.grad_fn) is None  # a sum saves no operand


def test_kernels():
    assert tp.has_scaled_mm()
    a = torch.eye(16).to(torch.float8_e4m3fn)
    b = (torch.arange(256.0).reshape(16, 16) / 64).to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones(())
    out = tp.scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    assert torch.equal(out, b.float())
    dst, src = (
        [torch.zeros(2), torch.zeros(3, dtype=torch.float64)],
        [torch.ones(2), torch.full((3,), 2.0, dtype=torch.float64)],
    )
    tp.foreach_copy_(dst, src)
    assert dst[0].tolist() == [1.0, 1.0] and dst[1].tolist() == [2.0, 2.0, 2.0]
    grads, found, one = [torch.ones(2), torch.tensor([1.0, float("nan")])], torch.zeros(()), torch.ones(())
    norms = tp.foreach_norm([torch.full((4,), 3.0), torch.ones(4, dtype=torch.bfloat16)], torch.float32)
    assert [n.item() for n in norms] == [6.0, 2.0] and norms[1].dtype == torch.float32
    tp.unscale_check_(grads, found, one)
    assert found.item() == 1.0 and grads[0].tolist() == [1.0, 1.0]


def test_grad_scaler_and_optimizer_names():
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    assert tp.scaler_scale(scaler) is None  # none before the first scale()
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    assert isinstance(tp.scaler_scale(scaler), torch.Tensor)
    scaler.step(sgd)
    states = tp.scaler_states(scaler)
    assert states is not None and "found_inf_per_device" in states[id(sgd)]
    assert tp.scaler_states(object()) is None
    assert not tp.steps_with_scaler(sgd)
    assert tp.steps_with_scaler(torch.optim.Adam(model.parameters(), fused=True))


def test_global_hook_tables():
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    pre = optimizer_mod.register_optimizer_step_pre_hook(lambda *a: None)
    post = module_mod.register_module_forward_hook(lambda *a: None, with_kwargs=True)
    try:
        tables = tp.global_optimizer_hooks(optimizer_mod)
        assert sorted(tables) == ["_global_optimizer_post_hooks", "_global_optimizer_pre_hooks"]
        assert pre.id in tables["_global_optimizer_pre_hooks"]
        assert post.id in tp.global_forward_hooks_with_kwargs(module_mod)
        forward = tp.global_forward_hook_tables(module_mod)
        assert forward is not None and post.id in forward[1] and post.id not in forward[0]
    finally:
        pre.remove()
        post.remove()
        tp.global_forward_hooks_with_kwargs(module_mod).pop(post.id, None)


def test_dynamo_frames_seen():
    before = tp.dynamo_frames_seen()
    assert before >= 0

    @torch.compile(backend="eager")
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double(torch.ones(2))
    assert tp.dynamo_frames_seen() > before


def test_module_names():
    model = nn.BatchNorm1d(2)
    assert tp.buffers_of(model)["running_mean"] is model.running_mean
    assert tp.compiled_inner(model) is None and not tp.is_compiled_module(model)
    compiled = torch.compile(model)  # the wrapper only: nothing runs, nothing compiles
    assert tp.compiled_inner(compiled) is model and tp.is_compiled_module(compiled)
    model.compile()
    assert tp.is_compiled_module(model)
    p = nn.Parameter(torch.ones(1))
    assert not tp.post_accumulate_grad_hooks(p)
    p.register_post_accumulate_grad_hook(lambda t: None)
    assert tp.post_accumulate_grad_hooks(p)


def test_reparametrized():
    model = nn.Linear(1, 1, bias=False)
    with tp.reparametrized(model, {"weight": torch.full((1, 1), 3.0)}, tie_weights=True):
        assert model(torch.ones(1)).item() == 3.0
    assert model.weight.shape == (1, 1) and isinstance(model.weight, nn.Parameter)


def test_ddp_comm_hook():
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch built without torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 1))
        assert not tp.has_comm_hook(ddp)
        ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
        assert tp.has_comm_hook(ddp)
    finally:
        dist.destroy_process_group()


def test_the_backward_context_is_taken_out_for_the_block_and_put_back():
    seen: dict[str, object] = {}
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        has = getattr(torch._C, "_is_key_in_tls", lambda key: False)
        seen["before"] = has("context")
        with tp.without_backward_context():
            seen["inside"] = has("context")
        seen["after"] = has("context")
        return grad

    x.register_hook(hook)
    (x * 2).sum().backward()
    if not hasattr(torch._C, "_stash_obj_in_tls"):
        pytest.skip("this torch keeps no Python context for a backward")
    assert seen == {"before": True, "inside": False, "after": True}
    with tp.without_backward_context():  # outside a backward: nothing to take out
        assert not torch._C._is_key_in_tls("context")


def test_dynamo_skipper_keeps_a_function_out_of_compilation():
    graphs: list[object] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def kept_out(x):
        return x * 2

    def compiled_too(x):
        return x * 3

    tp.dynamo_skipper()(kept_out.__code__)
    assert tp.DYNAMO in sys.modules
    assert torch.compile(kept_out, backend=backend)(torch.ones(2)).tolist() == [2.0, 2.0]
    assert graphs == []  # ran as plain Python
    torch.compile(compiled_too, backend=backend)(torch.ones(2))
    assert len(graphs) == 1  # the backend is called where a frame is compiled


def test_dynamo_and_inductor_settings():
    inductor = tp.inductor_config()
    before = inductor.emulate_precision_casts
    with inductor.patch({"emulate_precision_casts": not before}):
        assert inductor.emulate_precision_casts is not before
        assert "emulate_precision_casts" in inductor.codegen_config()  # a line that differs from the default
    assert inductor.emulate_precision_casts is before
    dynamo = tp.dynamo_config()
    with dynamo.patch({"recompile_limit": 123}):
        assert dynamo.recompile_limit == 123
    assert dynamo.recompile_limit != 123


def test_backends_by_name():
    names = tp.dynamo_backends()
    assert {"eager", "aot_eager", "inductor"} <= set(names)
    assert "no_such_backend" not in names
    eager = tp.lookup_backend("eager")
    gm = torch.fx.symbolic_trace(lambda x: x * 2)
    assert eager(gm, [torch.ones(2)])(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(Exception):  # noqa: B017 -- torch's own error type for an unknown name varies
        tp.lookup_backend("no_such_backend")


def test_compile_fx_compiles_a_graph():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    compiled = tp.compile_fx(gm, [torch.ones(3)])
    out = compiled(torch.ones(3))
    assert (out[0] if isinstance(out, (list, tuple)) else out).tolist() == [2.0, 2.0, 2.0]


def test_the_compile_under_way_and_the_backend_call():
    seen: list[object] = []
    own = tp.dynamo_output_graph().call_user_compiler
    assert callable(own)

    def backend(gm, example_inputs):
        seen.append(tp.current_compile_id())
        return gm.forward

    assert tp.current_compile_id() is None
    torch.compile(lambda x: x * 5, backend=backend)(torch.ones(2))
    assert len(seen) == 1 and re.fullmatch(r"\d+/0", str(seen[0]))  # frame/recompile: the first compile of a frame


def test_dynamo_cache_entries_are_found_and_dropped():
    def backend(gm, example_inputs):
        return gm.forward

    def times_seven(x):
        return x * 7

    compiled = torch.compile(times_seven, backend=backend)
    compiled(torch.ones(2))
    code = times_seven.__code__
    assert code in list(tp.dynamo_input_codes())
    assert list(tp.dynamo_output_codes())  # the code Dynamo made for it, alive while the entry is
    entries = tp.dynamo_cache_entries(code)
    assert len(entries) == 1 and hasattr(entries[0], "backend")
    tp.reset_dynamo_code(code)
    assert tp.dynamo_cache_entries(code) == []


def test_compiler_bisector_and_its_settings():
    bisector = tp.compiler_bisector()
    assert callable(bisector.do_bisect) and callable(bisector.get_backend)
    from torch._inductor.compiler_bisector import BACKENDS

    settings = [(b, s.name) for b, subs in BACKENDS.items() for s in subs if hasattr(s, "config_field")]
    counted = [(b, s.name) for b, subs in BACKENDS.items() for s in subs if not hasattr(s, "config_field")]
    assert settings and counted
    change = tp.bisect_setting(*settings[0])
    assert change is not None and change.config_name and change.config_field
    assert tp.bisect_setting(*counted[0]) is None
    assert tp.bisect_setting("inductor", "no_such_subsystem") is None


def test_fx_import_block_names_the_graphs_globals():
    from torch.package import sys_importer

    gm = torch.fx.symbolic_trace(lambda x: torch.nn.functional.relu(x) + torch.sin(x))
    code = gm.graph.python_code(root_module="self")
    block = tp.fx_import_block(code.globals, sys_importer)
    assert "import torch" in block
    namespace: dict[str, object] = {}
    exec(block, namespace)  # the lines run as they are written into graph.py
    assert "torch" in namespace


def test_attributes_read_directly_exist():
    examples = dict(tp.read_directly_examples())
    assert sorted(examples) == sorted(tp.READ_DIRECTLY)
    for key, obj in examples.items():
        assert hasattr(obj, key.split(".")[1]), key


def test_importing_the_shim_imports_no_dynamo():
    code = "import fpdoctor.torchprivate, sys; print('torch._dynamo' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "False"
