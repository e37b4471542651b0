"""The facts of an environment that can change a result or crash, as one declared table.

`fpdoctor env --diff A B` and `compare --against` compare two machines through this table
only: each entry names one fact, how to read it from a facts dict, what a different value does
to the numbers, the source that says so, and how severe a difference is and why. Everything else
two machines differ in (host names, unrelated packages, paths) changes no number and is left out.

A value is read from the input itself (live, a saved facts file, the report's own text) or
inferred (a compute capability from fpdoctor's GPU table, a cuBLAS version from a torch wheel's
pin); a difference in an inferred value is at most a warning, never an error (ARCHITECTURE.md, contract 6).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from fpdoctor.env.facts import Facts
from fpdoctor.env.refdata import RefData
from fpdoctor.env.startup import registration_text, registrations, torch_ops_changed
from fpdoctor.report.model import Severity

E, W, N = Severity.ERROR, Severity.WARNING, Severity.INFO

_TF32_NOTES = "https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices"
_REDUCED = "https://pytorch.org/docs/stable/notes/cuda.html#reduced-precision-reduction-in-fp16-gemms"
_REPRO = "https://pytorch.org/docs/stable/notes/randomness.html"
_CUBLAS_REPRO = "https://docs.nvidia.com/cuda/cublas/#results-reproducibility"
_NCCL_ENV = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html"


@dataclass(frozen=True)
class Seen:
    """One side's value of a fact; `inferred` says how, when it was not read from the input itself."""

    value: Any
    inferred: str | None = None


@dataclass(frozen=True)
class Side:
    """One machine as the table reads it."""

    facts: Facts
    ref: RefData

    @property
    def env_known(self) -> bool:
        """Whether absent variables are known to be unset: the facts were collected on the machine
        (live, or saved from a live run) or recorded with the variables, not pasted from a report."""
        origin = self.facts.raw.get("origin") or {}
        return bool(origin.get("env_complete")) or "live" in (origin.get("kind"), origin.get("collected_as"))


@dataclass(frozen=True, kw_only=True)
class Entry:
    key: str
    label: str
    group: str  # the finding it makes: hardware, build, library, flag, variable
    severity: Severity
    reason: str  # why that severity
    effect: str  # what a different value does to the numbers
    source: str
    read: Callable[[Side], Seen | None]
    covers: tuple[str, ...] = ()  # fact paths (see diff.flatten) it accounts for, kept out of the left-out count


# -- readers -------------------------------------------------------------------------------------


def _listed(values: list[Any]) -> str | None:
    kept = sorted({str(v) for v in values if v not in (None, "")})
    return ", ".join(kept) if kept else None


def _gpu_models(side: Side) -> Seen | None:
    shown = _listed([g.get("name") for g in side.facts.gpus])
    return Seen(shown) if shown else None


def _capabilities(side: Side) -> Seen | None:
    gpus = [g for g in side.facts.gpus if g.get("compute_capability")]
    if not gpus:
        return None
    inferred = next((g["capability_source"] for g in gpus if g.get("capability_source")), None)
    how = f"from the GPU name, {inferred}" if inferred else None
    return Seen(_listed([g["compute_capability"] for g in gpus]), how)


def _driver(side: Side) -> Seen | None:
    text = side.facts.driver_text
    return Seen(text) if text else None


def _torch_version(side: Side) -> Seen | None:
    found = side.facts.torch_version
    return Seen(found.base_version) if found else None


def _torch_build(side: Side) -> Seen | None:
    facts = side.facts
    hip = facts.torch.get("hip")
    if hip:
        build = f"ROCm {hip}"
    elif facts.build_cuda:
        build = f"CUDA {facts.build_cuda}"
    elif facts.cpu_only_build:
        build = "CPU only"
    else:
        return None
    return Seen(build + (", debug" if facts.torch.get("debug") else ""))


def _arch_list(side: Side) -> Seen | None:
    if side.facts.arch_list:
        return Seen(" ".join(side.facts.arch_list))
    tv, variant = side.facts.torch_version, side.facts.variant
    row = side.ref.arch_row(tv, variant) if tv and variant else None
    if row is None:
        return None
    arch = [f"sm_{s}" for s in row.sass] + ([f"compute_{row.ptx}"] if row.ptx else [])
    return Seen(" ".join(arch), f"fpdoctor's table of official torch {row.torch_minor} {row.variant} wheels")


def _cuda_toolkit(side: Side) -> Seen | None:
    found = (side.facts.raw.get("cuda_toolkit") or {}).get("version")
    return Seen(found) if found else None


def _loaded(library: str) -> Callable[[Side], Seen | None]:
    def read(side: Side) -> Seen | None:
        loaded = side.facts.loaded
        known = (side.facts.raw.get("libraries") or {}).get("loaded_known")
        if loaded is None or (isinstance(known, list) and library not in known):
            return None  # a compare record reads only some libraries from its process
        if library == "cudnn" and side.facts.torch.get("cudnn"):
            return Seen(str(side.facts.torch["cudnn"]))  # torch.backends.cudnn.version(): the copy in use
        if library == "nccl" and side.facts.torch.get("nccl"):
            return Seen(str(side.facts.torch["nccl"]))
        return Seen(
            _listed([c.get("version") or "version unknown" for c in loaded if c.get("library") == library])
            or "not loaded"
        )

    return read


def _installed(library: str) -> Callable[[Side], Seen | None]:
    def read(side: Side) -> Seen | None:
        facts = side.facts
        wheels = _listed([w.get("version") for w in facts.wheels if library in (w.get("libraries") or [])])
        if wheels:
            return Seen(wheels)
        tv, variant = facts.torch_version, facts.variant
        if library == "cublas" and tv and variant:
            pinned = side.ref.bundled_cublas(tv, variant)
            if pinned:
                return Seen(str(pinned[0]), f"the pin of torch {facts.torch.get('version')}'s wheel")
        if library == "nccl" and tv and variant and (pin := side.ref.bundled_nccl(tv, variant)):
            return Seen(str(pin), f"the pin of torch {facts.torch.get('version')}'s wheel")
        cuda = facts.build_cuda
        if library in ("cublas", "cudart") and cuda and cuda.major < 11 and not facts.wheels:
            # Before the nvidia-* wheels, torch's wheel carried the toolkit's own cuBLAS and cudart.
            return Seen(f"{cuda}.x", f"the CUDA {cuda} toolkit torch {facts.torch.get('version')} was built with")
        return None

    return read


def _copies(library: str) -> Callable[[Side], Seen | None]:
    """How many different versions of the library are reachable: which one loads depends on the
    loader's search order, so a second version on one machine only is a difference."""

    def read(side: Side) -> Seen | None:
        facts = side.facts
        if facts.origin != "live" and (facts.raw.get("origin") or {}).get("collected_as") != "live":
            return None  # a pasted report lists at most some copies: their number says nothing
        found = [c for c in facts.copies if c.get("library") == library]
        return Seen(_listed([c.get("version") or "version unknown" for c in found]) or "none")

    return read


def _flag(*keys: str, present: Callable[[Any], Any] = lambda v: v) -> Callable[[Side], Seen | None]:
    """A math flag from the facts' `torch.precision` (the first key present), as a fresh process
    on that machine starts with it, or as a compare record's run had it."""

    def read(side: Side) -> Seen | None:
        flags = side.facts.torch.get("precision")
        if not isinstance(flags, dict):
            return None
        for key in keys:
            if flags.get(key) is not None:
                return Seen(present(flags[key]))
        return None

    return read


def _variable(name: str) -> Callable[[Side], Seen | None]:
    def read(side: Side) -> Seen | None:
        env = side.facts.raw.get("env") or {}
        if name in env:
            return Seen(str(env[name]))
        return Seen("unset") if side.env_known else None

    return read


def _registered(which: str) -> Callable[[Side], Seen | None]:
    """The ops registered outside torch before the first line: kernels on torch's own ops
    ("torch"), or ops defined there ("new"); by whom, without line numbers (an edit above them moves those)."""

    def read(side: Side) -> Seen | None:
        found = registrations(side.facts)
        if found is None:
            return None
        changed = torch_ops_changed(side.facts)
        chosen = changed if which == "torch" else [e for e in found if e.get("kind") == "defines"]
        return Seen(_listed([registration_text(e, where=False) for e in chosen]) or "none")

    return read


def _startup(part: str) -> Callable[[Side], Seen | None]:
    """A start-up hook of the facts' `startup` (a live run's, or a file saved from one): the
    customize module's file by name and digest, the .pth files that run code, /etc/ld.so.preload."""

    def read(side: Side) -> Seen | None:
        startup = side.facts.raw.get("startup")
        if not isinstance(startup, dict):
            return None
        if part in ("sitecustomize", "usercustomize"):
            found = [m for m in startup.get("customize") or [] if m.get("module") == part and m.get("loaded")]
            return Seen(_listed([f"{m['path']} (sha256 {m.get('sha256')})" for m in found]) or "none")
        if part == "pth":
            running = [p for p in startup.get("pth") or [] if p.get("executes")]
            shown = [f"{p['path'].rsplit('/', 1)[-1]}: {' / '.join(p.get('code') or [])}" for p in running]
            return Seen(_listed(shown) or "none")
        return Seen(
            _listed([p["path"] for p in startup.get("preload") or [] if p.get("source") != "LD_PRELOAD"]) or "none"
        )

    return read


def _lower(value: Any) -> str:
    return str(value).lower()


# -- the table -----------------------------------------------------------------------------------

_BUILD = "https://github.com/pytorch/pytorch/blob/main/RELEASE.md"
_VERSION_REASON = "a new version changes kernels and their summation order (rounding-level results); crashes it can cause are verdicts of their own"  # noqa: E501
_LIBRARY_EFFECT = (
    "a different version ships different kernels and heuristics: another kernel sums in another order, so "
    "results differ at rounding level, and a version's own bugs (SIGFPE on H20 in cuBLAS < 12.4.5.8) come and go"
)
_TF32 = (
    "TF32 rounds fp32 inputs to a 10-bit mantissa on Ampere and later GPUs: relative errors near 1e-3 "
    "instead of 1e-7, so fp32 results change beyond rounding and ill-conditioned models can diverge"
)
_TF32_REASON = "changes fp32 results by four orders of magnitude, not at rounding level"
_STARTUP_CODE = (
    "runs before the program's first line in every Python process: it can set torch's flags, register kernels "
    "over torch's or import a different copy of a package"
)
_SITE = "https://docs.python.org/3/library/site.html"
_LIBRARY = "https://docs.pytorch.org/docs/stable/library.html"

TABLE: tuple[Entry, ...] = (
    Entry(
        key="gpu.model",
        label="GPU model",
        group="hardware",
        severity=W,
        reason="another GPU runs other kernels (rounding-level differences) and has its own library bugs",
        effect="cuBLAS and cuDNN choose kernels per GPU model (tile sizes, split-K), so summation order changes",
        source=_CUBLAS_REPRO,
        read=_gpu_models,
        covers=("gpus.name", "gpus.compute_capability", "gpus.capability_source"),
    ),
    Entry(
        key="gpu.capability",
        label="compute capability",
        group="hardware",
        severity=W,
        reason="decides which compiled kernels run; one missing from the build fails (arch-not-in-build says so)",
        effect="kernels are compiled per architecture: TF32 exists from sm_80, fp8 from sm_89, and a GPU "
        "the build was not compiled for runs JIT-compiled PTX or nothing",
        source="https://docs.nvidia.com/cuda/cuda-c-programming-guide/#compute-capabilities",
        read=_capabilities,
    ),
    Entry(
        key="driver",
        label="NVIDIA driver",
        group="hardware",
        severity=W,
        reason="too old a driver fails CUDA initialisation (driver-too-old says so); otherwise it compiles PTX",
        effect="the driver JIT-compiles PTX for GPUs the build has no kernels for, and bounds the CUDA runtime",
        source="https://docs.nvidia.com/deploy/cuda-compatibility/",
        read=_driver,
        covers=("driver",),
    ),
    Entry(
        key="torch.version",
        label="torch version",
        group="build",
        severity=W,
        reason=_VERSION_REASON,
        effect="kernels, decompositions and default flags change between releases (TF32 for matmul was on by "
        "default before 1.12)",
        source=_BUILD,
        read=_torch_version,
        covers=("torch.version", "torch_installs", "packages[pip:torch]", "packages[conda:pytorch]"),
    ),
    Entry(
        key="torch.build",
        label="torch build",
        group="build",
        severity=W,
        reason="the CUDA a build targets decides which libraries and kernels it ships",
        effect="the CUDA or ROCm version torch was built with picks its cuBLAS, cuDNN and NCCL and the "
        "kernels compiled into it",
        source=_BUILD,
        read=_torch_build,
        covers=("torch.cuda", "torch.hip", "torch.debug", "torch.cuda_known_none"),
    ),
    Entry(
        key="torch.arch_list",
        label="torch arch list",
        group="build",
        severity=W,
        reason="a GPU missing from the list runs JIT-compiled PTX or fails (arch-not-in-build says so)",
        effect="the architectures compiled into the build: a GPU outside them runs PTX compiled by the driver "
        "(other code) or has no kernel image at all",
        source=_BUILD,
        read=_arch_list,
        covers=("torch.arch_list",),
    ),
    Entry(
        key="cuda.toolkit",
        label="CUDA toolkit (nvcc)",
        group="build",
        severity=N,
        reason="compiles extensions built on the machine, not torch's own kernels",
        effect="extensions compiled on the machine (torch.utils.cpp_extension, apex) are built with it",
        source="https://pytorch.org/docs/stable/cpp_extension.html",
        read=_cuda_toolkit,
        covers=("cuda_toolkit",),
    ),
    *(
        Entry(
            key=f"{library}.{kind}",
            label=f"{shown} {kind}",
            group="library",
            severity=W,
            reason=_VERSION_REASON,
            effect=_LIBRARY_EFFECT,
            source=source,
            read=(_loaded if kind == "loaded" else _installed)(library),
            covers=(f"libraries.{kind}", f"torch.{library}") if kind == "loaded" else ("libraries.wheels",),
        )
        for library, shown, source in (
            ("cublas", "cuBLAS", "https://docs.nvidia.com/cuda/cublas/"),
            ("cublasLt", "cuBLASLt", "https://docs.nvidia.com/cuda/cublas/#using-the-cublaslt-api"),
            ("cudnn", "cuDNN", "https://docs.nvidia.com/deeplearning/cudnn/latest/release-notes.html"),
            ("nccl", "NCCL", "https://docs.nvidia.com/deeplearning/nccl/release-notes/"),
            ("cudart", "cudart", "https://docs.nvidia.com/cuda/cuda-runtime-api/"),
        )
        for kind in ("installed", "loaded")
    ),
    *(
        Entry(
            key=f"{library}.copies",
            label=f"{shown} copies (versions)",
            group="library",
            severity=W,
            reason="which of several copies loads depends on the loader's search order",
            effect="with several versions reachable, LD_LIBRARY_PATH, RPATH and load order pick the one that "
            "runs: an upgrade may change nothing on one machine",
            source="https://github.com/pytorch/pytorch/issues/78489",
            read=_copies(library),
            covers=("libraries.copies",),
        )
        for library, shown in (
            ("cublas", "cuBLAS"),
            ("cublasLt", "cuBLASLt"),
            ("cudnn", "cuDNN"),
            ("nccl", "NCCL"),
            ("cudart", "cudart"),
        )
    ),
    Entry(
        key="flag.matmul_tf32",
        label="TF32 matmul (torch.backends.cuda.matmul.allow_tf32)",
        group="flag",
        severity=E,
        reason=_TF32_REASON,
        effect=_TF32,
        source=_TF32_NOTES,
        read=_flag("matmul_allow_tf32"),
        covers=("torch.precision",),
    ),
    Entry(
        key="flag.cudnn_tf32",
        label="TF32 cuDNN (torch.backends.cudnn.allow_tf32)",
        group="flag",
        severity=E,
        reason=_TF32_REASON,
        effect=_TF32 + " (convolutions)",
        source=_TF32_NOTES,
        read=_flag("cudnn_allow_tf32"),
    ),
    Entry(
        key="flag.float32_matmul_precision",
        label="float32 matmul precision (torch.get_float32_matmul_precision())",
        group="flag",
        severity=E,
        reason=_TF32_REASON,
        effect="'high' allows TF32 (or bf16x3), 'medium' bf16 for fp32 matmuls; 'highest' keeps fp32",
        source="https://pytorch.org/docs/stable/generated/torch.set_float32_matmul_precision.html",
        read=_flag("float32_matmul_precision"),
    ),
    *(
        Entry(
            key=f"flag.{key}",
            label=f"fp32 precision of {what} ({attribute})",
            group="flag",
            severity=E,
            reason=_TF32_REASON,
            effect="'tf32' computes fp32 " + what + " in TF32 (10-bit mantissa), 'ieee' in fp32; 'none' defers to "
            "the parent setting",
            source=_TF32_NOTES,
            read=_flag(key),
        )
        for key, what, attribute in (
            ("fp32_precision", "every backend", "torch.backends.fp32_precision"),
            ("matmul_fp32_precision", "cuBLAS matmuls", "torch.backends.cuda.matmul.fp32_precision"),
            ("cudnn_fp32_precision", "cuDNN", "torch.backends.cudnn.fp32_precision"),
            ("cudnn_conv_fp32_precision", "cuDNN convolutions", "torch.backends.cudnn.conv.fp32_precision"),
            ("cudnn_rnn_fp32_precision", "cuDNN RNNs", "torch.backends.cudnn.rnn.fp32_precision"),
        )
    ),
    Entry(
        key="flag.fp16_reduction",
        label="fp16 reduced-precision reductions",
        group="flag",
        severity=E,
        reason="partial sums in fp16 lose precision beyond fp32 accumulation and can overflow to Inf",
        effect="cuBLAS may reduce split-K partial sums of fp16 GEMMs in fp16 instead of fp32",
        source=_REDUCED,
        read=_flag("fp16_reduced_precision_reduction"),
    ),
    Entry(
        key="flag.bf16_reduction",
        label="bf16 reduced-precision reductions",
        group="flag",
        severity=E,
        reason="partial sums in bf16 keep 8 bits of mantissa: errors far beyond fp32 accumulation",
        effect="cuBLAS may reduce split-K partial sums of bf16 GEMMs in bf16 instead of fp32",
        source=_REDUCED,
        read=_flag("bf16_reduced_precision_reduction"),
    ),
    Entry(
        key="flag.fp16_accumulation",
        label="fp16 accumulation (torch.backends.cuda.matmul.allow_fp16_accumulation)",
        group="flag",
        severity=E,
        reason="fp16 accumulators overflow past 65504 and round every partial sum to 11 bits",
        effect="fp16 GEMMs accumulate in fp16 instead of fp32",
        source="https://pytorch.org/docs/stable/notes/cuda.html",
        read=_flag("fp16_accumulation"),
    ),
    Entry(
        key="flag.deterministic_algorithms",
        label="deterministic algorithms (torch.use_deterministic_algorithms)",
        group="flag",
        severity=E,
        reason="an op without a deterministic implementation raises RuntimeError on the side that has it on",
        effect="ops switch to deterministic implementations (other summation order), and ops without one raise",
        source=_REPRO,
        read=_flag("deterministic_algorithms"),
    ),
    Entry(
        key="flag.deterministic_warn_only",
        label="deterministic algorithms: warn only",
        group="flag",
        severity=W,
        reason="decides whether an op without a deterministic implementation raises or warns",
        effect="with warn_only, ops without a deterministic implementation warn instead of raising",
        source=_REPRO,
        read=_flag("deterministic_warn_only"),
    ),
    Entry(
        key="flag.fill_uninitialized_memory",
        label="fill uninitialized memory (torch.utils.deterministic.fill_uninitialized_memory)",
        group="flag",
        severity=W,
        reason="with deterministic algorithms on, a read of uninitialised memory gives NaN on one side only",
        effect="with deterministic algorithms on, torch.empty and friends fill floats with NaN",
        source="https://pytorch.org/docs/stable/deterministic.html",
        read=_flag("fill_uninitialized_memory"),
    ),
    Entry(
        key="flag.cudnn_deterministic",
        label="cuDNN deterministic (torch.backends.cudnn.deterministic)",
        group="flag",
        severity=W,
        reason="another convolution algorithm sums in another order: rounding-level differences",
        effect="cuDNN is limited to deterministic convolution algorithms",
        source=_REPRO,
        read=_flag("cudnn_deterministic"),
    ),
    Entry(
        key="flag.cudnn_benchmark",
        label="cuDNN benchmark (torch.backends.cudnn.benchmark)",
        group="flag",
        severity=W,
        reason="the algorithm is chosen by timing, so it may differ per run and per machine: rounding-level",
        effect="cuDNN times several convolution algorithms and keeps the fastest",
        source=_REPRO,
        read=_flag("cudnn_benchmark"),
    ),
    Entry(
        key="flag.tunableop",
        label="TunableOp (torch.cuda.tunable.is_enabled())",
        group="flag",
        severity=W,
        reason="the GEMM kernel is chosen by timing: rounding-level differences that change per tuning",
        effect="GEMMs are tuned at run time across cuBLAS/cuBLASLt (hipBLASLt) solutions and the fastest kept",
        source="https://pytorch.org/docs/stable/cuda.tunable.html",
        read=_flag("tunableop"),
    ),
    Entry(
        key="flag.blas_library",
        label="preferred BLAS library (torch.backends.cuda.preferred_blas_library())",
        group="flag",
        severity=W,
        reason="another GEMM library runs other kernels: rounding-level differences, and its own bugs",
        effect="GEMMs run through cuBLAS or cuBLASLt (hipBLAS or hipBLASLt)",
        source="https://pytorch.org/docs/stable/backends.html#torch.backends.cuda.preferred_blas_library",
        read=_flag("preferred_blas_library", present=lambda v: str(v).rsplit(".", 1)[-1]),
    ),
    Entry(
        key="env.NVIDIA_TF32_OVERRIDE",
        label="NVIDIA_TF32_OVERRIDE",
        group="variable",
        severity=E,
        reason=_TF32_REASON,
        effect="0 disables TF32 in cuBLAS and cuDNN whatever the framework asks for",
        source="https://docs.nvidia.com/deeplearning/frameworks/user-guide/index.html#tf32",
        read=_variable("NVIDIA_TF32_OVERRIDE"),
    ),
    Entry(
        key="env.TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        label="TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        group="variable",
        severity=E,
        reason=_TF32_REASON,
        effect="1 turns TF32 on for cuBLAS matmuls whatever torch.backends.cuda.matmul.allow_tf32 says",
        source=_TF32_NOTES,
        read=_variable("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
    ),
    Entry(
        key="env.CUBLAS_WORKSPACE_CONFIG",
        label="CUBLAS_WORKSPACE_CONFIG",
        group="variable",
        severity=W,
        reason="the workspace limits cuBLAS's kernel choice (rounding-level); deterministic mode needs it set",
        effect="sets cuBLAS's workspace per stream (':4096:8', ':16:8'), which decides the split-K kernels it may use",
        source=_CUBLAS_REPRO,
        read=_variable("CUBLAS_WORKSPACE_CONFIG"),
    ),
    Entry(
        key="env.CUBLAS_EMULATION_STRATEGY",
        label="CUBLAS_EMULATION_STRATEGY",
        group="variable",
        severity=E,
        reason="emulated fp32 GEMMs (BF16x9) round differently from native fp32 ones",
        effect="lets cuBLAS emulate fp32 GEMMs with bf16 tensor-core products where the library supports it",
        source="https://docs.nvidia.com/cuda/cublas/",
        read=_variable("CUBLAS_EMULATION_STRATEGY"),
    ),
    Entry(
        key="env.CUBLASLT_*",  # expanded per variable seen on either side (see entries())
        label="CUBLASLT_*",
        group="variable",
        severity=W,
        reason="cuBLASLt's own settings change the kernels its heuristics pick (rounding-level)",
        effect="cuBLASLt's settings (its heuristics cache, kernel choice); its logging variables change nothing "
        "and are left out",
        source="https://docs.nvidia.com/cuda/cublas/#cublaslt-api",
        read=lambda side: None,
    ),
    Entry(
        key="env.TORCH_BLAS_PREFER_CUBLASLT",
        label="TORCH_BLAS_PREFER_CUBLASLT",
        group="variable",
        severity=W,
        reason="another GEMM library runs other kernels: rounding-level differences, and its own bugs",
        effect="1 makes torch run GEMMs through cuBLASLt instead of cuBLAS",
        source="https://pytorch.org/docs/stable/backends.html#torch.backends.cuda.preferred_blas_library",
        read=_variable("TORCH_BLAS_PREFER_CUBLASLT"),
    ),
    Entry(
        key="env.PYTORCH_TUNABLEOP_ENABLED",
        label="PYTORCH_TUNABLEOP_ENABLED",
        group="variable",
        severity=W,
        reason="the GEMM kernel is chosen by timing: rounding-level differences that change per tuning",
        effect="1 turns TunableOp on: GEMM kernels chosen by timing at run time",
        source="https://pytorch.org/docs/stable/cuda.tunable.html",
        read=_variable("PYTORCH_TUNABLEOP_ENABLED"),
    ),
    *(
        Entry(
            key=f"env.{name}",
            label=name,
            group="variable",
            severity=W,
            reason="another reduction order across ranks: rounding-level differences in all-reduced gradients",
            effect=effect,
            source=_NCCL_ENV,
            read=_variable(name),
        )
        for name, effect in (
            ("NCCL_ALGO", "forces NCCL's collective algorithm (Ring, Tree, NVLS, CollNet): another summation order"),
            ("NCCL_PROTO", "forces NCCL's protocol (Simple, LL, LL128): another chunking of the reduction"),
            ("NCCL_NVLS_ENABLE", "switches NVLink SHARP reductions (in the switch) on or off: another order"),
        )
    ),
    Entry(
        key="startup.torch_ops",
        label="torch ops with kernels registered at start-up",
        group="startup",
        severity=E,
        reason="every call of that op runs other code on one machine: any result it feeds can change",
        effect="code that ran before the program (a sitecustomize, a .pth file's import, a plug-in) registered a "
        "kernel for torch's own op through torch.library, which the dispatcher runs instead of torch's",
        source=_LIBRARY,
        read=_registered("torch"),
        covers=("torch.registrations",),
    ),
    Entry(
        key="startup.new_ops",
        label="ops defined at start-up",
        group="startup",
        severity=W,
        reason="a program that calls the op runs it on one machine and fails on the other, or runs other code",
        effect="code that ran before the program defined ops of its own (torch.ops.<namespace>.<name>)",
        source=_LIBRARY,
        read=_registered("new"),
        covers=("torch.registrations",),
    ),
    *(
        Entry(
            key=f"startup.{name}",
            label=f"{name} module",
            group="startup",
            severity=W,
            reason=_STARTUP_CODE,
            effect=f"`site` imports {name} at every start: " + _STARTUP_CODE,
            source=_SITE,
            read=_startup(name),
            covers=("startup",),
        )
        for name in ("sitecustomize", "usercustomize")
    ),
    Entry(
        key="startup.pth",
        label=".pth files that run code",
        group="startup",
        severity=W,
        reason=_STARTUP_CODE,
        effect="`site` executes each line of a .pth file that starts with `import`: " + _STARTUP_CODE,
        source=_SITE,
        read=_startup("pth"),
        covers=("startup",),
    ),
    Entry(
        key="startup.preload",
        label="/etc/ld.so.preload",
        group="startup",
        severity=W,
        reason="a preloaded library's functions replace those of every library after it (libm, libc, CUDA's)",
        effect="the dynamic loader maps these libraries into every process before any other",
        source="https://man7.org/linux/man-pages/man8/ld.so.8.html",
        read=_startup("preload"),
        covers=("startup",),
    ),
    Entry(
        key="env.LD_PRELOAD",
        label="LD_PRELOAD",
        group="variable",
        severity=W,
        reason="a preloaded library's functions replace those of every library after it (libm, libc, CUDA's)",
        effect="the dynamic loader maps these libraries first, so their symbols win over torch's and CUDA's",
        source="https://man7.org/linux/man-pages/man8/ld.so.8.html",
        read=_variable("LD_PRELOAD"),
    ),
    Entry(
        key="env.LD_LIBRARY_PATH",
        label="LD_LIBRARY_PATH",
        group="variable",
        severity=W,
        reason="decides which of several copies of cuBLAS, cuDNN or NCCL loads (other kernels, other bugs)",
        effect="directories the dynamic loader searches before the system's: the copy of a CUDA library found "
        "first is the one torch runs",
        source="https://man7.org/linux/man-pages/man8/ld.so.8.html",
        read=_variable("LD_LIBRARY_PATH"),
    ),
    Entry(
        key="env.PYTHONPATH",
        label="PYTHONPATH",
        group="variable",
        severity=W,
        reason="a module found first on it replaces the installed one, and a sitecustomize on it runs at start",
        effect="directories searched before the installed packages: a module there shadows the package of the "
        "same name, and a sitecustomize.py there runs before the program",
        source=_SITE,
        read=_variable("PYTHONPATH"),
    ),
)

# Variables under a prefix the table covers by one entry, and those under it that change nothing.
_PREFIXED = {"CUBLASLT_": "env.CUBLASLT_*"}
_INERT = re.compile(r"^CUBLASLT_LOG_")


def entries(a: Side, b: Side) -> Iterator[Entry]:
    """The table, with its prefix entries (CUBLASLT_*) expanded to each variable either side sets."""
    by_key = {e.key: e for e in TABLE}
    for entry in TABLE:
        prefix = next((p for p, key in _PREFIXED.items() if key == entry.key), None)
        if prefix is None:
            yield entry
            continue
        names = {n for side in (a, b) for n in side.facts.raw.get("env") or {}}
        for name in sorted(n for n in names if n.startswith(prefix) and not _INERT.match(n)):
            yield replace(by_key[entry.key], key=f"env.{name}", label=name, read=_variable(name))


def variables() -> tuple[str, ...]:
    """The environment variables the table names (prefix entries as their prefix)."""
    named = tuple(e.key[4:] for e in TABLE if e.key.startswith("env.") and not e.key.endswith("*"))
    return named + tuple(_PREFIXED)


def recorded_variables(environ: dict[str, str]) -> dict[str, str | None]:
    """The table's variables as a compare record keeps them: every named one (None: unset, so a
    record says it was unset rather than unknown) and each prefixed one that is set."""
    out: dict[str, str | None] = {}
    for name in variables():
        if name in _PREFIXED:
            out |= {k: v for k, v in sorted(environ.items()) if k.startswith(name) and not _INERT.match(k)}
        else:
            out[name] = environ.get(name)
    return out
