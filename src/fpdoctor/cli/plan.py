"""`fpdoctor plan MODEL --candidate ... [--reference fp32|fp64] [--metric kl|top1|rel]`: a verified
keep-in-fp32 plan, judged in the metric asked for."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fpdoctor.cli.compare import add_precision_args, check_precision_args
from fpdoctor.cli.errors import UsageError
from fpdoctor.cli.model_spec import FACTORY_HELP
from fpdoctor.cli.output import add_output_args, add_progress_arg, emit, write_atomic
from fpdoctor.precision.names import PLAN_CANDIDATES
from fpdoctor.precision.plan.metric import METRICS


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
        "--metric",
        metavar="kl|top1|rel",
        help="what the plan targets and ranks its what-ifs by: kl (KL of the logits' softmax against fp64's), top1 "
        "(top-1 agreement with fp64) or rel (relative error of the output). Default: kl where the output is logits "
        "(its last call is a Linear from features to classes) and compare finds their decisions changed, which the "
        "relative error misses: KL is continuous (it ranks modules that leave the same number of flips apart, on few "
        "rows too) and reads the whole distribution that sampling and the loss read, with top-1 measured beside it; "
        "rel otherwise, where the two agree and a regression head of the same shape cannot be told from logits, and "
        "whenever --tolerance is given without --metric",
    )
    p.add_argument(
        "--decisions",
        choices=["argmax", "none"],
        help="argmax: the output's scores decide by their argmax over the last dim, as `fpdoctor compare "
        "--decisions argmax` judges them: --metric kl and top1 then apply; none: the output decides no class (a "
        "regression from a Linear head), --metric rel",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        help="the value to reach, in the metric's units: a relative error (rel), nats (kl), the share of rows whose "
        "top-1 may differ from fp64's (top1). Default: 16x the output's floor (the error of rounding the exact "
        "output to the candidate; 256x for kl, which grows with the error's square; compare's decisions-changed "
        "rule for top1); one below what rounding the inputs alone costs is out of reach, and the plan is judged "
        "against 2x that floor",
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

    if args.candidate is not None and model_spec.is_function_spec(args.candidate):
        raise UsageError(
            f"plan keeps modules in fp32 for a precision; for a model your function makes ({args.candidate}), "
            f"`fpdoctor compare {args.model} --candidate {args.candidate}` names the modules to leave out of it, "
            "checked"
        )
    candidate, reference, fp8_kernel = check_precision_args(args, PLAN_CANDIDATES)
    if args.metric is not None and args.metric not in METRICS:
        raise UsageError(
            f"--metric must be one of {', '.join(METRICS)} (got {args.metric!r}); kl and top1 judge logits"
        )
    if args.tolerance is not None and args.metric == "top1" and not 0 < args.tolerance < 1:
        raise UsageError("with --metric top1, --tolerance is the share of rows whose top-1 may differ, e.g. 0.01")
    if args.tolerance is not None and not args.tolerance > 0:
        raise UsageError("--tolerance must be a positive value in the plan's metric, e.g. 1e-3")
    with progress.task(f"plan: loading {args.model} (import torch, build the model)"):
        model, inputs = model_spec.load(args.model)
    try:
        result = plan(
            model,
            inputs,
            candidate=candidate,
            reference=reference,
            tolerance=args.tolerance,
            fp8_kernel=fp8_kernel,
            metric=args.metric,
            decisions=args.decisions,
        )
    except ReferenceFailed as exc:
        raise UsageError(f"{exc}; {exc.fix}") from None
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
