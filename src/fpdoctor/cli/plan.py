"""`fpdoctor plan MODEL --candidate ... [--reference fp32|fp64]`: a verified keep-in-fp32 plan."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fpdoctor.cli.compare import add_precision_args, check_precision_args
from fpdoctor.cli.errors import UsageError
from fpdoctor.cli.model_spec import FACTORY_HELP
from fpdoctor.cli.output import add_output_args, add_progress_arg, emit, write_atomic
from fpdoctor.precision.names import PLAN_CANDIDATES


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "plan",
        help="the smallest set of modules to keep in fp32, verified by re-running",
        description=(
            "The smallest set of modules to keep in fp32 for a lower precision, verified end to end on every\n"
            "input set, with the code that applies it (plain torch).\n\n" + FACTORY_HELP
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_precision_args(p, PLAN_CANDIDATES)
    p.add_argument(
        "--tolerance",
        type=float,
        help="end-to-end relative error to reach (default: 16x the output's noise floor); one below what rounding "
        "the inputs alone costs is out of reach, and the plan is judged against 2x that floor",
    )
    add_output_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fpdoctor import progress
    from fpdoctor.cli import model_spec
    from fpdoctor.precision.compare.compare import ReferenceFailed
    from fpdoctor.precision.plan.plan import plan
    from fpdoctor.report.render import render

    candidate, reference, fp8_kernel = check_precision_args(args, PLAN_CANDIDATES)
    if args.tolerance is not None and not args.tolerance > 0:
        raise UsageError("--tolerance must be a positive relative error, e.g. 1e-3")
    with progress.task(f"plan: loading {args.model} (import torch, build the model)"):
        model, inputs = model_spec.load(args.model)
    try:
        result = plan(
            model, inputs, candidate=candidate, reference=reference, tolerance=args.tolerance, fp8_kernel=fp8_kernel
        )
    except ReferenceFailed as exc:
        raise UsageError(f"{exc}; fix the model or its example inputs first") from None
    except ValueError as exc:  # e.g. an empty list of input sets
        raise UsageError(str(exc)) from None
    report = result.report
    code = _code_section(result.plan.to_code(), args.format)
    if args.output:
        write_atomic(args.output, render(report.to_dict(), args.format, color=False) + code)
    else:
        emit(report.to_dict(), args)
        sys.stdout.write(code)
    # 1 when the report holds an error: a plan that cannot be verified, or a model that
    # does not run as given; a verified plan turns the divergences it fixes into warnings
    return report.exit_code


def _code_section(code: str, fmt: str) -> str:
    """The plan as code, after the report: text and markdown; JSON and HTML carry it in data.plan.code."""
    if fmt == "text":
        return "\nThe plan as code (plain torch; fpdoctor.apply_plan(model, plan) does the same):\n\n" + code
    if fmt == "markdown":
        return f"\n**The plan as code** (plain torch):\n\n```python\n{code}```\n"
    return ""
