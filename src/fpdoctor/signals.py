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
