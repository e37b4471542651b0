"""Signals by name: what a crash report, a child's return code and a launcher's log call them.

One module for every use: `fpdoctor run` reads signal numbers from torchrun's and UCX's logs, and
every child fpdoctor starts (the torch facts, the probes, the GEMM fingerprints) reports a signal
death as a negative return code.
"""

from __future__ import annotations

import signal


def signal_name(signum: int) -> str:
    """SIGSEGV for 11; `signal 99` for a number this platform has no name for."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def died_of(returncode: int) -> str | None:
    """The signal a child process died of, from its return code (subprocess reports signal N as -N);
    None when it exited by itself."""
    return signal_name(-returncode) if returncode < 0 else None


# Signals whose default action does not end a process (no process dies of them), and those whose
# default action writes a core file: fpdoctor's own core says nothing of the job
# (the command's process already wrote its own where the limits allow).
_NOT_FATAL = ("SIGCHLD", "SIGCONT", "SIGURG", "SIGWINCH", "SIGSTOP", "SIGTSTP", "SIGTTIN", "SIGTTOU")
_CORE = ("SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS", "SIGILL", "SIGQUIT", "SIGSYS", "SIGTRAP", "SIGXCPU", "SIGXFSZ")


def die_of(signum: int) -> int:
    """End this process by signal `signum`, as the program it ran died of it: a shell, Slurm
    (`0:N`, not `128+N:0`), torchrun and `returncode < 0` then see the death by signal it would have
    seen without fpdoctor. The default action is put back and the signal unblocked first (a
    handler or mask of fpdoctor's own must not swallow it), and no core file is written for
    fpdoctor itself. Returns 128+N, the shell's number for it, only where the signal does not end
    the process (a signal whose default action is not to terminate)."""
    import contextlib
    import os
    import sys

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: the death is what matters now
            stream.flush()
    if signal_name(signum) in _CORE:
        with contextlib.suppress(ImportError, OSError, ValueError):
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        with contextlib.suppress(OSError, ValueError):  # not the main thread: the default is already there
            signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    if signal_name(signum) not in _NOT_FATAL:
        with contextlib.suppress(OSError):  # a number this platform has no signal for
            os.kill(os.getpid(), signum)
    return 128 + signum
