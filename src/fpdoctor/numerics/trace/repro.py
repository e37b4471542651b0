"""A standalone reproducer of one aten op, to send to whoever maintains it.

DIR gets repro.py (repro_script.py's text: torch only, no fpdoctor), repro.json (the op, its
non-tensor arguments, each tensor's shape, strides, dtype and range, the device, the non-finite
values it made, the machine's facts) and the inputs' values: inputs.safetensors where safetensors
is installed, else inputN.bin, raw little-endian bytes read back with torch.frombuffer (never a
pickle). Inputs above `limit` bytes in all are described, not saved: repro.py then calls the op
with seeded random values in the recorded ranges. A crash reproducer (the op in flight when a
process died) has shapes, dtypes and the device only, and its tensors are always seeded.
fpdoctor runs repro.py once in a fresh interpreter and reads its last line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from fpdoctor.errors import InputError
from fpdoctor.numerics.engine.reruns import whose

LIMIT = 64 * 1024 * 1024  # bytes of input values saved; above, shapes and a seed
SEED = 1234
MARKER = ".fpdoctor-repro"  # a directory holding it is ours to overwrite
_OURS = ("repro.py", "repro.json", "inputs.safetensors", MARKER)
RUN_TIMEOUT_S = 120.0


class Unscriptable(Exception):
    """An op a fresh interpreter cannot call from what was recorded: it is named, not scripted."""


def check_dir(path: str) -> str:
    """The absolute directory a reproducer may be written to; InputError (one line) otherwise."""
    target = os.path.abspath(path)
    if os.path.exists(target):
        if not os.path.isdir(target):
            raise InputError(f"--repro {path}: exists and is not a directory; give a new or empty directory")
        entries = os.listdir(target)
        if entries and MARKER not in entries:
            raise InputError(
                f"--repro {path}: a directory fpdoctor did not write, and not empty; give a new or empty directory"
            )
        if not os.access(target, os.W_OK | os.X_OK):
            raise InputError(f"--repro {path}: not writable; give a directory you can write")
        return target
    parent = os.path.dirname(target)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--repro {path}: cannot be created ({parent} is not writable); give a writable directory")
    return target


def prepare(target: str, also: tuple[str, ...] = ()) -> Path:
    """DIR made, with what an earlier reproducer left there (our files and `also`) removed."""
    directory = Path(target)
    directory.mkdir(parents=True, exist_ok=True)
    for entry in directory.iterdir():  # what an earlier reproducer left
        if entry.name in _OURS or entry.name in also or (entry.name.startswith("input") and entry.suffix == ".bin"):
            entry.unlink()
    (directory / MARKER).write_text("written by fpdoctor\n", encoding="utf-8")
    return directory


def save_values(directory: Path, spec: dict[str, Any], values: dict[int, Any]) -> None:
    """The tensors `values` (contiguous, on the CPU) saved as safetensors, else as raw bytes
    (never a pickle); `spec["format"]` says which."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        spec["format"] = "raw"
        import torch

        for i, t in values.items():
            (directory / f"input{i}.bin").write_bytes(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        spec["format"] = "safetensors"
        save_file({f"input{i}": t for i, t in values.items()}, str(directory / "inputs.safetensors"))


def overload_of(func: Any) -> str:
    """`aten.addmm.default` from an OpOverload or from the breadcrumbs' `aten::addmm`."""
    text = str(func)
    namespace, sep, rest = text.partition("::")
    if sep:
        text = f"{namespace}.{rest}" if "." in rest else f"{namespace}.{rest}.default"
    return text


def scriptable(op: str) -> str | None:
    """Why a fresh interpreter with torch alone cannot call `op`, or None when it can."""
    if op.count(".") != 2:
        return f"{op} is not an aten overload name"
    if op.split(".", maxsplit=1)[0] != "aten":
        return f"{op} is not an aten op ({whose(op)}): named, not scripted"
    return None


def machine_facts() -> dict[str, Any]:
    """The facts that decide which kernel runs: small, and read from torch only if it is loaded."""
    facts: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    torch = sys.modules.get("torch")
    if torch is None:
        from importlib import metadata

        with contextlib.suppress(metadata.PackageNotFoundError):
            facts["torch"] = metadata.version("torch")
        return facts
    facts["torch"] = torch.__version__
    facts["cuda"] = torch.version.cuda
    try:
        facts["cudnn"] = torch.backends.cudnn.version()
        facts["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        facts["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
        facts["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name()
            facts["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    except Exception as exc:  # a fact that cannot be read is said, not fatal
        facts["error"] = f"{type(exc).__name__}: {exc}"
    return facts


def _encode(value: Any, tensors: list[Any]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"$tensor": len(tensors) - 1}
    if isinstance(value, (list, tuple)):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"$float": str(value)}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    if isinstance(value, torch.layout):
        return {"$layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"$memory_format": str(value).removeprefix("torch.")}
    raise Unscriptable(f"an argument of type {type(value).__name__} cannot be written down")


def _range(t: Any) -> tuple[float | None, float | None]:
    import torch

    if t.numel() == 0 or t.dtype is torch.bool or t.dtype.is_complex:
        return None, None
    finite = t.detach()
    if t.dtype.is_floating_point:
        finite = finite[torch.isfinite(finite)]
        if finite.numel() == 0:
            return None, None
    lo, hi = torch.aminmax(finite.reshape(-1).to(torch.float64 if t.dtype.is_floating_point else torch.int64))
    return float(lo), float(hi)


def counts_of(out: Any) -> list[dict[str, int]]:
    """How many NaN, +Inf and -Inf each floating output holds."""
    import torch

    found = []
    for t in out if isinstance(out, (list, tuple)) else [out]:
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            d = t.detach()
            found.append({
                "nan": int(torch.isnan(d).sum()),
                "+inf": int((d == math.inf).sum()),
                "-inf": int((d == -math.inf).sum()),
            })  # fmt: skip
    return found


class Capture:
    """An op's inputs taken at dispatch, the moment its output is known non-finite: copied to the
    host while they are alive (later ops may free or overwrite them). Values past `limit` bytes
    in all, and values the op wrote in place (they hold its result now), are described only."""

    def __init__(self, func: Any, args: Any, kwargs: Any, *, out: Any, written: Any, limit: int = LIMIT) -> None:

        from fpdoctor.torchprivate import DisableTorchDispatch

        self.op = overload_of(func)
        self.why_not = scriptable(self.op)
        self.expected = counts_of(out)
        self.tensors: list[Any] = []
        self.args: Any = None
        self.kwargs: Any = None
        self.values: dict[int, Any] = {}
        self.meta: list[dict[str, Any]] = []
        self.device = "cpu"
        if self.why_not is not None:
            return
        found: list[Any] = []
        try:
            self.args = _encode(list(args), found)
            self.kwargs = {k: _encode(v, found) for k, v in (kwargs or {}).items()}
        except Unscriptable as exc:
            self.why_not = f"{self.op}: {exc}"
            return
        total = sum(t.numel() * t.element_size() for t in found)
        with DisableTorchDispatch():  # our own copies are not the user's ops
            for i, t in enumerate(found):
                lo, hi = _range(t)
                overwritten = any(t is w for w in written)
                meta = {
                    "shape": list(t.shape),
                    "stride": list(t.stride()),
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "min": lo,
                    "max": hi,
                    "saved": total <= limit and not overwritten,
                }
                if overwritten:
                    meta["note"] = "written in place by the op: its values before the op were not kept"
                if meta["saved"]:
                    self.values[i] = t.detach().to("cpu", copy=True).contiguous()
                self.meta.append(meta)
        if found:
            self.device = str(found[0].device)
        self.total = total
        self.limit = limit


def write(target: str, spec: dict[str, Any], values: dict[int, Any]) -> Path:
    """DIR/repro.py, repro.json and the saved values; returns DIR."""
    directory = prepare(target)
    if values:
        save_values(directory, spec, values)
    spec["byteorder"] = "little"
    (directory / "repro.json").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
    script = Path(__file__).with_name("repro_script.py").read_text(encoding="utf-8")
    (directory / "repro.py").write_text(script, encoding="utf-8")
    return directory


def write_capture(target: str, capture: Capture, where: dict[str, Any]) -> Path:
    spec: dict[str, Any] = {
        "op": capture.op,
        "device": capture.device,
        "args": capture.args,
        "kwargs": capture.kwargs,
        "tensors": capture.meta,
        "seed": SEED,
        "expected": capture.expected,
        "where": where,
        "values_saved": len(capture.values) == len(capture.meta),
        "limit_bytes": capture.limit,
        "input_bytes": capture.total,
        "facts": machine_facts(),
    }
    return write(target, spec, capture.values)


def write_crash(target: str, op: dict[str, Any], signal: str) -> tuple[Path | None, str]:
    """A reproducer of the op a process had in flight when `signal` killed it, from its
    breadcrumbs: shapes, dtypes and device, seeded values, scalar arguments at their defaults.
    Returns (DIR or None, what was done)."""
    name = overload_of(op.get("op") or "?")
    why_not = scriptable(name)
    shapes = op.get("shapes") or []
    if why_not is None and any(d < 0 for s in shapes for d in s):
        why_not = f"{name}: a dimension was not recorded (symbolic, or past the first 24)"
    if why_not is None and (op.get("tensors") or 0) > len(shapes):
        why_not = f"{name} had {op['tensors']} tensor arguments; the breadcrumbs keep the first {len(shapes)}"
    if why_not is not None:
        return None, why_not
    tensors = [
        {"shape": list(s), "stride": None, "dtype": d} for s, d in zip(shapes, op.get("dtypes") or [], strict=False)
    ]
    spec = {
        "op": name,
        "device": op.get("device") or "cpu",
        "args": None,  # not recorded: the tensors in schema order, the other arguments at their defaults
        "tensors": tensors,
        "seed": SEED,
        "expected": None,
        "crash": signal,
        "where": {"module": op.get("module"), "phase": op.get("phase")},
        "values_saved": False,
        "facts": machine_facts(),
    }
    directory = write(target, spec, {})
    return directory, f"{name} with the recorded shapes and dtypes, seeded values"


def rerun_commands(directory: Path) -> list[str]:
    """The exact commands that run the reproducer under compute-sanitizer and with cuBLASLt's log."""
    script = shlex.quote(str(directory / "repro.py"))
    python = shlex.quote(sys.executable)
    log = shlex.quote(str(directory / "cublaslt.log"))
    return [
        f"compute-sanitizer --tool memcheck {python} {script}",
        f"CUBLASLT_LOG_LEVEL=5 CUBLASLT_LOG_FILE={log} {python} {script}",
    ]


def run_once(directory: Path, timeout: float = RUN_TIMEOUT_S) -> dict[str, Any]:
    """Run DIR/repro.py in a fresh interpreter (fpdoctor's run instrumentation left out) and
    read what it said: {"reproduced", "message", "exit", ...}."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FPDOCTOR_")}
    try:
        done = subprocess.run(
            [sys.executable, str(directory / "repro.py")],
            cwd=str(directory),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"reproduced": False, "exit": None, "message": f"repro.py ran past {timeout:g} s and was stopped"}
    result: dict[str, Any] = {"exit": done.returncode}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
            break
    else:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        result.update(reproduced=False, message=f"repro.py exited {done.returncode}: {tail[:300]}")
    if done.returncode < 0:  # died of a signal: a crash reproducer reproduces this way
        import signal

        result["signal"] = signal.Signals(-done.returncode).name
        result["message"] = f"repro.py died of {result['signal']}"
    return result
