"""torch's private API, in one place: every name fpdoctor takes from torch's insides.

A name with a leading underscore in torch is free to change in any release. fpdoctor needs some
(a dispatch mode is the tracer, the autograd engine says which backward op runs, GradScaler keeps
its state in attributes), so they are taken here and nowhere else (`tests/test_torch_private.py`
fails when another module touches one), each under a name of its own with a line saying what it
is and why fpdoctor needs it. Where a release may lack one, the name falls back to what fpdoctor
can still do without it: a capability then reports less ("not checked"), the user's job runs on.

Checked on torch 2.13.0 (constraints.txt): `tests/test_torch_private.py` runs every name below.
Not yet run on torch 2.11.0+cu130 (the GPU image; the same test runs there with the suite) nor on
the floor, torch>=2.1 (pyproject.toml): the names a release may lack are looked up with a fallback.

Importing this module imports torch (only modules that use torch import it) but not Dynamo or
Inductor: those cost seconds and tens of MiB, and are imported inside the function that needs them.

Read directly, not through a function: attributes read on every op or tensor in a hot path, where
a call would cost more than the read. They are declared in torch's own type stubs (torch/_C, and
torch/_ops.py for `_schema`); the test checks each on the installed torch (`READ_DIRECTLY`).

`fpdoctor/env/probe_child.py` calls `torch._scaled_mm` itself: it runs as a script by its path,
with the standard library and torch only. `fpdoctor/numerics/compiled/repro_script.py` sets Inductor's
settings itself: it is a graph reproducer's repro.py, run with torch only, no fpdoctor.
"""

from __future__ import annotations

import collections
import contextlib
import re
import sys
import types
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch
from torch.utils import _python_dispatch as _dispatch
from torch.utils import _pytree as pytree  # nested inputs and outputs: tuples, lists, dicts, registered types
from torch.utils._python_dispatch import TorchDispatchMode  # every aten op of a block through one Python method

# -- data loading --------------------------------------------------------------------------------


@contextlib.contextmanager
def dataloader_batches(
    on_indices: Callable[[Any, Any], None], on_batch: Callable[[Any, bool, Any], None]
) -> Iterator[None]:
    """While inside, `on_indices(iterator, indices)` sees each index list a DataLoader iterator asks
    its sampler for (at prefetch time too, in send order), `on_batch(iterator, in_order, batch)` each
    batch it hands out (in_order: handed out in the order asked), and `on_indices(iterator, None)` each
    reset (a new epoch drops what was prefetched): which dataset rows a batch holds.
    `_BaseDataLoaderIter`, its `_next_index`/`_reset` and `_in_order` are private; the class's
    methods are put back on exit, and nothing is set on the iterators."""
    try:
        from torch.utils.data import dataloader
    except ImportError:
        yield
        return
    cls = getattr(dataloader, "_BaseDataLoaderIter", None)
    names = ("_next_index", "_reset", "__next__")
    if cls is None or not all(name in cls.__dict__ for name in names):
        yield  # a release without them: rows are named by their place in the batch only
        return
    originals = {name: cls.__dict__[name] for name in names}

    def _next_index(self: Any) -> Any:
        indices = originals["_next_index"](self)
        on_indices(self, indices)
        return indices

    def _reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        on_indices(self, None)
        return originals["_reset"](self, *args, **kwargs)

    def __next__(self: Any) -> Any:
        batch = originals["__next__"](self)
        on_batch(self, bool(getattr(self, "_in_order", True)), batch)
        return batch

    for name, wrapper in (("_next_index", _next_index), ("_reset", _reset), ("__next__", __next__)):
        setattr(cls, name, wrapper)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)


# -- dispatch modes ------------------------------------------------------------------------------

tree_flatten = pytree.tree_flatten  # a nested value's tensors, to replay an op with one input changed
tree_unflatten = pytree.tree_unflatten  # ...and the same nesting back around the changed leaves

mode_stack = _dispatch._get_current_dispatch_mode_stack  # the thread's modes, bottom first: where the tracer sits
current_mode = _dispatch._get_current_dispatch_mode  # the top mode: compare's own-ops judge pops only itself
pop_mode = _dispatch._pop_mode  # pop and push one mode: compare's op ranges go back under the modes above them
push_mode = _dispatch._push_mode
mode_popped = _dispatch._pop_mode_temporarily  # `with mode_popped():` the top mode is off inside the block

# `with DisableTorchDispatch():` fpdoctor's own statistics and copies skip every dispatch mode,
# its own and the user's: they are not the user's ops.
DisableTorchDispatch = torch._C._DisableTorchDispatch


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode whose `__torch_dispatch__` torch does not wrap in Dynamo's disable()
    (torch does that for every mode whose `_should_skip_dynamo` says True, its default): the wrapper
    imports torch._dynamo (~2.6 s, ~77 MiB) at the first op and adds two Python frames to every op.
    Compiled code under the mode still runs as the user's; fpdoctor's own code is kept out of
    Dynamo by `numerics.dynamo.keep_out`. Older torch never asks, and the method is unused."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


# -- autograd ------------------------------------------------------------------------------------


def _no_graph_task() -> int:
    return -1


def _no_node() -> Any:
    return None


# The backward pass this thread runs now, -1 outside one: an op's phase (forward or backward).
graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", _no_graph_task)

# The autograd node whose backward runs now: which module's forward made the op in backward.
current_autograd_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", _no_node)

# The sequence number the next autograd node made on this thread will get (a node's
# `_sequence_nr()`, read directly, is the one it got): matches backward nodes with forward ops.
sequence_nr: Callable[[], int] = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", _no_graph_task)


def constant_operand(node: Any) -> float | None:
    """The constant a MulBackward0 or DivBackward0 node's output was multiplied or divided by (its
    `_saved_other`, a one-element tensor that needs no gradient): a loss scale written by hand,
    `(loss * 1024).backward()`, is one such node at the backward's root. None where the node is
    another op, its other operand needs a gradient or lives on a device (reading it would wait for the
    device: a GradScaler's scale on a GPU; a Python number is always a CPU tensor here), or torch saves
    no such attribute."""
    other = getattr(node, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.requires_grad or other.device.type != "cpu":
        return None
    with DisableTorchDispatch():  # a dispatch mode of the trace's, or the user's, sees no read of fpdoctor's
        return float(other)


def queue_callback(callback: Callable[[], None]) -> bool:
    """Run `callback` when the backward pass running now ends (the engine's own queue): the
    gradients of a whole step are judged once, after the last one is written. False where the
    engine has no queue (the caller then judges at the next step)."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    queue(callback)
    return True


# -- the dispatcher's registrations ---------------------------------------------------------------

# A line of `_dispatch_dump`: "CPU: registered at /path/file.py:5 :: (Tensor _0) -> Tensor _0 [ boxed ]",
# "CPU (inactive): registered at ...RegisterCPU_2.cpp:2492 ..." (a kernel another one replaced),
# "debug: registered at /path/file.py:2" (where the op itself was defined).
_REGISTERED = re.compile(
    r"^(?P<key>[^:\n]+?)(?P<inactive> \(inactive\))?: registered at (?P<file>\S+?):(?P<line>\d+)", re.MULTILINE
)


def dispatcher_ops() -> list[str]:
    """Every operator the dispatcher holds ("aten::exp", "myns::scale"): `fpdoctor env` lists those
    that code outside torch (a sitecustomize, a .pth, a backend plug-in) defined or overrode before
    the user's first line. [] where torch lacks the call: env then says it could not check."""
    names = getattr(torch._C, "_dispatch_get_all_op_names", None)
    return list(names()) if names is not None else []


def dispatcher_dump(op: str) -> str:
    """The dispatcher's text about `op` ("aten::exp"): its schema, where it was defined and every
    kernel with where it was registered. `_dispatch_dump` is torch's debugging output: "" where
    torch lacks it or the op is unknown."""
    dump = getattr(torch._C, "_dispatch_dump", None)
    if dump is None:
        return ""
    try:
        return str(dump(op))
    except RuntimeError:  # not an operator (any more)
        return ""


def registrations(op: str, text: str | None = None) -> list[tuple[str, str, int, bool]]:
    """(dispatch key, file, line, active) of each registration of `op` that says where it was made
    (from `text`, its dispatcher_dump, when the caller has it); the key "debug" is the op's own
    definition. torch.library records the Python file and line that made each `Library`, a C++
    registration its source file."""
    text = dispatcher_dump(op) if text is None else text
    return [(m["key"].strip(), m["file"], int(m["line"]), not m["inactive"]) for m in _REGISTERED.finditer(text)]


def custom_op_defs() -> dict[str, tuple[str, int]]:
    """Ops made with `torch.library.custom_op` ("myns::scale") -> the file and line of the Python
    function behind each. Such an op's Library is made inside torch (torch/_library), so the
    dispatcher names torch's file; `torch._library.custom_ops.OPDEFS` keeps the user's function.
    {} where torch lacks it (then those ops are said to be torch's)."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return {}
    found = {}
    for name, definition in list(OPDEFS.items()):
        code = getattr(getattr(definition, "_init_fn", None), "__code__", None)
        if code is not None:
            found[name] = (code.co_filename, code.co_firstlineno)
    return found


def defined_at(op: str) -> tuple[str, int] | None:
    """The file and line where `op` ("myns::scale") was defined: whose op the trace names."""
    if op in (made := custom_op_defs()):
        return made[op]
    return next(((file, line) for key, file, line, _ in registrations(op) if key == "debug"), None)


# -- kernels -------------------------------------------------------------------------------------


def has_scaled_mm() -> bool:
    """torch has the fp8 GEMM (`torch._scaled_mm`)."""
    return hasattr(torch, "_scaled_mm")


def scaled_mm(a: torch.Tensor, b: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The real fp8 GEMM: fp8 candidates and GEMM fingerprints multiply as fp8 training does.
    Looked up at each call, as a user's own code does. Callers test `has_scaled_mm()` first."""
    return torch._scaled_mm(a, b, **kwargs)


def foreach_copy_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """`dst[i].copy_(src[i])` for all i in one fused kernel: restoring the user's state after a
    replay costs one launch per device and dtype. One copy each where torch has no fused one."""
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(list(dst), list(src))
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def foreach_norm(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Each tensor's L2 norm, reduced in `dtype`, in one call (what clip_grad_norm_ uses): the
    sentinel's gradient norm costs no Python per gradient. One norm at a time where torch has no
    `_foreach_norm` taking a dtype."""
    try:
        return list(torch._foreach_norm(tensors, 2.0, dtype=dtype))
    except (AttributeError, TypeError, NotImplementedError):
        return [torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]


def unscale_check_(grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """GradScaler's fused "any gradient not finite" pass (it raises where a device or dtype has no
    kernel, and callers then check one gradient at a time): at scale 1.0 fpdoctor's gradient check
    costs one pass per device and reads the device once."""
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


# -- GradScaler and optimizers -------------------------------------------------------------------


def scaler_scale(scaler: Any) -> torch.Tensor | None:
    """GradScaler's scale tensor (`_scale`), None before its first scale() or when it is disabled:
    its version counter says whether update() ran, and a replay sets it back to the step's."""
    return getattr(scaler, "_scale", None)


def scaler_states(scaler: Any) -> dict[int, dict[str, Any]] | None:
    """GradScaler's state per optimizer id (`_per_optimizer_states`: stage, found_inf per device):
    whether step() ran for an optimizer and what it found. None where the scaler keeps none."""
    states = getattr(scaler, "_per_optimizer_states", None)
    return states if isinstance(states, dict) else None


def steps_with_scaler(optimizer: Any) -> bool:
    """The optimizer takes GradScaler's found_inf and skips on the device (fused Adam, AdamW, SGD:
    `_step_supports_amp_scaling`): its skipped steps are judged from the flag, not the weights."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def global_optimizer_hooks(optimizer_module: types.ModuleType) -> dict[str, dict[int, Any]]:
    """The global optimizer step pre- and post-hook dicts by their name in torch.optim.optimizer:
    `watch` gives torch copies while it iterates them (a replay registers hooks of its own)."""
    names = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    return {n: getattr(optimizer_module, n) for n in names if hasattr(optimizer_module, n)}


class SnapshotHooks(MutableMapping[int, Any]):
    """One of torch's global optimizer-hook dicts seen through a view put in its place for a while
    (`watch`, a shadow step): torch iterates `values()` at every optimizer step of every thread, and a
    hook registered or removed under that iteration raises "OrderedDict mutated during iteration"
    into another thread's `opt.step()`. Here `values()` is a snapshot, so no iteration in progress
    sees a change. Reads and writes go to the dict it views (`hooks`; its own fresh dict where none):
    a handle made on the view or on the dict removes from both, during the block or after it."""

    def __init__(self, hooks: dict[int, Any] | None = None) -> None:
        self.hooks: dict[int, Any] = collections.OrderedDict() if hooks is None else hooks

    def __getitem__(self, key: int) -> Any:
        return self.hooks[key]

    def __setitem__(self, key: int, value: Any) -> None:
        self.hooks[key] = value

    def __delitem__(self, key: int) -> None:
        del self.hooks[key]

    def __iter__(self) -> Iterator[int]:
        return iter(tuple(self.hooks))

    def __len__(self) -> int:
        return len(self.hooks)

    def values(self) -> Any:
        return tuple(self.hooks.values())


# The views put in place of torch's dicts, kept after their block: a handle made through one holds a weak
# reference to it, and removes its hook from torch's dict through it (two small objects per watch)
_VIEWS: list[SnapshotHooks] = []


@contextlib.contextmanager
def snapshot_optimizer_hooks(optimizer_module: types.ModuleType, *, empty: bool = False) -> Iterator[None]:
    """torch's global optimizer hooks read as snapshots inside the block (SnapshotHooks views of
    them), so that hooks of ours and the script's can come and go while any thread steps; torch's own
    dicts, changed through the views, are in place again after it. `empty`: views of empty dicts of
    their own instead, for a step of ours (a shadow's, a what-if's) that no hook of the program sees."""
    saved = global_optimizer_hooks(optimizer_module)
    for name, hooks in saved.items():
        view = SnapshotHooks() if empty else SnapshotHooks(hooks)
        if not empty:
            _VIEWS.append(view)
        setattr(optimizer_module, name, view)
    try:
        yield
    finally:
        for name, hooks in saved.items():
            setattr(optimizer_module, name, hooks)


def global_forward_hooks_with_kwargs(module_module: types.ModuleType) -> dict[int, bool]:
    """The ids of global forward hooks registered with_kwargs (torch.nn.modules.module): torch's
    handle leaves its mark there when removed, and every later torch.compile(module) would warn of
    global hooks that are gone. An empty dict where torch keeps none."""
    return getattr(module_module, "_global_forward_hooks_with_kwargs", {})


def global_forward_hook_tables(module_module: types.ModuleType) -> tuple[dict[int, Any], dict[int, Any]] | None:
    """torch's global forward pre-hooks and forward hooks, by handle id (torch.nn.modules.module):
    a module call finds both empty (and no hooks of its own) and takes torch's fast path, straight
    to forward. `fpdoctor watch` takes its own hooks out of them while a top-level call runs, so
    that the submodule calls inside it stay on that path. None where torch keeps them elsewhere:
    the watch's hooks then stay in, and every module call pays for them."""
    pre = getattr(module_module, "_global_forward_pre_hooks", None)
    post = getattr(module_module, "_global_forward_hooks", None)
    return (pre, post) if isinstance(pre, dict) and isinstance(post, dict) else None


# -- modules -------------------------------------------------------------------------------------


def buffers_of(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """A module's own buffers as stored (`_buffers`): restoring one puts the very tensor back,
    which `register_buffer` would refuse for a name that exists and `setattr` may wrap."""
    return module._buffers


def named_parameters(module: Any) -> Any:
    """The module's parameters by the names its code gives them: inside torch.compile's wrapper,
    without the `_orig_mod.` prefix its own `named_parameters` adds."""
    return (compiled_inner(module) or module).named_parameters()


def compiled_inner(module: Any) -> Any:
    """The module inside torch.compile's wrapper (OptimizedModule's `_orig_mod`), None for any
    other: names are the model's own, not `_orig_mod.`-prefixed."""
    return getattr(module, "_orig_mod", None)


def is_compiled_module(module: Any) -> bool:
    """The module runs through torch.compile: its wrapper (`_orig_mod`) or `module.compile()`
    (`_compiled_call_impl`)."""
    return hasattr(module, "_orig_mod") or getattr(module, "_compiled_call_impl", None) is not None


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> Any:
    """A parameter's post-accumulate-grad hooks (an optimizer run in backward), None or empty
    without: a replay would step the real weights again."""
    return getattr(tensor, "_post_accumulate_grad_hooks", None)


def comm_hooks(ddp: Any) -> list[Any]:
    """The communication hooks registered on a DDP model (`register_comm_hook`), as (hook, state)."""
    return list(getattr(ddp, "_comm_hooks", None) or [])


def has_comm_hook(ddp: Any) -> bool:
    """A DDP model already has a communication hook, or the Python reducer: one of the user's
    stays, and fpdoctor's gradient attribution, which needs its own hook, is off."""
    return bool(getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_use_python_reducer", False))


@contextlib.contextmanager
def without_backward_context() -> Iterator[None]:
    """torch (2.13 here) keeps a Python object, the backward's `contextvars` context, in
    thread-local storage while a backward runs; a collective started then copies it into its work
    and callbacks, and gloo's worker thread, dropping the last copy, takes the GIL to free it. At
    interpreter shutdown that aborts the process ("terminate called without an active exception",
    `ProcessGroupGloo::runLoop` -> `~AsyncWork` -> `~ThreadLocalState`). Taken out for the block
    and put back after it, in this thread; a torch without it has nothing to take out."""
    is_key = getattr(torch._C, "_is_key_in_tls", None)
    if is_key is None or not is_key("context"):
        yield
        return
    context = torch._C._get_obj_in_tls("context")
    torch._C._remove_obj_from_tls("context")
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls("context", context)


def reparametrized(module: torch.nn.Module, tensors: dict[str, torch.Tensor], *, tie_weights: bool = False) -> Any:
    """`with reparametrized(model, {name: tensor}):` the model computes with these tensors in place
    of its parameters and buffers (tied weights follow with tie_weights): the fp32 control and the
    what-if arms run the user's own step function on stand-ins, a block `torch.func.functional_call`
    (one call) cannot give."""
    from torch.nn.utils.stateless import _reparametrize_module

    return _reparametrize_module(module, tensors, tie_weights=tie_weights)


# -- Dynamo (imported only when the program has imported it, or fpdoctor compiles) ---------------

DYNAMO = "torch._dynamo"  # the module whose import means the program compiles


def dynamo_frames_seen() -> int:
    """How many frames Dynamo has been handed to compile in this process (its counters, read without
    importing it): 0 while nothing runs compiled. `fpdoctor watch` changes the global module hooks
    around eager forwards only while this is 0, so that no code is compiled under one state of them
    and run under another (Dynamo guards on them). -1 where it cannot say."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["frames"]["total"])
    except (AttributeError, KeyError, TypeError):
        return -1


def dynamo_skipper() -> Callable[[types.CodeType], None]:
    """A function that makes Dynamo run a code object as plain Python, never as a frame to compile:
    fpdoctor's hooks and dispatch-mode methods called around a graph break. Where torch has per-frame
    strategies, the frame and every frame it calls (the standard library's helpers included);
    otherwise the frame only. Imports torch._dynamo: call it once the program has."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        def skip(code: types.CodeType) -> None:
            set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))

        return skip
    except ImportError:
        from torch._dynamo.eval_frame import skip_code

        return skip_code


def dynamo_config() -> types.ModuleType:
    """Dynamo's settings (`torch._dynamo.config`, whose `patch` sets them for a block): compare's
    compiled arms lift the recompile limits, so its own compiles never fall back to eager."""
    import torch._dynamo.config

    return torch._dynamo.config


def dynamo_backends() -> list[str]:
    """The backends torch.compile knows by name, every tag included: a graph reproducer names its
    backend, which a backend of the program's own cannot be."""
    import torch._dynamo

    return list(torch._dynamo.list_backends(exclude_tags=()))


def lookup_backend(name: str) -> Callable[..., Any]:
    """The compiler function torch.compile runs for a backend's name ("aot_eager_decomp_partition",
    "inductor"): a graph recompiled alone with the backend it had, or with each side of a bisection."""
    from torch._dynamo.backends.registry import lookup_backend as lookup

    return lookup(name)


def dynamo_output_graph() -> Any:
    """Dynamo's OutputGraph: its `call_user_compiler` is the one place Dynamo calls the backend, which
    fpdoctor wraps to keep a copy of each graph and check what the compiled graph returns."""
    from torch._dynamo.output_graph import OutputGraph

    return OutputGraph


def current_compile_id() -> Any:
    """The id of the compile under way ("0/1": frame/recompile), None outside one: a graph's name
    in findings and reproducers, as torch's own logs print it."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


def dynamo_input_codes() -> Iterator[types.CodeType]:
    """The code objects Dynamo has seen (`convert_frame.input_codes`), those still alive: where
    compare's own compiles left cache entries."""
    from torch._dynamo.convert_frame import input_codes

    for ref in list(input_codes.seen):
        code = ref()
        if code is not None:
            yield code


def dynamo_output_codes() -> Iterator[types.CodeType]:
    """The code objects Dynamo compiled (`convert_frame.output_codes`), those still alive: code
    compiled before a trace began, whose graphs the trace could not wrap."""
    from torch._dynamo.convert_frame import output_codes

    for ref in list(output_codes.seen):
        code = ref()
        if code is not None:
            yield code


def dynamo_cache_entries(code: types.CodeType) -> list[Any]:
    """Dynamo's cache entries on a code object, each with the `backend` that compiled it: whether
    every one is compare's own."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return list(_debug_get_cache_entry_list(code))


def reset_dynamo_code(code: types.CodeType) -> None:
    """Drop every Dynamo cache entry on a code object (the next call compiles afresh): compare's
    compiles never count towards the recompile limit of the user's own compiles of the same code."""
    from torch._C._dynamo.eval_frame import reset_code

    reset_code(code)


# -- Inductor (imported only when fpdoctor compiles or reads its settings) -----------------------


def inductor_config() -> types.ModuleType:
    """Inductor's settings (`torch._inductor.config`: `patch` for a block, `codegen_config()` for
    the lines that differ from the defaults, the custom passes): a graph recompiled with
    emulate_precision_casts or a bisection's setting, and a reproducer's settings."""
    import torch._inductor.config

    return torch._inductor.config


def compile_fx(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Inductor's compiler for one graph (what backend="inductor" runs): compare's compiled arm
    compiles with it under a backend of its own, so no other compile's cache entry is reused."""
    from torch._inductor.compile_fx import compile_fx as inductor

    return inductor(gm, example_inputs)


def compiler_bisector() -> Any:
    """PyTorch's CompilerBisector (`torch._inductor.compiler_bisector`): the backend, subsystem and
    pass application that first makes a compiled graph's outputs non-finite."""
    from torch._inductor.compiler_bisector import CompilerBisector

    return CompilerBisector


def bisect_setting(backend: str, subsystem: str) -> Any:
    """The bisector's subsystem when it is a setting (a ConfigChange: `config_name`, `config_field`,
    `config_value`), None when it counts pass applications: the setting names each side."""
    from torch._inductor.compiler_bisector import BACKENDS, ConfigChange

    change = next((s for s in BACKENDS.get(backend, []) if s.name == subsystem), None)
    return change if isinstance(change, ConfigChange) else None


# -- FX ------------------------------------------------------------------------------------------


def fx_import_block(globals_: dict[str, Any], importer: Any) -> str:
    """The import lines a GraphModule's generated code needs for its globals (torch.fx's own, as it
    writes when it saves a module): a graph reproducer's graph.py runs without fpdoctor."""
    from torch.fx.graph_module import _format_import_block

    return _format_import_block(globals_, importer)


# -- read directly -------------------------------------------------------------------------------

# name -> (an object of the kind that has it, why it is read directly)
READ_DIRECTLY: dict[str, str] = {
    "Tensor._base": "a view's base: values and names of a view are its base's (tracer, provenance, audit)",
    "Tensor._version": "the in-place write counter: whether a tensor changed since it was seen, without a read",
    "Tensor._values": "a sparse gradient's stored values: checked for NaN without densifying",
    "Tensor._has_symbolic_sizes_strides": "a symbolic size is never read (it would add a guard under Dynamo)",
    "OpOverload._schema": "an op's arguments and whether it writes in place, per op the first time it runs",
    "Node._sequence_nr": "the number of the autograd node running in backward, matched with its forward op",
}


def read_directly_examples() -> Iterator[tuple[str, Any]]:
    """(READ_DIRECTLY key, an object that must have the attribute): the test's proof."""
    t = torch.ones(2, requires_grad=True)
    y = t * 2
    yield "Tensor._base", y[:1]
    yield "Tensor._version", t
    yield "Tensor._values", torch.ones(2).to_sparse()
    yield "Tensor._has_symbolic_sizes_strides", t
    yield "OpOverload._schema", torch.ops.aten.add.Tensor
    yield "Node._sequence_nr", y.grad_fn
