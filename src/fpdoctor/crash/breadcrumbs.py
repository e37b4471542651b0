"""Breadcrumbs: the aten ops a process had in flight when it died, read back by its parent.

`fpdoctor run --breadcrumbs` arms this module in every Python process it starts. Nothing
happens until the process imports torch (an import hook waits for it; a process that never does
pays one string comparison per import and gets no file). From then on every aten op the
process dispatches is written, as it starts, into a ring of fixed-size slots in a file mapped
MAP_SHARED, `crumbs.<pid>` in the run directory, and marked done when it returns. The stores
land in the page cache, which the kernel keeps when the process dies by a signal, so nothing
needs flushing: the op that was running when SIGFPE hit reads as started, not finished.

Ops are seen through a TorchDispatchMode pushed for good on the thread that imported torch and
on every thread started afterwards: it sees the aten ops of forward, of backward (autograd's
worker threads inherit the mode) and of the optimizer, below autocast and composite
decompositions, i.e. the calls that reach the kernels. Module paths come from the global module
forward hooks (dotted as in `named_modules()` of the first module called); a backward op is
given the module of the forward op that created its autograd node; the phase is backward while
autograd runs a graph, optimizer between the global optimizer step hooks, forward otherwise.
torch.compile'd code keeps compiling (the mode asks to be off while dynamo traces, through
TorchDispatchMode.ignore_compile_internals; a torch without it runs compiled functions eagerly
while the mode is on) and the compiled artifact's aten calls are recorded. Threads that were
already running when torch was imported are not recorded. What an op costs is measured by
benchmarks/bench_breadcrumbs.py (benchmarks/README.md): off by default for that reason.

File layout, little-endian (one writer: the process; any number of readers):
  header, 64 bytes: magic, version, slot size, slot count, names offset, names capacity, pid
  slots, SLOTS x 256 bytes: sequence number, state (started/done/raised), phase, tensors
      recorded and seen, name ids of op, module and device, thread id, four dtype name ids,
      four ranks, 24 dims of the recorded tensors one after the other (-1: not recorded),
      the sequence number again
  names: entries [u16 length][utf-8]; a name id is the entry's offset in this region + 1 (0: none;
      the root module's name is "", as in named_modules())
A slot counts when its two sequence numbers agree, so a slot torn by the death reads as absent;
the reader orders slots by sequence number (the ring holds its own order, no index to trust).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import mmap
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from fpdoctor.imports import after_import

MAGIC = b"FPDCRMB1"
VERSION = 1
SLOTS = 4096  # 1 MiB per process: a few steps of a small model, the last backward of a large one
SLOT_SIZE = 256
NAMES_CAPACITY = 256 * 1024
MAX_TENSORS = 4  # tensor arguments recorded per op (addmm: bias, input, weight)
MAX_DIMS = 24  # dims of the recorded tensors, one after the other
UNKNOWN_DIM = -1  # a symbolic size (while tracing) or a dimension past MAX_DIMS

_HEADER = struct.Struct("<8sIIIIIII")  # magic, version, slot size, slots, names offset, capacity, pid, reserved
HEADER_SIZE = 64
# seq, state, phase, recorded, seen, op, module, device, thread, 4 dtypes, 4 ranks, 24 dims, seq
_SLOT = struct.Struct("<QBBBBIIIQ4I4B4x24qQ")
_NAME_LEN = struct.Struct("<H")
_SEQ = struct.Struct("<Q")
assert _SLOT.size == SLOT_SIZE

STARTED, DONE, RAISED = 0, 1, 2
_STATE_OFFSET = 8
PHASES = ("forward", "backward", "optimizer")
_PAD = (UNKNOWN_DIM,) * MAX_DIMS
_BY_NODE_MASK = 8191
_ZEROS = (0,) * MAX_TENSORS


def ring_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"crumbs.{pid}")


def _off_path(run_dir: str, pid: int) -> str:
    return os.path.join(run_dir, f"crumbs.{pid}.off")  # why breadcrumbs could not be armed there


# ---------------------------------------------------------------------------------------------
# Library logs


def library_log_env(run_dir: str) -> dict[str, str]:
    """Environment for cuBLASLt's and cuBLAS's own call logs, one file per process in run_dir.

    cuBLASLt level 5 ("API Trace": every API call with its parameters) rather than 2 ("Trace":
    calls that launch kernels): the H20 crash is in the heuristic query
    (cublasLtMatmulAlgoGetHeuristic -> cublasLtMatmulAlgoCheck, vllm#2798, NeMo#8505), before
    any kernel launches, so at level 2 the last line would be the previous matmul. cuBLASLt
    replaces %i in CUBLASLT_LOG_FILE with the process id (cuBLAS guide, "cuBLASLt Logging");
    the legacy cuBLAS log (CUBLAS_LOGINFO_DBG/CUBLAS_LOGDEST_DBG: cublasGemmEx and friends,
    which torch's matmuls call and which reach cuBLASLt internally) documents no such pattern,
    so arm() writes each Python process's own pid into it before any library loads. Both logs
    write a few lines per BLAS call: they are for the re-run that catches a crash, not for
    every run.
    """
    return {
        "CUBLASLT_LOG_LEVEL": "5",
        "CUBLASLT_LOG_FILE": os.path.join(run_dir, "cublaslt.%i.log"),
        "CUBLAS_LOGINFO_DBG": "1",
        "CUBLAS_LOGDEST_DBG": os.path.join(run_dir, "cublas.%i.log"),
    }


def library_log_tail(run_dir: str, pid: int, lines: int = 20) -> list[str]:
    """The last lines of that process's cuBLAS log, then of its cuBLASLt log ([] when neither exists).

    cuBLASLt's last: the last line is then the deepest call logged before the death.
    """
    tail: list[str] = []
    for name in (f"cublas.{pid}.log", f"cublaslt.{pid}.log"):
        tail += _tail_lines(os.path.join(run_dir, name), lines)
    return tail


def _tail_lines(path: str, lines: int, max_bytes: int = 64 * 1024) -> list[str]:
    if lines <= 0:
        return []
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - max_bytes))
            data = fh.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]  # the first line read is cut
    return [line for line in text if line.strip()][-lines:]


# ---------------------------------------------------------------------------------------------
# Reading a ring


def read(run_dir: str, pid: int) -> list[dict[str, Any]]:
    """The ops that process recorded, oldest first; [] when it left no ring or an unreadable one.

    Each: {"op": "aten::addmm", "module": "encoder.0.fc" or None, "shapes": [[8, 64], ...],
    "dtypes": ["float16", ...], "device": "cuda:0" or None, "thread": <threading ident, as
    faulthandler prints it>, "seq": n, "phase": "forward", "done": False while in flight,
    "raised": True when the op ended by raising, "tensors": how many tensor arguments it had}.
    Shapes and dtypes list the first four tensor arguments in argument order; a dimension that
    was not recorded (symbolic while tracing, or past the first 24 of the op) reads -1. Every
    thread's ops are in one list: a process has one op in flight per thread that was in one.
    """
    try:
        with open(ring_path(run_dir, pid), "rb") as fh:
            data = fh.read()
    except OSError:
        return []
    return parse(data)


def parse(data: bytes) -> list[dict[str, Any]]:
    """The ops of one ring file's bytes (see the module docstring), oldest first."""
    if len(data) < HEADER_SIZE:
        return []
    magic, version, slot_size, slots, names_offset, capacity, _pid, _ = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or slot_size != SLOT_SIZE:
        return []
    names = _Names(data, names_offset, min(capacity, max(0, len(data) - names_offset)))
    ops = []
    for index in range(slots):
        offset = HEADER_SIZE + index * SLOT_SIZE
        if offset + SLOT_SIZE > len(data):
            break
        values = _SLOT.unpack_from(data, offset)
        seq = values[0]
        if seq == 0 or seq != values[-1]:
            continue  # never written, or torn
        state, phase, recorded, seen, op, module, device, thread = values[1:9]
        dtypes = values[9:13]
        ranks = values[13:17]
        dims = values[17:41]
        recorded = min(recorded, MAX_TENSORS)
        shapes = []
        at = 0
        for rank in ranks[:recorded]:
            shape = list(dims[at : at + rank])
            shapes.append(shape + [UNKNOWN_DIM] * (rank - len(shape)))  # dims past the first 24
            at += rank
        ops.append(
            {
                "op": names.get(op) or "?",
                "module": names.get(module),
                "shapes": shapes,
                "dtypes": [names.get(d) or "?" for d in dtypes[:recorded]],
                "device": names.get(device),
                "thread": thread,
                "seq": seq,
                "phase": PHASES[phase] if phase < len(PHASES) else "?",
                "done": state != STARTED,
                "raised": state == RAISED,
                "tensors": seen,
            }
        )
    ops.sort(key=lambda op: op["seq"])
    return ops


class _Names:
    def __init__(self, data: bytes, offset: int, size: int) -> None:
        self._data = data
        self._offset = offset
        self._size = size
        self._cache: dict[int, str | None] = {}

    def get(self, name_id: int) -> str | None:
        if name_id == 0:
            return None
        if name_id not in self._cache:
            self._cache[name_id] = self._decode(name_id - 1)
        return self._cache[name_id]

    def _decode(self, at: int) -> str | None:
        if at < 0 or at + _NAME_LEN.size > self._size:
            return None
        (length,) = _NAME_LEN.unpack_from(self._data, self._offset + at)
        start = self._offset + at + _NAME_LEN.size
        if at + _NAME_LEN.size + length > self._size:
            return None
        return self._data[start : start + length].decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# Writing a ring


class _Ring:
    """One process's ring file, mapped shared; ops and names are written straight into it."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.names_offset = HEADER_SIZE + SLOTS * SLOT_SIZE
        self.names_used = 0
        self.map = self._open()

    def _open(self) -> mmap.mmap:
        self.pid = os.getpid()
        size = self.names_offset + NAMES_CAPACITY
        fd = os.open(ring_path(self.run_dir, self.pid), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, size)
            ring_map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)  # the mapping keeps the file
        _HEADER.pack_into(ring_map, 0, MAGIC, VERSION, SLOT_SIZE, SLOTS, self.names_offset, NAMES_CAPACITY, self.pid, 0)
        return ring_map

    def reopen_in_child(self) -> None:
        """After fork: a file of the child's own (the inherited mapping is the parent's ring).

        The child keeps the parent's name ids, so the names they point to are copied over.
        """
        old = self.map
        new = self._open()
        start, end = self.names_offset, self.names_offset + self.names_used
        new[start:end] = old[start:end]
        self.map = new
        old.close()

    def add_name(self, text: str) -> int:
        """Append a name; its id, or 0 when the region is full."""
        raw = text.encode("utf-8", errors="replace")[:1024]
        at = self.names_used
        if at + _NAME_LEN.size + len(raw) > NAMES_CAPACITY:
            return 0
        start = self.names_offset + at
        self.map[start + _NAME_LEN.size : start + _NAME_LEN.size + len(raw)] = raw
        _NAME_LEN.pack_into(self.map, start, len(raw))
        self.names_used = at + _NAME_LEN.size + len(raw)
        return at + 1


class _Recorder:
    """The process-wide state behind the dispatch mode and the module and optimizer hooks.

    Per-thread state (the module stack, the optimizer depth) is kept in dicts keyed by the
    thread's ident, which the op record needs anyway: cheaper than a threading.local.
    """

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.ring = _Ring(run_dir)
        self.counter = itertools.count(1)
        self.lock = threading.Lock()  # for names only: slots are claimed by the counter
        self.names: dict[str, int] = {}
        self.texts: dict[int, str] = {}
        self.ops: dict[Any, int] = {}
        self.dtypes: dict[Any, int] = {}
        self.devices: dict[Any, int] = {}
        self.stacks: dict[int, list[int]] = {}  # thread -> module name ids, innermost last
        self.optimizer: dict[int, int] = {}  # thread -> optimizer.step() depth
        # autograd node sequence number -> module name id of the forward op that created it
        self.by_node: list[tuple[int, int]] = [(-1, 0)] * (_BY_NODE_MASK + 1)
        self.module_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.have_root = False
        import torch

        self.compiling = torch.compiler.is_compiling

    def reopen_in_child(self) -> None:
        self.lock = threading.Lock()  # another thread may have held it at the fork
        ident = threading.get_ident()
        self.stacks = {ident: self.stacks.get(ident, [])}  # only the forking thread lives on
        self.optimizer = {ident: self.optimizer.get(ident, 0)}
        self.ring.reopen_in_child()

    # names -----------------------------------------------------------------------------------
    def name_id(self, text: str) -> int:
        found = self.names.get(text)
        if found is not None:
            return found
        with self.lock:
            found = self.names.get(text)
            if found is None:
                found = self.names[text] = self.ring.add_name(text)
                self.texts[found] = text
        return found

    def op_id(self, func: Any) -> int:
        found = self.ops.get(func)
        if found is None:
            name = func.name() if hasattr(func, "name") else str(func)
            found = self.ops[func] = self.name_id(name)
        return found

    def dtype_id(self, dtype: Any) -> int:
        found = self.dtypes.get(dtype)
        if found is None:
            found = self.dtypes[dtype] = self.name_id(str(dtype).replace("torch.", ""))
        return found

    def device_id(self, device: Any) -> int:
        found = self.devices.get(device)
        if found is None:
            found = self.devices[device] = self.name_id(str(device))
        return found

    # modules ---------------------------------------------------------------------------------
    def module_name(self, module: Any, stack: list[int]) -> str:
        name = self.module_names.get(module)
        if name is not None:
            return name
        if stack:
            # A module built or called ad hoc inside another one's forward.
            name = f"{self.texts.get(stack[-1], '')}.<{type(module).__name__}>".lstrip(".")
            self.module_names[module] = name
            return name
        # A new top-level module: the first is the root (""), later ones go by class name.
        prefix = type(module).__name__ if self.have_root else ""
        self.have_root = True
        named = module
        from fpdoctor.torchprivate import compiled_inner

        if compiled_inner(module) is not None:  # torch.compile's wrapper: name the model inside it
            self.module_names.setdefault(module, prefix)
            named = compiled_inner(module)
        for sub_name, sub in named.named_modules(prefix=prefix, remove_duplicate=False):
            self.module_names.setdefault(sub, sub_name)
        return self.module_names.get(module, prefix)

    def forward_pre(self, module: Any, args: Any) -> None:
        if self.compiling():
            return
        ident = threading.get_ident()
        stack = self.stacks.get(ident)
        if stack is None:
            stack = self.stacks[ident] = []
        try:
            name = self.name_id(self.module_name(module, stack))
        except Exception:
            name = 0  # unnamed (the observer never raises into the user's forward); the post hook still pops it
        stack.append(name)

    def forward_post(self, module: Any, args: Any, output: Any) -> None:
        if self.compiling():
            return
        stack = self.stacks.get(threading.get_ident())
        if stack:
            stack.pop()

    def optimizer_pre(self, *args: Any) -> None:
        ident = threading.get_ident()
        self.optimizer[ident] = self.optimizer.get(ident, 0) + 1

    def optimizer_post(self, *args: Any) -> None:
        ident = threading.get_ident()
        depth = self.optimizer.get(ident, 0) - 1
        if depth > 0:
            self.optimizer[ident] = depth
        else:
            self.optimizer.pop(ident, None)  # empty dict: the op record's fast path


def _make_begin(recorder: _Recorder) -> Callable[[Any, tuple[Any, ...], Any], tuple[Any, int, int]]:
    """The op record's hot path, with everything it touches bound as locals (see the benchmark).

    Writes the op's slot as started and returns (map, offset, seq) for marking it done.
    """
    import torch

    from fpdoctor.torchprivate import current_autograd_node as current_node
    from fpdoctor.torchprivate import graph_task_id, sequence_nr

    tensor = torch.Tensor
    get_ident = threading.get_ident
    ops, dtypes, devices = recorder.ops, recorder.dtypes, recorder.devices
    op_id, dtype_id, device_id = recorder.op_id, recorder.dtype_id, recorder.device_id
    stacks, optimizer, by_node = recorder.stacks, recorder.optimizer, recorder.by_node
    ring, counter = recorder.ring, recorder.counter
    pack = _SLOT.pack_into
    pad, zeros, mask, slots = _PAD, _ZEROS, _BY_NODE_MASK, SLOTS

    def begin(func: Any, args: tuple[Any, ...], kwargs: Any) -> tuple[Any, int, int]:
        op = ops.get(func) or op_id(func)
        tensors = [a for a in args if isinstance(a, tensor)]
        if len(tensors) != len(args):
            for a in args:  # a list of tensors (cat, stack, foreach ops)
                if type(a) is list or type(a) is tuple:
                    tensors += [t for t in a if isinstance(t, tensor)]
        if kwargs:
            tensors += [a for a in kwargs.values() if isinstance(a, tensor)]
        seen = len(tensors)
        dims: list[int] = []
        kinds: list[int] = []
        ranks: list[int] = []
        for t in tensors[:MAX_TENSORS]:
            kinds.append(dtypes.get(t.dtype) or dtype_id(t.dtype))
            shape = t.shape
            ranks.append(len(shape))
            if t._has_symbolic_sizes_strides:  # never turn a symbolic size into a guard
                dims += pad[: len(shape)]
            else:
                dims += shape
        device = 0
        if seen:
            where = tensors[0].device
            device = devices.get(where) or device_id(where)
            if seen < MAX_TENSORS:
                kinds += zeros[seen:]
                ranks += zeros[seen:]
        else:
            kinds = ranks = zeros  # type: ignore[assignment]
            if kwargs and kwargs.get("device") is not None:  # a factory op: where it allocates
                device = device_id(kwargs["device"])
        if len(dims) < MAX_DIMS:
            dims += pad[len(dims) :]
        elif len(dims) > MAX_DIMS:
            dims = dims[:MAX_DIMS]
        ident = get_ident()
        module = phase = 0
        if graph_task_id() != -1:
            phase = 1  # backward: the module of the forward op that made this autograd node
            node = current_node()
            if node is not None:
                number = node._sequence_nr()
                entry = by_node[number & mask]
                if entry[0] == number:
                    module = entry[1]
        else:
            stack = stacks.get(ident)
            if stack:
                module = stack[-1]
                # Autograd numbered the node for this op just before dispatching it here: the
                # counter is that number + 1 (the first op to see a number owns it).
                number = sequence_nr() - 1
                if by_node[number & mask][0] != number:
                    by_node[number & mask] = (number, module)
            if optimizer and optimizer.get(ident):
                phase = 2
        seq = next(counter)
        ring_map = ring.map
        offset = HEADER_SIZE + (seq % slots) * SLOT_SIZE
        recorded = seen if seen < MAX_TENSORS else MAX_TENSORS
        pack(
            ring_map, offset, seq, STARTED, phase, recorded, min(seen, 255), op, module, device, ident,
            *kinds, *ranks, *dims, seq,
        )  # fmt: skip
        return ring_map, offset, seq

    return begin


def _mode_class(recorder: _Recorder) -> Any:
    from fpdoctor.torchprivate import EagerDispatchMode

    begin = _make_begin(recorder)
    seq_at = _SEQ.unpack_from
    state_at = _STATE_OFFSET

    class BreadcrumbMode(EagerDispatchMode):  # no dynamo disable() wrapper around every op
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            # Off while dynamo traces, on while the compiled code runs: compiled code stays
            # compiled (and bitwise what it would be without fpdoctor) instead of falling back
            # to eager as it does under a mode that wants every op.
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            try:
                ring_map, offset, seq = begin(func, args, kwargs)
            except Exception:
                ring_map = None
            state = RAISED
            try:
                out = func(*args, **kwargs) if kwargs else func(*args)
                state = DONE
                return out
            finally:
                if ring_map is not None:
                    # The ring may have come round to this slot while the op ran (other
                    # threads): mark it only while it is still this op's.
                    try:
                        if seq_at(ring_map, offset)[0] == seq:
                            ring_map[offset + state_at] = state
                    except Exception:
                        pass

    return BreadcrumbMode


# ---------------------------------------------------------------------------------------------
# Arming


class _Armed:
    recorder: _Recorder | None = None
    mode_class: Any = None
    waiting: Any = None  # the import hook while torch is not imported yet
    scoped: ClassVar[dict[str, tuple[_Recorder, Any]]] = {}  # recording()'s, by run_dir


def arm(run_dir: str) -> None:
    """Record every aten op of this process into run_dir once torch is imported; never raises.

    Called by `fpdoctor run --breadcrumbs` in each process it starts. Does not import torch:
    if torch is already imported the ring starts now, otherwise when torch's import finishes.
    """
    try:
        _own_cublas_log()
        if _Armed.recorder is not None or _Armed.waiting is not None:
            return
        if "torch" in sys.modules and getattr(sys.modules["torch"], "Tensor", None) is not None:
            _start(run_dir)
            return
        _Armed.waiting = after_import("torch", functools.partial(_torch_imported, run_dir))
    except Exception as exc:
        _note_off(run_dir, exc)


def _own_cublas_log() -> None:
    """Give this process its own cuBLAS log file (see library_log_env)."""
    dest = os.environ.get("CUBLAS_LOGDEST_DBG", "")
    if "%i" in dest:
        os.environ["CUBLAS_LOGDEST_DBG"] = dest.replace("%i", str(os.getpid()))


def _note_off(run_dir: str, exc: BaseException) -> None:
    with contextlib.suppress(Exception), open(_off_path(run_dir, os.getpid()), "w") as fh:
        fh.write(f"{type(exc).__name__}: {exc}\n")


def _start(run_dir: str) -> None:
    try:
        recorder = _Recorder(run_dir)
        _Armed.recorder = recorder
        _Armed.mode_class = _mode_class(recorder)
        _register_hooks(recorder)
        from fpdoctor.crash import assigned

        assigned.arm()  # where a module of another dtype or device is attached: a mismatch's cause
        _out_of_dynamos_way(run_dir)
        _enter_mode()
        _arm_new_threads()
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork)
    except Exception as exc:
        _note_off(run_dir, exc)


def _out_of_dynamos_way(run_dir: str) -> None:
    """torch.compile must compile what it would without the recorder. While Dynamo traces, the
    module hooks return at once (Recorder.compiling), so it inlines them as nothing; when it runs
    the code around a graph break, it must not compile the recorder's own functions as frames of
    their own: every code object of this module is skipped. torch._dynamo costs seconds to import,
    so this waits for the program to import it."""
    if "torch._dynamo" not in sys.modules:
        after_import("torch._dynamo", _skip_in_dynamo)
        return
    _skip_in_dynamo()


def _skip_in_dynamo() -> None:
    from fpdoctor.numerics.observe import dynamo

    functions = [v for v in list(globals().values()) if getattr(v, "__module__", None) == __name__]
    if _Armed.mode_class is not None:
        functions.append(_Armed.mode_class)
    from fpdoctor.crash import assigned

    functions += [assigned._on_module, assigned._on_tensor]
    dynamo.never_compile(functions)
    dynamo.quiet_wrapper_warning()


def _register_hooks(recorder: _Recorder) -> list[Any]:
    from torch.nn.modules import module as module_mod
    from torch.optim import optimizer as optimizer_mod

    return [
        module_mod.register_module_forward_pre_hook(recorder.forward_pre),
        module_mod.register_module_forward_hook(recorder.forward_post, always_call=True),
        optimizer_mod.register_optimizer_step_pre_hook(recorder.optimizer_pre),
        optimizer_mod.register_optimizer_step_post_hook(recorder.optimizer_post),
    ]


@contextlib.contextmanager
def recording(run_dir: str) -> Iterator[None]:
    """The same recording as arm(), on this thread and only inside the block (benchmarks, tests).

    Blocks with the same run_dir share one ring, crumbs.<pid>: not for a process that is armed.
    """
    scoped = _Armed.scoped.get(run_dir)
    if scoped is None or scoped[0].ring.pid != os.getpid():
        recorder = _Recorder(run_dir)
        scoped = _Armed.scoped[run_dir] = (recorder, _mode_class(recorder))
    recorder, mode_class = scoped
    handles = _register_hooks(recorder)
    try:
        with mode_class():
            yield
    finally:
        for handle in handles:
            handle.remove()


def _enter_mode() -> None:
    """Push the mode on this thread's dispatch-mode stack for the rest of the thread's life."""
    with contextlib.suppress(Exception):
        _Armed.mode_class().__enter__()


def _arm_new_threads() -> None:
    """Push the mode in every thread started from now on (a dispatch mode is per thread).

    threading runs its profile hook in each new thread before the thread's target: ours pushes
    the mode, then hands the thread the hook it would have had (usually none).
    """
    getprofile = getattr(threading, "getprofile", None)  # Python >= 3.10
    previous = getprofile() if getprofile is not None else getattr(threading, "_profile_hook", None)

    def first_event(frame: Any, event: str, arg: Any) -> Any:
        sys.setprofile(previous)
        _enter_mode()
        if previous is not None:
            return previous(frame, event, arg)
        return None

    threading.setprofile(first_event)


def _after_fork() -> None:
    recorder = _Armed.recorder
    if recorder is None:
        return
    try:
        recorder.reopen_in_child()
    except Exception as exc:
        _Armed.recorder = None
        _note_off(recorder.run_dir, exc)


def _torch_imported(run_dir: str) -> None:
    """Start the ring once the program's import of torch is done (see arm)."""
    _Armed.waiting = None
    _start(run_dir)
