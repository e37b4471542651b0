"""`fpdoctor compare MODEL --candidate fp16|bf16|fp32|fp8-...|fp16-accumulate [--reference R] [--device DEV]
[--module NAME]`."""

from __future__ import annotations

import argparse
from typing import Any

from fpdoctor.cli.errors import UsageError
from fpdoctor.cli.model_spec import FACTORY_HELP
from fpdoctor.cli.output import add_output_args, add_progress_arg, emit
from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, REFERENCES, check_name


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="layerwise error of a precision against fp64, module by module",
        description="Layerwise error of a precision against fp64, module by module.\n\n" + FACTORY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_precision_args(p, CANDIDATES)
    p.add_argument(
        "--device",
        metavar="DEVICE",
        help="run the candidate on this device (cuda, cuda:1, mps, xpu) against the reference where the model is",
    )
    p.add_argument(
        "--module",
        metavar="NAME",
        help="compare only this submodule (e.g. encoder.layer.3), fed its inputs from a forward of the whole model",
    )
    add_output_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run)


def add_precision_args(p: argparse.ArgumentParser, candidates: tuple[str, ...]) -> None:
    """MODEL, --candidate, --reference and --fp8-kernel: what compare and plan both take."""
    p.add_argument("model", metavar="MODEL")
    p.add_argument(
        "--candidate",
        required=True,
        metavar="|".join(candidates),
        help="the precision to judge; torch's names work too (float16, half, bfloat16, float8_e4m3fn)",
    )
    p.add_argument("--reference", default="fp32", metavar="|".join(REFERENCES), help="default: fp32")
    p.add_argument(
        "--fp8-kernel",
        default="auto",
        metavar="|".join(FP8_KERNELS),
        help="fp8 candidates: the real fp8 GEMM (torch._scaled_mm), fake-quant, or auto: the real one on GPUs "
        "with fp8 tensor cores (default)",
    )


def check_precision_args(args: argparse.Namespace, candidates: tuple[str, ...]) -> tuple[str, str, str]:
    """(candidate, reference, fp8 kernel), or a UsageError naming the bad one and the choices."""
    try:
        return (
            check_name(args.candidate, candidates, "candidate"),
            check_name(args.reference, REFERENCES, "reference"),
            check_name(args.fp8_kernel, FP8_KERNELS, "fp8 kernel"),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from fpdoctor.cli import model_spec
    from fpdoctor.precision.compare import ReferenceFailed, compare

    candidate, reference, fp8_kernel = check_precision_args(args, CANDIDATES)
    if args.device is not None:
        from fpdoctor.precision.candidates import check_device

        try:
            check_device(args.device)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    model, inputs = model_spec.load(args.model)
    try:
        result = compare(
            model,
            inputs,
            candidate=candidate,
            reference=reference,
            device=args.device,
            fp8_kernel=fp8_kernel,
            module=args.module,
        )
    except ReferenceFailed as exc:
        raise UsageError(f"{exc}; fix the model or its example inputs first") from None
    except ValueError as exc:  # e.g. --module names no module of this model
        raise UsageError(str(exc)) from None
    emit(result.report.to_dict(), args)
    return result.report.exit_code
