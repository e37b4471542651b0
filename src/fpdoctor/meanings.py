"""What a signal or an error text means for a PyTorch job, and what to do next.

Data only, below the capabilities that read it: `fpdoctor run`'s findings choose which explanation
applies to which process, and `fpdoctor env`'s cuda-error rule explains an error in a pasted log
with the same table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Meaning:
    key: str
    text: str  # one or two sentences: what happened and the usual causes
    fix: str = ""  # commands or checks, one per line


SIGNALS: dict[str, Meaning] = {
    "SIGFPE": Meaning(
        "SIGFPE",
        "an arithmetic fault in native code, nearly always an integer division by zero (floating-point "
        "division in Python or PyTorch never raises it). On NVIDIA H20 with a cuBLAS older than 12.4.5.8 this is "
        "the known cuBLASLt heuristics bug in the first matmul; elsewhere a native library or extension divided "
        "by a size that was zero.",
    ),
    "SIGSEGV": Meaning(
        "SIGSEGV",
        "an invalid memory access in native code: a bug in a C++/CUDA extension, two incompatible copies of a "
        "library in one process (an ABI mismatch such as NumPy 1.x/2.x or two CUDA runtimes), a use after free, "
        "or a stack overflow from very deep recursion.",
    ),
    "SIGABRT": Meaning(
        "SIGABRT",
        "the process aborted itself: a C++ exception nobody caught (look for 'terminate called after throwing' "
        "and 'what():' below), a failed assertion, a fatal CUDA/NCCL error, or glibc detecting heap corruption "
        "('free(): invalid pointer', 'double free or corruption').",
    ),
    "SIGBUS": Meaning(
        "SIGBUS",
        "an access to memory whose backing is gone: a memory-mapped file truncated or rewritten while in use "
        "(a checkpoint or dataset replaced during training), a full /dev/shm (Docker's 64 MB default with "
        "DataLoader workers), or a misaligned access.",
        "df -h /dev/shm   # in Docker: --shm-size=16g or --ipc=host",
    ),
    "SIGILL": Meaning(
        "SIGILL",
        "an illegal CPU instruction: a binary built for a newer CPU (AVX-512, AVX2) than this one, or a "
        "deliberate trap in native code.",
        "grep -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u",
    ),
    "SIGKILL": Meaning(
        "SIGKILL",
        "killed from outside: SIGKILL cannot be caught and leaves no trace in the process. Most likely the "
        "kernel's out-of-memory killer (host RAM, not GPU memory); otherwise a scheduler's limit (Slurm, "
        "Kubernetes) or a kill -9.",
        "dmesg -T | grep -i -E 'out of memory|killed process'   # the OOM killer names the pid it killed\n"
        "# fewer DataLoader workers, a smaller prefetch_factor, or more memory for the job",
    ),
    "SIGTERM": Meaning(
        "SIGTERM",
        "asked to terminate: by a launcher stopping the other ranks after one failed (torchrun does), a "
        "scheduler (time limit, preemption), or a user.",
    ),
    "SIGINT": Meaning("SIGINT", "interrupted (Ctrl-C)."),
    "SIGHUP": Meaning("SIGHUP", "its terminal or session went away (an SSH connection closed without nohup/tmux)."),
    "SIGPIPE": Meaning("SIGPIPE", "it wrote to a pipe whose reader had gone (e.g. `| head`)."),
    "SIGXCPU": Meaning("SIGXCPU", "it reached its CPU-time limit (ulimit -t, a scheduler limit)."),
    "SIGXFSZ": Meaning("SIGXFSZ", "it reached its file-size limit (ulimit -f)."),
    "SIGQUIT": Meaning("SIGQUIT", "asked to quit with a core dump (Ctrl-\\ or kill -QUIT)."),
    "SIGTRAP": Meaning("SIGTRAP", "a breakpoint or trap instruction in native code without a debugger attached."),
    "SIGSYS": Meaning("SIGSYS", "a system call its sandbox (seccomp) does not allow."),
}


def signal_meaning(name: str) -> Meaning:
    return SIGNALS.get(name, Meaning(name, f"it received {name}."))


@dataclass(frozen=True)
class ErrorText:
    key: str
    pattern: re.Pattern[str]
    finding: str  # the catalogue name a process that ended with this text gets
    meaning: Meaning


def _e(key: str, pattern: str, finding: str, text: str, fix: str = "") -> ErrorText:
    return ErrorText(key, re.compile(pattern), finding, Meaning(key, text, fix))


_BLOCKING = "CUDA_LAUNCH_BLOCKING=1 COMMAND   # kernels then fail at their own Python line"
_NCCL_DEBUG = "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET COMMAND"

# In priority order: the first that matches explains the text. Root causes come before the
# errors they cause (an illegal access makes every later CUDA call fail, NCCL included).
ERRORS: tuple[ErrorText, ...] = (
    _e(
        "ecc",
        r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable",
        "cuda-error",
        "The GPU reported an uncorrectable memory (ECC) error: a hardware fault, not a bug in the program.",
        "fpdoctor health   # ECC counters, row remapping and Xid lines of every GPU\nnvidia-smi -q -d ECC,ROW_REMAPPER",
    ),
    _e(
        "illegal-address",
        r"illegal memory access|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS",
        "cuda-error",
        "A CUDA kernel read or wrote outside its memory. Kernels run asynchronously, so the line that raised is "
        "often a later call (.item(), .cpu(), a copy) and not the kernel at fault. Usual causes: indices out of "
        "range in a custom kernel or in gather/scatter/index ops, memory freed while another stream used it, a "
        "library bug; faulty GPU memory when it comes with Xid 31/43/48/94/95 in the kernel log.",
        f"{_BLOCKING}\ncompute-sanitizer --tool memcheck python SCRIPT.py   # names the bad access (10-100x slower)",
    ),
    _e(
        "device-assert",
        r"device-side assert|cudaErrorAssert",
        "cuda-error",
        "A kernel's own bounds check failed, nearly always an index out of range: class labels outside "
        "[0, num_classes) in cross_entropy/nll_loss, token ids >= the embedding's num_embeddings, or "
        "gather/scatter/index_select indices outside the dimension. The CUDA context is unusable afterwards.",
        "Run the failing step on the CPU (it raises a plain IndexError at the op), or\n" + _BLOCKING,
    ),
    _e(
        "no-kernel-image",
        r"no kernel image is available for execution on the device|cudaErrorNoKernelImageForDevice",
        "cuda-error",
        "This torch build has no kernels for the GPU's compute capability.",
        "fpdoctor env   # names the build's arch list and the wheel that covers this GPU",
    ),
    _e(
        "driver-too-old",
        r"CUDA driver version is insufficient|driver on your system is too old",
        "cuda-error",
        "The NVIDIA driver is older than the CUDA runtime this torch build needs.",
        "fpdoctor env   # the minimum driver for this build, or the torch variant for this driver",
    ),
    _e(
        "out-of-memory",
        r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation",
        "cuda-error",
        "The GPU ran out of memory for an allocation.",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True COMMAND   # less fragmentation\n"
        "# or a smaller batch, activation checkpointing, torch.cuda.memory_summary() at the failing step",
    ),
    _e(
        "cublas-not-supported",
        r"CUBLAS_STATUS_(NOT_SUPPORTED|ARCH_MISMATCH)",
        "cuda-error",
        "cuBLAS has no kernel for this dtype, shape or layout on this GPU: an fp8/bf16 GEMM on an older "
        "architecture, or a cuBLAS older than the GPU.",
        "fpdoctor env   # the cuBLAS that is loaded, and whether it knows this GPU",
    ),
    _e(
        "cublas-alloc",
        r"CUBLAS_STATUS_(ALLOC_FAILED|NOT_INITIALIZED)",
        "cuda-error",
        "cuBLAS could not create its handle or workspace: the GPU is (almost) out of memory, or the CUDA "
        "context is broken by an earlier error.",
        "nvidia-smi   # memory in use, other processes on the GPU",
    ),
    _e(
        "cublas-failed",
        r"CUBLAS_STATUS_[A-Z_]+",
        "cuda-error",
        "A cuBLAS call failed (EXECUTION_FAILED, INVALID_VALUE, INTERNAL_ERROR). Often the visible symptom of an "
        "earlier asynchronous CUDA error; otherwise a shape, dtype or alignment that this cuBLAS rejects, or a "
        "cuBLAS that does not match the GPU or torch build.",
        f"{_BLOCKING}\nfpdoctor env   # the loaded cuBLAS and its known issues",
    ),
    _e(
        "cudnn",
        r"CUDNN_STATUS_[A-Z_]+|cuDNN error",
        "cuda-error",
        "A cuDNN call failed: often an earlier asynchronous CUDA error or out of memory; otherwise a cuDNN that "
        "does not match the torch build.",
        f"{_BLOCKING}\nfpdoctor env   # the cuDNN torch loads",
    ),
    _e(
        "nccl-timeout",
        r"Watchdog caught collective operation timeout|collective operation timeout|NCCL.*timed? ?out",
        "cuda-error",
        "A collective did not complete within its timeout: another rank died or hangs, or the ranks called "
        "different collectives (a different order, or tensors of different shapes).",
        "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 COMMAND   # flight recorder per rank\n"
        "TORCH_DISTRIBUTED_DEBUG=DETAIL COMMAND   # reports mismatched collectives",
    ),
    _e(
        "nccl",
        r"NCCL error|nccl(UnhandledCudaError|SystemError|InternalError|InvalidUsage|RemoteError|InvalidArgument)",
        "cuda-error",
        "NCCL failed. ncclUnhandledCudaError is a CUDA error underneath (look for it above); ncclSystemError a "
        "socket, shared-memory or network problem (a small /dev/shm in a container); ncclRemoteError a peer that "
        "died; ncclInvalidUsage mismatched calls across ranks.",
        f"{_NCCL_DEBUG}\n# in containers: --shm-size=16g or --ipc=host",
    ),
    _e(
        "launch-failure",
        r"unspecified launch failure|cudaErrorLaunchFailure|an illegal instruction was encountered|misaligned address",
        "cuda-error",
        "A kernel crashed on the GPU (the device-side equivalent of a segmentation fault); the kernel log usually "
        "holds an Xid 13 or 31 for it.",
        f"{_BLOCKING}\nfpdoctor health   # Xid lines since the crash",
    ),
    _e(
        "cuda-other",
        r"CUDA error: [^\n]+|cudaError[A-Za-z]+",
        "cuda-error",
        "A CUDA call failed. CUDA errors are reported by a later call than the one that caused them.",
        _BLOCKING,
    ),
    _e(
        "nonfinite",
        r"NonFiniteError|returned nan values|\b[Ll]oss\b[^\n]{0,60}\b(nan|NaN|NAN|inf|Inf)\b|"
        r"\b(nan|NaN|NAN)\b[^\n]{0,30}\b[Ll]oss\b|non-?finite",
        "uncaught-exception",
        "The program stopped on a NaN or Inf value.",
        "fpdoctor trace -- SCRIPT.py ARGS   # names the first op that produced it, with module, shapes and inputs",
    ),
    _e(
        "dtype-mismatch",
        r"must have the same dtype|expected scalar type \w+ but found \w+|same dtype, but got",
        "uncaught-exception",
        "An op received operands of different dtypes: some parameters or inputs were not cast with the rest.",
        "fpdoctor audit MODEL   # which module and operand has the odd dtype, and the smallest fix",
    ),
    _e(
        "device-mismatch",
        r"Expected all tensors to be on the same device",
        "uncaught-exception",
        "An op received tensors on different devices: a module or input was not moved with the rest.",
        "fpdoctor audit MODEL --device cuda",
    ),
    _e(
        "dataloader-worker",
        r"DataLoader worker \(pids?\(?s?\)? [^)]*\) (is killed by signal|exited unexpectedly)",
        "uncaught-exception",
        "A DataLoader worker process died. 'Killed' is usually the out-of-memory killer (each worker holds a copy "
        "of what the dataset references); 'Bus error' a /dev/shm too small for the batches workers pass back.",
        "dmesg -T | grep -i -E 'out of memory|killed process'\n"
        "# fewer workers (num_workers), a smaller prefetch_factor; in Docker --shm-size=16g or --ipc=host",
    ),
    _e(
        "peer-gone",
        r"Connection closed by peer|Connection reset by peer|remote worker crashing|ncclRemoteError",
        "uncaught-exception",
        "A collective lost its connection to another rank: the other rank died first.",
        "Debug the rank that failed first.",
    ),
)


def explain_text(text: str) -> ErrorText | None:
    for error in ERRORS:
        if error.pattern.search(text):
            return error
    return None
