"""Crash-capture (CRS) finding codes: what `fpdoctor run` says about a process that ended badly."""

from __future__ import annotations

from fpdoctor.catalog import RuleInfo
from fpdoctor.report.model import Severity

# RuleInfo.untried: the job has ended; fpdoctor does not run it again (a re-run repeats its side effects).
_ENDED = "the job has ended and fpdoctor does not run it again: the next step is the user's re-run"

CRS_RULES: tuple[RuleInfo, ...] = (
    RuleInfo(
        code="CRS001",
        name="fatal-signal",
        severity=Severity.ERROR,
        untried=_ENDED,
        title="A process died by a signal",
        what="Names the signal (SIGFPE, SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGKILL, ...), the process (pid, rank, "
        "local rank, host, GPU), the Python stack of every thread (faulthandler), the aten ops in flight with "
        "module, shapes, dtypes and device (with --breadcrumbs), native frames the process printed, the tail of "
        "the cuBLASLt log and new NVIDIA kernel-log lines. SIGKILL, which leaves no trace inside the process, is "
        "reported as killed from outside.",
        why="A death by signal leaves almost nothing behind: a launcher prints 'Signal 8 (SIGFPE) received by PID' "
        "and 'error_file: <N/A>', a shell prints 'Floating point exception (core dumped)'. The cause is in native "
        "code (a library bug such as cuBLASLt on H20, an ABI mismatch, memory corruption) or outside the process "
        "(the out-of-memory killer), and the stack shows where Python was when it happened.",
        fix="Re-run with breadcrumbs to see the op in flight: fpdoctor run --breadcrumbs -- COMMAND; check the "
        "environment verdicts joined in the report (fpdoctor env).",
        references=("https://docs.python.org/3/library/faulthandler.html",),
    ),
    RuleInfo(
        code="CRS002",
        name="uncaught-exception",
        severity=Severity.ERROR,
        untried=_ENDED,
        title="A process ended with an uncaught Python exception",
        what="Records the exception and its traceback in every Python process the command starts (sys.excepthook "
        "and threading.excepthook, chained to hooks already installed), with the process's rank and host, and "
        "explains known texts: non-finite losses, dtype and device mismatches. Under `fpdoctor trace`, the "
        "script's own exception (or sys.exit(n) with n != 0): its type, message and line, after what was traced "
        "before it; trace then exits with the status python would have given.",
        why="Under a launcher every rank prints its own traceback into one interleaved stream; the first failure "
        "is hard to find among the secondary ones it caused.",
        fix="Fix the error the traceback ends in; for NaN/Inf run the script under fpdoctor trace -- SCRIPT.py.",
    ),
    RuleInfo(
        code="CRS003",
        name="cuda-error",
        severity=Severity.ERROR,
        untried=_ENDED,
        title="A process ended with a CUDA, cuBLAS, cuDNN or NCCL error",
        what="Matches the error text of an exception or of a C++ abort ('terminate called after throwing', "
        "'what():') against known CUDA-stack errors: illegal memory access, device-side assert, CUBLAS_STATUS_*, "
        "CUDNN_STATUS_*, out of memory, NCCL errors and watchdog timeouts, missing kernel images.",
        why="CUDA errors are reported asynchronously: the Python line in the traceback is often not the kernel "
        "that failed, and the message names a status, not a cause.",
        fix="Re-run with CUDA_LAUNCH_BLOCKING=1 to make the failing kernel raise at its own line; the finding gives "
        "the error's usual causes and checks.",
        references=("https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html",),
    ),
    RuleInfo(
        code="CRS004",
        name="rank-stopped",
        severity=Severity.INFO,
        untried=_ENDED,
        title="A rank stopped because another rank failed first",
        what="For every other rank of a distributed job: what it was doing when the first rank died (waiting in "
        "a collective, computing, already finished) and how it ended (terminated by the launcher, a collective "
        "error, its own exit), with its Python stack.",
        why="After one rank dies the others fail in turn (connection closed, watchdog timeout, SIGTERM from "
        "torchrun); their errors are consequences, and the rank that failed first is the one to debug.",
        fix="Nothing to fix on this rank: debug the rank that failed first.",
    ),
    RuleInfo(
        code="CRS005",
        name="nonzero-exit",
        severity=Severity.ERROR,
        untried=_ENDED,
        title="A process exited with a non-zero status, without an exception or a signal",
        what="A rank that ended with a non-zero status and left no Python exception and no signal (os._exit(N), "
        "sys.exit(N), a native exit()), its status read from its launcher (torchrun's failure summary, mp.spawn's "
        "ProcessExitedException) and its end from when fpdoctor saw it gone; also the command itself when it "
        "exited non-zero and no process of it crashed, raised or was killed (only in the report file: its own "
        "output says why, and nothing is added to it).",
        why="A rank that leaves with os._exit leaves no traceback; its launcher then stops the other ranks, and "
        "their SIGTERM or lost-connection errors are all that the log shows. A job whose report says OK beside "
        "a non-zero exit status would pass a check that reads the report.",
        fix="Read the last lines the process printed before it exited, and look for the os._exit / sys.exit / "
        "exit() call that gives that status in the code it ran.",
    ),
)
