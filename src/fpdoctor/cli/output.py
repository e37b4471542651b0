"""What every subcommand shares: --format/-o, atomic writes, exit codes, one-line errors."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from fpdoctor.cli.errors import ExitCode, UsageError
from fpdoctor.errors import InputError
from fpdoctor.report import write
from fpdoctor.report.render import FORMATS, render

__all__ = [
    "ExitCode",
    "UsageError",
    "add_output_args",
    "add_progress_arg",
    "emit",
    "emit_after_program",
    "resolve_output",
    "write_atomic",
    "write_or_stderr",
]


def add_output_args(parser: argparse.ArgumentParser, *, instead_of: str = "stdout") -> None:
    """--format, -o and -v; `instead_of` says where the report goes without -o (emit's stream)."""
    parser.add_argument(
        "--format", choices=FORMATS, default=None, help="output format (default: from -o's extension, else text)"
    )
    parser.add_argument("-o", "--output", metavar="FILE", help=f"write the report to FILE instead of {instead_of}")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="text: every fact, even when nothing is wrong (default: the lead)"
    )


def add_progress_arg(parser: argparse.ArgumentParser) -> None:
    """--quiet for the commands that show progress (cli/main.py switches the display on for them)."""
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress display on stderr (shown only while stderr is a terminal; errors are always shown)",
    )


def resolve_output(args: argparse.Namespace) -> None:
    """Before any work: the format follows -o's extension unless --format says otherwise
    (`-o report.json` writes JSON), and a directory that -o needs must exist - found out
    now, not after a long run whose report would then be lost."""
    if not hasattr(args, "format"):
        return
    output = getattr(args, "output", None)
    if args.format is None:
        args.format = write.format_for(output) if output else "text"
    # run and health (a scheduler's wrapper and gate) run in any case and keep their exit status: an
    # -o they cannot write is one line on stderr when the report is due, the report beside it
    if output and not getattr(args, "report_whatever_happens", False):
        parent = Path(output).parent
        if not parent.exists():
            raise UsageError(f"{parent} does not exist; create it or choose another path for -o")


def write_atomic(path: str, text: str) -> None:
    """Write via a temporary file in the same directory and rename, so a reader never sees half a
    file; a failure is one line (UsageError), never a traceback."""
    try:
        write.write_text(path, text)
    except InputError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:  # read-only, full, gone: the system's reason
        raise UsageError(f"could not write {path}: {exc.strerror or exc}") from None


def write_or_stderr(path: str, text: str) -> bool:
    """For the commands that run the user's program (run, watch, trace), whose exit status is the
    program's whatever fpdoctor fails at: `text` to `path`, or, when that cannot be written, one
    line on stderr and `text` after it there instead. False when it went to stderr."""
    try:
        write.write_text(path, text)
    except (InputError, OSError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        sys.stderr.flush()
        sys.stderr.write(f"fpdoctor: could not write the report to {path}: {reason}; the report follows on stderr\n")
        sys.stderr.write(text)
        sys.stderr.flush()
        return False
    return True


def emit(report_dict: dict[str, Any], args: argparse.Namespace) -> None:
    """The report to -o, else to stdout."""
    if args.output:
        write_atomic(args.output, write.file_text(report_dict, args.output, args.format))
        return
    _show(report_dict, args, sys.stdout)


def emit_after_program(report_dict: dict[str, Any], args: argparse.Namespace) -> None:
    """The report of a command that ran the user's program (watch, trace): to -o, else to stderr
    (stdout is the program's); an -o that cannot be written sends it to stderr (write_or_stderr)."""
    if args.output:
        write_or_stderr(args.output, write.file_text(report_dict, args.output, args.format))
        return
    _show(report_dict, args, sys.stderr)


def _show(report_dict: dict[str, Any], args: argparse.Namespace, out: Any) -> None:
    color = args.format == "text" and out.isatty() and "NO_COLOR" not in os.environ
    out.write(render(report_dict, args.format, color=color, verbose=getattr(args, "verbose", False)))
