"""Environment-doctor finding codes (ENV0xx: the build and what runs at start-up; ENV1xx: CUDA
libraries; ENV2xx: probes; ENV3xx: what differs between two machines, `env --diff`)."""

from __future__ import annotations

from fpdoctor.catalog import RuleInfo
from fpdoctor.report.model import Severity

E, W, N = Severity.ERROR, Severity.WARNING, Severity.INFO  # N: a note

# What the confidence words in a finding's evidence mean (the reference data's own scale).
_CONFIDENCE_WORDS = (
    "Each fact carries its source's confidence: confirmed (vendor documentation, a maintainer's "
    "statement or the build script), likely (strong indirect evidence), reported (several independent "
    "user reports agree, no vendor root cause), inferred (deduced, verify on the device), unconfirmed "
    "(single or conflicting evidence: fpdoctor only suggests)."
)


# Why the fixes of these codes are not tried (RuleInfo.untried): each changes an installation or a
# machine's settings, which the doctor reads and never modifies.
_INSTALL = "an installation change: fpdoctor diagnoses an environment and never modifies it"
_OTHER_MACHINE = "a change to one of the two machines compared: fpdoctor reads their facts, it changes neither"
_PROBE = "a next diagnostic step on the machine, not a change fpdoctor can make and measure"

ENV_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="ENV001",
        name="torch-import-failed",
        severity=E,
        untried=_INSTALL,
        title="`import torch` fails",
        what="Runs `import torch` in a child process and reports the error it raised or the "
        "signal it died of, matched against known causes (a missing or mismatched shared "
        "library, a NumPy ABI break, a half-installed wheel).",
        why="Nothing else in PyTorch can run; the error text usually names a symptom, not a cause.",
        fix="The finding gives the command for the cause it matched; for an unknown cause it reinstalls the "
        "same torch from its own index (python -m pip install --force-reinstall ...).",
    ),
    RuleInfo(
        code="ENV002",
        name="cpu-only-build",
        severity=E,
        untried=_INSTALL,
        title="PyTorch was built without CUDA, but this machine has NVIDIA GPUs",
        what="The installed torch has no CUDA support (`torch.version.cuda` is None, or a "
        "`+cpu` wheel) while NVML, nvidia-smi or the pasted report shows NVIDIA GPUs.",
        why="Every tensor stays on the CPU; `torch.cuda.is_available()` is False and .cuda() raises.",
        fix="The finding gives the install command for the CUDA build that covers the GPUs and runs on the "
        "driver, with the interpreter the input shows; a torch change means rebuilding compiled extensions.",
        references=("https://pytorch.org/get-started/locally/",),
    ),
    RuleInfo(
        code="ENV003",
        name="driver-too-old",
        severity=E,
        untried=_INSTALL,
        title="The NVIDIA driver is older than the CUDA runtime this torch build needs",
        what="Compares the driver version with the minimum for the build's CUDA major version "
        "(NVIDIA's minor-version-compatibility floor) and for the exact toolkit.",
        why="CUDA initialisation fails ('driver on your system is too old', error 803/804), or "
        "newer features and PTX JIT fail later.",
        fix="Upgrade the NVIDIA driver to the minimum the finding names (no single command: it comes from the OS "
        "or NVIDIA's installer), or run the finding's command that installs a torch built for an older CUDA.",
        references=("https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/",),
    ),
    RuleInfo(
        code="ENV004",
        name="arch-not-in-build",
        severity=E,
        untried=_INSTALL,
        title="The GPU's compute capability is not compiled into this torch build",
        what="Checks each GPU's compute capability against the build's SASS targets (same major "
        "version, equal or lower minor) and PTX target, and against the CUDA version that first "
        "supported the architecture.",
        why="Kernels fail with 'no kernel image is available for execution on the device', or run "
        "only through slow PTX JIT with libraries that have no kernels for the GPU.",
        fix="The finding gives the install command for a build that covers the GPU and runs on the driver, or "
        "says why there is none (no such build, or the driver must be upgraded first).",
        references=("https://github.com/pytorch/pytorch/blob/main/RELEASE.md",),
    ),
    RuleInfo(
        code="ENV005",
        name="duplicate-torch-install",
        severity=W,
        untried=_INSTALL,
        title="More than one PyTorch installation is visible",
        what="Finds several torch distributions on sys.path (user site and a virtual environment, "
        "a stale dist-info left by an interrupted upgrade) or both pip and conda copies.",
        why="The copy that is imported may not be the one that was upgraded; version checks lie.",
        fix="Uninstall until one remains: python -m pip uninstall -y torch (repeat), "
        "conda remove pytorch; then reinstall once.",
    ),
    RuleInfo(
        code="ENV006",
        name="numpy-abi-mismatch",
        severity=E,
        untried=_INSTALL,
        title="NumPy is incompatible with a compiled module (NumPy 1.x vs 2.x ABI)",
        what="Matches the NumPy ABI error texts and checks that torch can exchange arrays with numpy.",
        why="`import torch` warns or fails ('_ARRAY_API not found'), and torch.from_numpy breaks.",
        fix="python -m pip install 'numpy<2'  # or upgrade the module built against NumPy 1.x",
        references=("https://github.com/pytorch/pytorch/issues/135013",),
    ),
    RuleInfo(
        code="ENV007",
        name="op-overridden-at-startup",
        severity=W,
        untried=_INSTALL,
        title="A torch op's kernel is registered by code that runs before the program",
        what="The torch child of `fpdoctor env` imports nothing but torch; any kernel its dispatcher holds for "
        "torch's own ops (aten::exp's CPU kernel, say) from a file outside torch was registered by start-up "
        "code: a sitecustomize or usercustomize, a .pth file's import, a plug-in torch loads by entry point. "
        "Each comes with its dispatch key, file and line.",
        why="Every call of the op, in every Python process on the machine, runs that code instead of torch's "
        "kernel: results change with no line of the program saying so, and only on the machines that have it.",
        fix="Remove the registration (the finding names its file and line), or move it into the program that wants it.",
        references=("https://docs.pytorch.org/docs/stable/library.html",),
    ),
    RuleInfo(
        code="ENV101",
        name="cublas-h20-sigfpe",
        severity=E,
        untried=_INSTALL,
        title="cuBLAS older than 12.4.5.8 on an NVIDIA H20 dies with SIGFPE",
        what="An H20 GPU with a loaded (or, failing that, installed) cuBLAS below 12.4.5.8, as "
        "shipped by CUDA 12.1-era torch wheels; or the crash signature in a log.",
        why="cuBLASLt's heuristics divide by zero on H20: the process dies with 'Floating point "
        "exception' in the first nn.Linear, on one GPU or many.",
        fix="python -m pip install 'nvidia-cublas-cu12==12.4.5.8'  and make sure that copy is "
        "the one loaded (fpdoctor env shows the loaded path)",
        references=(
            "https://github.com/pytorch/pytorch/issues/133548",
            "https://github.com/pytorch/pytorch/issues/152017",
        ),
    ),
    RuleInfo(
        code="ENV102",
        name="duplicate-cuda-library",
        severity=W,
        untried=_INSTALL,
        title="Several different copies of one CUDA library are reachable",
        what="Lists cuBLAS, cuBLASLt, cuDNN, NCCL, cudart and nvJitLink copies in pip wheels, "
        "torch/lib, LD_LIBRARY_PATH, the conda env, CUDA_HOME and the ldconfig cache, and reports libraries "
        "with copies of different versions.",
        why="Which copy the loader picks depends on RPATH, LD_LIBRARY_PATH and load order; an "
        "upgrade of one copy may change nothing.",
        fix="Remove stray directories from LD_LIBRARY_PATH and uninstall duplicate nvidia-* wheels.",
        references=("https://github.com/pytorch/pytorch/issues/78489",),
    ),
    RuleInfo(
        code="ENV103",
        name="library-shadowed",
        severity=E,
        untried=_INSTALL,
        title="The loaded copy of a CUDA library is not the installed wheel's copy",
        what="Forces torch to load its CUDA libraries in a child process, reads /proc/self/maps "
        "and compares each mapped library with the pip wheel that should provide it.",
        why="An upgraded wheel (say nvidia-cublas-cu12) has no effect while an older copy on "
        "LD_LIBRARY_PATH or inside torch/lib is the one in the process.",
        fix="Remove the directory of the loaded copy from LD_LIBRARY_PATH, or prepend the wheel's lib directory to it.",
    ),
    RuleInfo(
        code="ENV104",
        name="known-issue",
        severity=W,
        untried=_INSTALL,
        title="Matches a known problem in the PyTorch/CUDA stack",
        what="Matches error text (a pasted log, the import error, warnings) and versions against the "
        "known-issues table shipped with fpdoctor, and reports a problem whose error text appears or whose "
        "version condition holds together with every other condition it states. A generic symptom (a NaN "
        "loss, 'Bus error', a watchdog timeout) never makes a finding on its own. " + _CONFIDENCE_WORDS,
        why="Known problems have known fixes; the finding says how sure its source is.",
        fix="The finding gives the known fix for the matched problem, command first.",
    ),
    RuleInfo(
        code="ENV105",
        name="known-issue-crash",
        severity=E,
        untried=_INSTALL,
        title="The input shows a crash whose cause is a known, confirmed problem",
        what="The error text of a crash that the known-issues table lists with a confirmed cause "
        "(a vendor or maintainer statement, or the build configuration itself) appears in the input. "
        + _CONFIDENCE_WORDS,
        why="The crash has happened; its cause and fix are known.",
        fix="The finding gives the known fix for the matched crash, command first.",
    ),
    RuleInfo(
        code="ENV106",
        name="known-issue-possible",
        severity=N,
        untried=_INSTALL,
        title="A known problem may apply; what it needs is not shown",
        what="A version condition of a known problem holds (say NCCL 2.28.9), but other conditions it "
        "states (multi-node, CUDA graphs, an environment variable, hardware evidence) are not shown by the "
        "input; or the problem's only source is unconfirmed. A note, never a warning or an error. " + _CONFIDENCE_WORDS,
        why="Worth knowing if the job does what the condition says; not a verdict on this machine.",
        fix="The finding names the conditions to check, and the fix if they hold.",
    ),
    RuleInfo(
        code="ENV201",
        name="probe-crashed",
        severity=E,
        untried=_PROBE,
        title="An isolated GEMM probe died by a signal",
        what="Runs small matrix multiplications per dtype in child processes with a timeout; a "
        "child killed by SIGFPE, SIGSEGV, SIGABRT or SIGBUS is reported here.",
        why="The same call crashes your job; the probe names the dtype and shape that crash.",
        fix="The finding gives the fix of the finding that explains the crash; otherwise the command that "
        "writes a report to attach upstream.",
    ),
    RuleInfo(
        code="ENV202",
        name="probe-wrong-result",
        severity=E,
        untried=_PROBE,
        title="A GEMM probe returned a wrong result",
        what="Compares each probe's result with a float64 CPU reference, with a tolerance derived "
        "from the dtype's precision and the reduction length.",
        why="A library or GPU that computes wrong matrix products corrupts training silently.",
        fix="fpdoctor env --probe (again); if the wrong result repeats, fpdoctor health --duration 10.",
    ),
    RuleInfo(
        code="ENV203",
        name="probe-timed-out",
        severity=W,
        untried=_PROBE,
        title="A GEMM probe did not finish in time",
        what="A probe child that is still running after its timeout is killed and reported.",
        why="A hang in a basic GEMM points at the driver, a wedged GPU or a library deadlock.",
        fix="nvidia-smi (a wedged GPU), then sudo dmesg | grep -i xid (Xid errors in the kernel log).",
    ),
    RuleInfo(
        code="ENV301",
        name="verdict-on-one-side",
        severity=E,
        untried=_OTHER_MACHINE,
        title="A verdict of the environment rules fires on one machine only",
        what="Runs the environment rules on both inputs of `fpdoctor env --diff A B` and reports each verdict "
        "that fires on one side only (cublas-h20-sigfpe on B only, say), with that verdict's severity.",
        why="It worked on A and fails on B: a verdict on B alone is the first suspect.",
        fix="The finding gives the fix of the verdict it carries.",
    ),
    RuleInfo(
        code="ENV302",
        name="hardware-differs",
        severity=W,
        untried=_OTHER_MACHINE,
        title="The two machines have different GPUs or drivers",
        what="Compares GPU models, compute capabilities and NVIDIA drivers of two inputs of `fpdoctor env --diff`, "
        "from fpdoctor's table of environment differences (each fact with what it does to numbers and its source).",
        why="cuBLAS and cuDNN choose kernels per GPU, so results differ at rounding level; a GPU the build has "
        "no kernels for runs PTX compiled by the driver, or fails.",
        fix="Compare results across GPUs with a tolerance; `fpdoctor compare MODEL --against RECORD` names the "
        "first module that departs.",
        references=("https://docs.nvidia.com/cuda/cublas/#results-reproducibility",),
    ),
    RuleInfo(
        code="ENV303",
        name="build-differs",
        severity=W,
        untried=_OTHER_MACHINE,
        title="The two machines run different torch builds",
        what="Compares the torch version, the CUDA or ROCm it was built with, its arch list and the CUDA toolkit "
        "on PATH between the two inputs of `fpdoctor env --diff`.",
        why="Kernels, decompositions and default flags change between releases and builds.",
        fix="Install the same torch build on both machines to tell the software from the machine apart.",
    ),
    RuleInfo(
        code="ENV304",
        name="library-differs",
        severity=W,
        untried=_OTHER_MACHINE,
        title="The two machines install or load different CUDA libraries",
        what="Compares the installed and the loaded versions of cuBLAS, cuBLASLt, cuDNN, NCCL and cudart, and the "
        "versions of their reachable copies, between the two inputs of `fpdoctor env --diff`.",
        why="Another library version runs other kernels (another summation order) and has its own bugs "
        "(SIGFPE on H20 in cuBLAS before 12.4.5.8).",
        fix="Install the same nvidia-* wheels on both machines; `fpdoctor env` on each shows which copy loads.",
    ),
    RuleInfo(
        code="ENV305",
        name="math-flag-differs",
        severity=E,
        untried=_OTHER_MACHINE,
        title="A PyTorch math flag differs between the two machines",
        what="Compares TF32 for matmul and cuDNN and their fp32_precision settings, the float32 matmul "
        "precision, fp16/bf16 reduced-precision reductions, fp16 accumulation, deterministic algorithms and "
        "fill_uninitialized_memory, cuDNN deterministic and benchmark, TunableOp and the preferred BLAS library.",
        why="TF32 and reduced-precision reductions change results beyond rounding (TF32: relative errors near "
        "1e-3 instead of 1e-7); deterministic algorithms make some ops raise. The severity of each says why.",
        fix="The finding gives the line of Python that sets the flag as on the other machine.",
        references=("https://pytorch.org/docs/stable/notes/cuda.html",),
    ),
    RuleInfo(
        code="ENV306",
        name="math-variable-differs",
        severity=E,
        untried=_OTHER_MACHINE,
        title="An environment variable that changes math or kernels differs between the two machines",
        what="Compares NVIDIA_TF32_OVERRIDE, TORCH_ALLOW_TF32_CUBLAS_OVERRIDE, CUBLAS_WORKSPACE_CONFIG, "
        "CUBLAS_EMULATION_STRATEGY, CUBLASLT_* (not its logging), TORCH_BLAS_PREFER_CUBLASLT, "
        "PYTORCH_TUNABLEOP_ENABLED, NCCL_ALGO, NCCL_PROTO and NCCL_NVLS_ENABLE. A variable is compared only where "
        "the input was collected on the machine (a pasted report does not show them).",
        why="NVIDIA_TF32_OVERRIDE and TORCH_ALLOW_TF32_CUBLAS_OVERRIDE switch TF32 whatever the code says; the "
        "others change which kernels or reduction orders run.",
        fix="The finding gives the export (or unset) that makes the variable as on the other machine.",
    ),
    RuleInfo(
        code="ENV307",
        name="startup-differs",
        severity=W,
        untried=_OTHER_MACHINE,
        title="Code that runs before the program differs between the two machines",
        what="Compares what runs before a program's first line: the ops and kernels registered with torch's "
        "dispatcher by code outside torch (torch.library), sitecustomize and usercustomize, .pth files that "
        "run code, /etc/ld.so.preload; LD_PRELOAD, LD_LIBRARY_PATH and PYTHONPATH are compared as variables "
        "(math-variable-differs). Known only where the facts were collected on the machine.",
        why="Such code can register a kernel over torch's own (every call of that op then runs it), set flags "
        "or replace C library functions: the same packages then give other numbers. A kernel over a torch op "
        "is an error-level difference, the rest warnings.",
        fix="The finding says which hook differs; `python -I -S` runs the program without any of them.",
        references=("https://docs.pytorch.org/docs/stable/library.html", "https://docs.python.org/3/library/site.html"),
    ),
)
