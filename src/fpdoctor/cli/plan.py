"""`fpdoctor plan MODEL --candidate ... [--reference fp32|fp64]`: a verified keep-in-fp32 plan."""

from __future__ import annotations

import argparse
from typing import Any

from fpdoctor.cli.compare import add_precision_args, check_precision_args
from fpdoctor.cli.errors import UsageError
from fpdoctor.cli.output import add_output_args, emit
from fpdoctor.precision.names import PLAN_CANDIDATES


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="the smallest set of modules to keep in fp32, verified by re-running",
        description="MODEL is path/to/file.py:factory or package.module:factory.",
    )
    add_precision_args(p, PLAN_CANDIDATES)
    p.add_argument("--tolerance", type=float, help="end-to-end relative error to reach (default: 16x the noise floor)")
    add_output_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fpdoctor.cli import model_spec
    from fpdoctor.precision.compare import ReferenceFailed
    from fpdoctor.precision.plan import plan

    candidate, reference, fp8_kernel = check_precision_args(args, PLAN_CANDIDATES)
    if args.tolerance is not None and not args.tolerance > 0:
        raise UsageError("--tolerance must be a positive relative error, e.g. 1e-3")
    model, inputs = model_spec.load(args.model)
    try:
        result = plan(
            model, inputs, candidate=candidate, reference=reference, tolerance=args.tolerance, fp8_kernel=fp8_kernel
        )
    except ReferenceFailed as exc:
        raise UsageError(f"{exc}; fix the model or its example inputs first") from None
    report = result.report
    if args.format == "text":
        report.data["summary"].append(("code", "\n" + result.plan.to_code()))
    emit(report.to_dict(), args)
    # SPEC 3.3: 1 when the report holds an error, as a divergence that needed the plan does
    return report.exit_code
