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

__all__ = ["ExitCode", "UsageError", "add_output_args", "add_progress_arg", "emit", "resolve_output", "write_atomic"]


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
    if output:
        parent = Path(output).parent
        if not parent.exists():
            raise UsageError(f"{parent} does not exist; create it or choose another path for -o")


def write_atomic(path: str, text: str) -> None:
    """Write via a temporary file in the same directory and rename, so a reader never sees half a file."""
    try:
        write.write_text(path, text)
    except InputError as exc:
        raise UsageError(str(exc)) from None


def emit(report_dict: dict[str, Any], args: argparse.Namespace, *, stream: Any = None) -> None:
    """The report to -o, else to `stream` (stdout; stderr for commands that run the user's
    program, whose stdout is the program's own)."""
    if args.output:
        try:
            write.write(report_dict, args.output, args.format)
        except InputError as exc:
            raise UsageError(str(exc)) from None
        return
    out = stream or sys.stdout
    color = args.format == "text" and out.isatty() and "NO_COLOR" not in os.environ
    out.write(render(report_dict, args.format, color=color, verbose=getattr(args, "verbose", False)))
