"""`fpdoctor health [--duration S] [--from FILE ...] [--device cpu|cuda|cuda:N]`: one-shot GPU health.

Without --from it checks this machine: NVML facts per GPU and this boot's kernel log (no torch, no
CUDA in this process), then --duration seconds of GEMM fingerprints per GPU in child processes
(default 3; 0 skips them). Under torchrun every rank fingerprints its GPU and rank 0 prints one
table for all; the other ranks print nothing. With --from it judges saved files instead.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from fpdoctor.cli.output import UsageError, add_output_args, add_progress_arg, emit, write_atomic
from fpdoctor.report import write

DEFAULT_DURATION_S = 3.0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "health",
        help="GPU health: NVML facts, kernel-log Xids explained, GEMM fingerprints across GPUs",
        description="One-shot GPU health check: ECC, row remapping, throttling, recovery action and the kernel "
        "log's Xids per GPU, then deterministic GEMM fingerprints compared across repeats and GPUs. "
        "What could not be read is listed, never reported as healthy.",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"seconds of GEMM fingerprints per GPU (default {DEFAULT_DURATION_S:g}; 0: facts only, under a second)",
    )
    p.add_argument(
        "--from",
        dest="from_files",
        action="append",
        metavar="FILE",
        help="judge a saved kernel log (dmesg, journalctl -k), `nvidia-smi -q` output or health JSON instead "
        "of this machine; repeat for several files, - reads standard input",
    )
    p.add_argument(
        "--device",
        metavar="cpu|cuda|cuda:N",
        help="where fingerprints run: cuda (the default) every GPU of this node, or under torchrun each rank's "
        "GPU; cuda:N that one GPU; cpu the CPU",
    )
    add_output_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run, report_whatever_happens=True)  # the gate's status, whatever -o can be


def _checked(check: Callable[..., Any], value: Any, name: str) -> Any:
    try:
        return check(value, name=name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _duration(args: argparse.Namespace) -> float:
    from fpdoctor.health.fingerprint import check_duration

    if args.duration is None:
        return 0.0 if args.from_files else DEFAULT_DURATION_S
    duration = float(_checked(check_duration, args.duration, "--duration"))
    if args.from_files and duration > 0:
        raise UsageError("--duration runs fingerprints on this machine; it cannot be combined with --from")
    return duration


def run(args: argparse.Namespace) -> int:
    from fpdoctor.health.fingerprint import DeviceNotFound, check_device

    duration = _duration(args)
    device = None if args.device is None else str(_checked(check_device, args.device, "--device"))
    if device is not None and (args.from_files or duration == 0):
        raise UsageError("--device picks where fingerprints run; it needs --duration > 0 and no --from")
    from fpdoctor.health import InputError, health

    try:
        result = health(duration=duration, from_files=args.from_files, device=device)
    except (InputError, DeviceNotFound) as exc:
        raise UsageError(str(exc)) from exc
    # under torchrun only rank 0 (local rank 0 without fingerprints) reports, but every rank exits
    # with the verdict: a rank that exits otherwise makes torchrun stop the others and fail the job
    if result.reporting:
        _emit(result.report.to_dict(), args)
    return result.exit_code


def _emit(doc: dict[str, Any], args: argparse.Namespace) -> None:
    """The report to -o, else stdout. An -o that cannot be written (read-only, full, a directory
    that is not there) is one line on stderr and the report on stdout: the exit status stays the
    report's, which a drain gate reads (2 would leave a node with a dead GPU in service)."""
    if args.output:
        try:
            write_atomic(args.output, write.file_text(doc, args.output, args.format))
            return
        except UsageError as exc:
            sys.stderr.write(f"fpdoctor: {exc}; the report follows on stdout\n")
            sys.stderr.flush()
    emit(doc, argparse.Namespace(**{**vars(args), "output": None}))
