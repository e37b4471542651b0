"""`fpdoctor run [--breadcrumbs] [--env-from FILE] [--wait S] -- COMMAND [ARGS...]`: crash capture.

The command's output passes through unchanged and fpdoctor ends as the command ended: with its
exit status, or, after the report, by the signal it died of. When it fails, the report goes to
stderr after the command's output; -o FILE gets it in any format, always (on stderr instead,
after one line, when FILE cannot be written). A command that exits 0 gets nothing added.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
from typing import Any

from fpdoctor.cli.output import UsageError, write_or_stderr
from fpdoctor.report.render import FORMATS


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a command (python, torchrun, accelerate, a script); when a process dies, report why",
        description="Runs COMMAND with every Python process it starts instrumented (faulthandler, process "
        "records, uncaught exceptions; the op ring with --breadcrumbs). When a process dies by a signal or "
        "an error, the report names it, its rank, stack, ops in flight and the environment verdicts. "
        "Exit status: the command's; a command that died of a signal has fpdoctor die of the same signal "
        "after the report (a shell shows 128+N).",
    )
    p.add_argument(
        "--breadcrumbs",
        action="store_true",
        help="record the aten ops in flight (module, shapes, dtypes, device) and the cuBLASLt log; "
        "costs time per op (see benchmarks/README.md), so use it to re-run a crash",
    )
    p.add_argument(
        "--repro",
        metavar="DIR",
        help="with --breadcrumbs: after a fatal signal, write a reproducer of the op in flight into DIR "
        "(recorded shapes, dtypes and device, seeded values), run it once, and print the commands that run it "
        "under compute-sanitizer and with the cuBLASLt log",
    )
    p.add_argument(
        "--env-from",
        metavar="FILE",
        help="join the environment verdicts of a saved facts JSON or collect_env report (another node) "
        "instead of this machine's",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the command if it is still running SECONDS after a rank failed (for a launcher that "
        "never notices a dead rank); by default fpdoctor never stops it: its launcher's own shutdown decides",
    )
    # --format and -o as every command has them (cli/output.py), said for where this report goes
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="report format (default: from -o's extension, else text); on stderr without -o",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="also write the report to FILE, even after a clean run (stderr then gets the text report "
        "only when the command failed)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND [ARGS...]")
    p.set_defaults(run=run, report_whatever_happens=True)  # a missing -o directory never stops the command


def run(args: argparse.Namespace) -> int:
    argv = list(args.command)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("no command given; usage: fpdoctor run [--breadcrumbs] -- COMMAND [ARGS...]")
    if args.wait is not None and args.wait < 0:
        raise UsageError(f"--wait must be 0 or more seconds, got {args.wait:g}")
    from fpdoctor.crash import CommandError, run_command
    from fpdoctor.errors import InputError

    if args.repro is not None:
        if not args.breadcrumbs:
            raise UsageError("--repro needs --breadcrumbs: the op in flight is read from them")
        from fpdoctor.numerics.trace.repro import check_dir

        try:
            check_dir(args.repro)
        except InputError as exc:
            raise UsageError(str(exc)) from None

    from fpdoctor.crash.streams import CLOSED

    try:
        result = run_command(
            argv,
            breadcrumbs=args.breadcrumbs,
            env_from=args.env_from,
            wait_s=args.wait,
            program=program(),
            repro=args.repro,
            stdout=CLOSED if sys.stdout is None else sys.stdout,  # `>&-`: closed for the command too
        )
    except CommandError as exc:
        raise UsageError(str(exc)) from exc
    except InputError as exc:
        raise UsageError(f"--env-from: {exc}") from exc
    # a command that exits 0 gets nothing added to its streams, whatever was handled inside it
    try:
        _emit(result.report.to_dict(), args, result.failed and result.exit_code != 0)
    except Exception as exc:  # ours (a closed stderr, a renderer's bug): the command's status still passes through
        with contextlib.suppress(Exception):
            sys.stderr.write(f"fpdoctor: the report could not be written: {type(exc).__name__}: {exc}\n")
    if result.signal is not None:
        from fpdoctor.signals import die_of

        return die_of(result.signal)  # as the command died: Slurm's 0:N, torchrun's 'Signal N', returncode -N
    return result.exit_code


def program() -> list[str]:
    """How to start this fpdoctor from a shell, for the re-run command the report prints:
    `fpdoctor` when that name on PATH is this installation's, else this interpreter's -m."""
    found = shutil.which("fpdoctor")
    with contextlib.suppress(OSError):
        if found and os.path.samefile(os.path.dirname(found), os.path.dirname(sys.executable)):
            return ["fpdoctor"]
    return [sys.executable, "-m", "fpdoctor"]


def _emit(doc: dict[str, Any], args: argparse.Namespace, findings: bool) -> None:
    """-o FILE always gets the report; stderr gets it only when the command failed and there is
    something to say. An -o that cannot be written is one line on stderr with the file's report
    after it: the command's exit status stays the one fpdoctor exits with."""
    from fpdoctor.report.render import render

    # an -o write that failed has put the file's report on stderr: the text one is not shown twice
    fell_back = bool(args.output) and not write_or_stderr(args.output, render(doc, args.format, color=False))
    if not findings or (fell_back and args.format == "text"):
        return
    fmt = "text" if args.output else args.format
    color = fmt == "text" and sys.stderr.isatty() and "NO_COLOR" not in os.environ
    sys.stderr.flush()
    sys.stderr.write(render(doc, fmt, color=color))
    sys.stderr.flush()
