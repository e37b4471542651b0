"""`fpdoctor env [--from FILE] [--probe/--no-probe] [--save-facts FILE]`."""

from __future__ import annotations

import argparse
import json
from typing import Any

from fpdoctor.cli.output import UsageError, add_output_args, emit, write_atomic


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "env",
        help="diagnose the PyTorch/CUDA environment (or a pasted report with --from)",
        description="Facts about GPUs, driver, torch build and CUDA libraries, judged by fpdoctor's rule base.",
    )
    p.add_argument(
        "--from",
        dest="from_file",
        metavar="FILE",
        help="diagnose a collect_env report, a saved facts JSON or an error log instead of this machine",
    )
    p.add_argument(
        "--probe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run isolated GEMM probes per dtype (default: on where a GPU is present)",
    )
    p.add_argument("--probe-timeout", type=float, default=60.0, metavar="SECONDS", help="per-probe timeout")
    p.add_argument("--save-facts", metavar="FILE", help="also write the collected facts as JSON (secrets redacted)")
    add_output_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.probe_timeout <= 0:
        raise UsageError("--probe-timeout must be a positive number of seconds")
    child = getattr(args, "torch_child", None)
    if args.from_file is None and child is None:
        # Start `import torch` in its child first: it is most of the wall time, and the other
        # sources are collected while it runs.
        from fpdoctor.env.sources.torch_child import spawn

        child = spawn()
    from fpdoctor.env.doctor import diagnose_env
    from fpdoctor.env.errors import InputError

    try:
        report = diagnose_env(
            from_file=args.from_file, probe=args.probe, probe_timeout_s=args.probe_timeout, child=child
        )
    except InputError as exc:
        raise UsageError(str(exc)) from exc
    data = report.to_dict()
    if args.save_facts:
        write_atomic(args.save_facts, json.dumps(data["data"]["facts"], indent=2, default=str) + "\n")
    emit(data, args)
    return report.exit_code
