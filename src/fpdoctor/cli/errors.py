"""Exit codes and the usage error; kept tiny because the CLI imports it before anything else."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0  # no error-level finding
    FINDINGS = 1  # error-level findings
    USAGE = 2  # bad usage or bad input


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2, never a traceback."""
