"""`fpdoctor audit MODEL [--device cpu|cuda|mps]`."""

from __future__ import annotations

import argparse
from typing import Any

from fpdoctor.cli.model_spec import FACTORY_HELP
from fpdoctor.cli.output import add_output_args, emit


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="mixed dtypes/devices in a model, and dtype errors explained",
        description="Mixed dtypes and devices in a model; with its inputs, the forward runs and a dtype or\n"
        "device error is explained with each operand's origin.\n\n" + FACTORY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--device", choices=("cpu", "cuda", "mps"), help="move model and inputs there first")
    add_output_args(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from fpdoctor.cli import model_spec
    from fpdoctor.precision.audit.audit import audit

    model, inputs = model_spec.load(args.model)
    if args.device:
        model, inputs = model_spec.to_device(model, inputs, args.device)
    report = audit(model, inputs).report
    emit(report.to_dict(), args)
    return report.exit_code
