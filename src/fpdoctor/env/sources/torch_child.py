"""Runs in a child interpreter: import torch, make it load its CUDA libraries, report as JSON.

Isolated because `import torch` can fail (missing shared library, NumPy ABI) or kill the
process (SIGILL, or SIGFPE inside cuBLAS once a GEMM runs), and because the caller's process
must never initialise CUDA (ARCHITECTURE.md, contract 3). Facts are printed after each stage, so a crash in a
later stage still leaves what was learnt before it. Standard library and torch only.
"""

from __future__ import annotations

import json
import os
import platform
import re
import sys
import traceback
import warnings
from typing import Any

MARKER = "FPDOCTOR-TORCH-FACTS:"


def spawn(force_load: bool = True) -> Any:
    """Start this file as a child interpreter (parent side). Run as a script, not with -m, so the
    child never imports the fpdoctor package and starts importing torch as early as possible."""
    import subprocess

    argv = [sys.executable, os.path.abspath(__file__)]
    if not force_load:
        argv.append("--no-force-load")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def emit(facts: dict[str, Any]) -> None:
    sys.stdout.write(MARKER + json.dumps(facts, default=str) + "\n")
    sys.stdout.flush()


def mapped_libraries() -> list[str]:
    """Every shared object mapped into this process, from /proc/self/maps (Linux only)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return []
    paths: dict[str, None] = {}
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and ".so" in parts[5]:
            paths[parts[5].strip()] = None
    return list(paths)


def _try(facts: dict[str, Any], key: str, fn: Any) -> None:
    try:
        facts[key] = fn()
    except Exception as exc:
        facts.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"


def collect(force_load: bool) -> None:
    facts: dict[str, Any] = {"import": "failed", "stage": "import"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            import torch
        except ModuleNotFoundError as exc:
            if exc.name == "torch":
                facts["import"] = "absent"
            facts["error"] = f"{type(exc).__name__}: {exc}"
            facts["traceback"] = traceback.format_exc()[-6000:]
            emit(facts)
            return
        except BaseException as exc:
            facts["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            facts["traceback"] = traceback.format_exc()[-6000:]
            facts["warnings"] = [str(w.message) for w in caught]
            emit(facts)
            return
        facts.update(
            {
                "import": "ok",
                "stage": "build",
                "version": torch.__version__,
                "cuda": torch.version.cuda,
                "hip": getattr(torch.version, "hip", None),
                "debug": bool(torch.version.debug),
                "location": os.path.dirname(torch.__file__),
                "python": platform.python_version(),
            }
        )
        _try(facts, "arch_list", lambda: list(torch.cuda.get_arch_list()))
        _try(facts, "cudnn", torch.backends.cudnn.version)
        _try(facts, "nccl", lambda: ".".join(map(str, torch.cuda.nccl.version())) if torch.version.cuda else None)
        _try(facts, "precision", _precision)
        _try(facts, "numpy", _numpy_interop)
        facts["warnings"] = [str(w.message) for w in caught]
        emit(facts)

        facts["stage"] = "cuda-init"
        _try(facts, "cuda_available", torch.cuda.is_available)
        if facts.get("cuda_available"):
            _try(
                facts,
                "devices",
                lambda: [
                    {
                        "index": i,
                        "name": torch.cuda.get_device_name(i),
                        "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(i)),
                    }
                    for i in range(torch.cuda.device_count())
                ],
            )
        facts["warnings"] = [str(w.message) for w in caught]
        emit(facts)

        if force_load and facts.get("cuda_available"):
            # One tiny GEMM and one convolution make torch dlopen cuBLAS/cuBLASLt and cuDNN,
            # which it otherwise loads lazily; only then does /proc/self/maps show them.
            facts["stage"] = "force-load"
            emit(facts)
            _try(
                facts,
                "forced_gemm",
                lambda: float((torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")).sum()),
            )
            if torch.backends.cudnn.is_available():
                _try(
                    facts,
                    "forced_conv",
                    lambda: float(
                        torch.nn.functional.conv2d(
                            torch.ones(1, 1, 8, 8, device="cuda"), torch.ones(1, 1, 3, 3, device="cuda")
                        ).sum()
                    ),
                )
            torch.cuda.synchronize()
        facts["mapped"] = mapped_libraries()
        facts["warnings"] = [str(w.message) for w in caught]
        # Last, and said first: the facts above stand if reading the dispatcher fails.
        facts["stage"] = "registrations"
        emit(facts)
        _try(facts, "registrations", startup_registrations)
        facts["stage"] = "done"
        emit(facts)


# The math flags a fresh process on this machine starts with: torch's defaults as the environment
# variables (TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, PYTORCH_TUNABLEOP_ENABLED, ...) leave them. Each is
# read on its own, so one that this torch does not have leaves the others. None of them starts CUDA.
_FLAGS: dict[str, Any] = {
    "float32_matmul_precision": lambda t: t.get_float32_matmul_precision(),
    "matmul_allow_tf32": lambda t: t.backends.cuda.matmul.allow_tf32,
    "cudnn_allow_tf32": lambda t: t.backends.cudnn.allow_tf32,
    "fp32_precision": lambda t: t.backends.fp32_precision,
    "matmul_fp32_precision": lambda t: t.backends.cuda.matmul.fp32_precision,
    "cudnn_fp32_precision": lambda t: t.backends.cudnn.fp32_precision,
    "cudnn_conv_fp32_precision": lambda t: t.backends.cudnn.conv.fp32_precision,
    "cudnn_rnn_fp32_precision": lambda t: t.backends.cudnn.rnn.fp32_precision,
    "fp16_reduced_precision_reduction": lambda t: t.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
    "bf16_reduced_precision_reduction": lambda t: t.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    "fp16_accumulation": lambda t: t.backends.cuda.matmul.allow_fp16_accumulation,
    "deterministic_algorithms": lambda t: t.are_deterministic_algorithms_enabled(),
    "deterministic_warn_only": lambda t: t.is_deterministic_algorithms_warn_only_enabled(),
    "fill_uninitialized_memory": lambda t: _deterministic(t).fill_uninitialized_memory,
    "cudnn_deterministic": lambda t: t.backends.cudnn.deterministic,
    "cudnn_benchmark": lambda t: t.backends.cudnn.benchmark,
    "preferred_blas_library": lambda t: str(t.backends.cuda.preferred_blas_library()),
    # CPU builds have no TunableOp; torch.cuda.tunable reads its settings without starting CUDA
    "tunableop": lambda t: t.cuda.tunable.is_enabled() if t.version.cuda or getattr(t.version, "hip", None) else None,
}


# Where torch's own C++ registrations were compiled from (its build tree, wherever it was built).
_TORCH_SOURCES = ("aten/src/", "torch/csrc/", "c10/", "caffe2/", "functorch/")
_FILES = re.compile(r"registered at (\S+?):\d")


def _torchprivate() -> Any:
    """fpdoctor's one module of torch's private names, loaded by its path: this child imports no
    fpdoctor package (see spawn), and that module needs torch alone."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "torchprivate.py")
    spec = importlib.util.spec_from_file_location("fpdoctor_torchprivate", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def startup_registrations() -> list[dict[str, Any]]:
    """The ops and kernels the dispatcher holds that torch did not register: made by code that ran
    before this script's first line (a sitecustomize or usercustomize, a .pth file's import, a
    backend plug-in torch loads by entry point), since this script imports nothing but torch.
    Each: the op, what was done (defines: a new op; overrides: a kernel that replaced torch's for
    that dispatch key; adds: a kernel for a key torch had none for), the key, the file and line,
    and the module of that file when one is loaded."""
    import torch

    private = _torchprivate()
    own = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    seen: dict[str, bool] = {}  # file -> torch's own; ~25,000 registrations name a few hundred files
    # Directories whose files are torch's (its package, its build tree), none inside another: an op
    # whose every "registered at" is under one of them is passed over by counting, without parsing.
    roots = {own}

    def torchs(file: str) -> bool:
        if file not in seen:
            if file.endswith(".py"):
                seen[file] = os.path.abspath(file).startswith(own)
            else:
                at = min((file.find(part) for part in _TORCH_SOURCES if part in file), default=-1)
                seen[file] = at >= 0
                root = file[:at]
                if at > 0 and not any(root.startswith(r) for r in roots):
                    roots.difference_update([r for r in roots if r.startswith(root)])
                    roots.add(root)
        return seen[file]

    modules = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and not file.startswith(own):
            modules[os.path.abspath(file)] = name
    found: list[dict[str, Any]] = []
    for op in private.dispatcher_ops():
        text = private.dispatcher_dump(op)
        made = text.count("registered at ")
        if made == sum(text.count("registered at " + root) for root in roots):
            continue
        # Parsed only when a file is not under a known root: parsing every op's text took 0.5 s on a
        # 2-core CPU, the dumps alone 0.08 s.
        if all(torchs(file) for file in _FILES.findall(text)):
            continue
        rows = private.registrations(op, text)
        replaced = {key for key, _, _, active in rows if not active}
        for key, file, line, active in rows:
            if not active or torchs(file):
                continue
            kind = "defines" if key == "debug" else "overrides" if key in replaced else "adds"
            entry = {"op": op, "kind": kind, "key": None if key == "debug" else key, "file": file, "line": line}
            if os.path.abspath(file) in modules:
                entry["module"] = modules[os.path.abspath(file)]
            found.append(entry)
    # torch.library.custom_op makes its Library inside torch: the dispatcher names torch's file, the
    # op's function says whose it is.
    listed = {e["op"] for e in found if e["kind"] == "defines"}
    for op, (file, line) in private.custom_op_defs().items():
        if op not in listed and not torchs(file):
            entry = {"op": op, "kind": "defines", "key": None, "file": file, "line": line}
            if os.path.abspath(file) in modules:
                entry["module"] = modules[os.path.abspath(file)]
            found.append(entry)
    return found


def _deterministic(torch: Any) -> Any:
    import torch.utils.deterministic

    return torch.utils.deterministic


def _precision() -> dict[str, Any]:
    import torch

    flags: dict[str, Any] = {}
    for key, read in _FLAGS.items():
        try:
            value = read(torch)
        except Exception:  # an older torch without that flag: unknown, not a failure
            continue
        if value is not None:
            flags[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return flags


def _numpy_interop() -> dict[str, Any]:
    import torch

    try:
        import numpy
    except ImportError:
        return {"version": None, "interop": "numpy not installed"}
    try:
        torch.from_numpy(numpy.zeros(2)).sum()
        interop = "ok"
    except Exception as exc:
        interop = f"{type(exc).__name__}: {exc}"
    return {"version": numpy.__version__, "interop": interop}


if __name__ == "__main__":
    collect(force_load="--no-force-load" not in sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: tearing down an interpreter that imported torch takes
    # ~0.4 s on a 2-core CPU, and this throwaway process has nothing left to clean up.
    os._exit(0)
