"""`fpdoctor env [--from FILE ...] [--probe/--no-probe] [--save-facts FILE]` and `fpdoctor env --diff A B`."""

from __future__ import annotations

import argparse
import math
from typing import Any

from fpdoctor.cli.output import UsageError, add_output_args, emit, write_atomic
from fpdoctor.report.model import json_text


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "env",
        help="diagnose the PyTorch/CUDA environment (or a pasted report with --from)",
        description="Facts about GPUs, driver, torch build and CUDA libraries, judged by fpdoctor's rule base.",
    )
    p.add_argument(
        "--from",
        dest="from_files",
        action="append",
        metavar="FILE",
        help="diagnose a collect_env report, a saved facts JSON, an error log or nvidia-smi output instead of "
        "this machine; repeat for several files about one machine (they are joined); - reads standard input",
    )
    p.add_argument(
        "--probe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run isolated GEMM probes per dtype (default: on where a GPU is present)",
    )
    p.add_argument("--probe-timeout", type=float, default=60.0, metavar="SECONDS", help="per-probe timeout")
    p.add_argument("--save-facts", metavar="FILE", help="also write the collected facts as JSON (secrets redacted)")
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="what differs between two machines that can change a result or crash: each a saved facts file, "
        "a collect_env report or a log (what --from reads), or . for this machine; exit 1 when a difference "
        "is error-level",
    )
    add_output_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not math.isfinite(args.probe_timeout) or args.probe_timeout <= 0:
        raise UsageError("--probe-timeout must be a positive number of seconds, e.g. --probe-timeout 60")
    if args.diff is not None:
        return _diff(args)
    child = getattr(args, "torch_child", None)
    if args.from_files is None and child is None:
        # Start `import torch` in its child first: it is most of the wall time, and the other
        # sources are collected while it runs.
        from fpdoctor.env.sources.torch_child import spawn

        child = spawn()
    from fpdoctor.env.doctor import diagnose_env
    from fpdoctor.errors import InputError

    try:
        report = diagnose_env(
            from_file=args.from_files, probe=args.probe, probe_timeout_s=args.probe_timeout, child=child
        )
    except InputError as exc:
        raise UsageError(str(exc)) from exc
    data = report.to_dict()
    if args.save_facts:
        # Standard JSON (a probe's infinite error is written "inf"), so any strict parser reads it back.
        write_atomic(args.save_facts, json_text(data["data"]["facts"]) + "\n")
    emit(data, args)
    return report.exit_code


def _diff(args: argparse.Namespace) -> int:
    for given, flag in ((args.from_files, "--from"), (args.save_facts, "--save-facts"), (args.probe, "--probe")):
        if given is not None:
            raise UsageError(f"--diff A B compares two inputs and takes no {flag}; run `fpdoctor env {flag} ...` apart")
    from fpdoctor.env.diff import diff_env
    from fpdoctor.errors import InputError

    try:
        report = diff_env(*args.diff)
    except InputError as exc:
        raise UsageError(str(exc)) from exc
    emit(report.to_dict(), args)
    return report.exit_code
