"""`fpdoctor compare MODEL --candidate fp16|bf16|fp32|fp8-...|fp16-accumulate|compiled[-bf16]
[--reference R] [--device DEV] [--module NAME] [--save-reference FILE | --against FILE]`."""

from __future__ import annotations

import argparse
from typing import Any

from fpdoctor.cli.errors import UsageError
from fpdoctor.cli.model_spec import FACTORY_HELP
from fpdoctor.cli.output import add_output_args, add_progress_arg, emit
from fpdoctor.precision.names import CANDIDATES, FP8_KERNELS, REFERENCES, check_name, default_reference


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="layerwise error of a precision against fp64, module by module",
        description="Layerwise error of a precision against fp64, module by module.\n\n"
        + ACROSS_HELP
        + "\n\n"
        + FACTORY_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_precision_args(p, CANDIDATES, record=True)
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
    p.add_argument(
        "--inputs-as-given",
        action="store_true",
        help="feed the candidate the inputs in the dtype the factory gives them, not cast to its own: for a "
        "model that casts them itself (raw fp32 readings standardised before its first layer)",
    )
    p.add_argument(
        "--decisions",
        choices=["argmax", "none"],
        help="argmax: the output's scores decide by their argmax over the last dim (a ranker's scores over "
        "candidates, summed log-probabilities), judged by the decisions they make as logits are, where compare's "
        "own test for logits does not take them; none: the output decides no class (a regression of several values "
        "from a Linear head, which compare's test takes for logits), judged by its error alone",
    )
    across = p.add_mutually_exclusive_group()
    across.add_argument(
        "--save-reference",
        metavar="FILE",
        help="also write a compare record of this run to FILE (gzip'd JSON), to judge another machine's run "
        "against; --candidate defaults to fp32 then",
    )
    across.add_argument(
        "--against",
        metavar="FILE",
        help="judge this machine's run against a record another machine wrote with --save-reference; the "
        "candidate, reference, fp8 kernel and module come from the record",
    )
    add_output_args(p)
    add_progress_arg(p)
    p.set_defaults(run=run)


def add_precision_args(p: argparse.ArgumentParser, candidates: tuple[str, ...], *, record: bool = False) -> None:
    """MODEL, --candidate, --reference and --fp8-kernel: what compare and plan both take. `record`:
    compare's, where a record may supply them (--against), so none is required or defaulted here."""
    p.add_argument("model", metavar="MODEL")
    p.add_argument(
        "--candidate",
        required=not record,
        metavar="|".join(candidates),
        help="the precision to judge; torch's names work too (float16, half, bfloat16, float8_e4m3fn)"
        + (
            "; or FILE.py:FUNCTION, a function of yours that takes the model and returns the candidate it makes "
            "(quantize_dynamic, a pruning); required, except with --save-reference (default fp32) and --against "
            "(the record's)"
            if record
            else ""
        ),
    )
    fp64_too = "; fp64 for an fp32 candidate without --device" if record else ""
    p.add_argument("--reference", default=None if record else "fp32", metavar="|".join(REFERENCES),
                   help="default: fp32" + fp64_too)  # fmt: skip
    p.add_argument(
        "--fp8-kernel",
        default=None if record else "auto",
        metavar="|".join(FP8_KERNELS),
        help="fp8 candidates: the real fp8 GEMM (torch._scaled_mm), fake-quant, or auto: the real one on GPUs "
        "with fp8 tensor cores (default)",
    )


def check_precision_args(args: argparse.Namespace, candidates: tuple[str, ...]) -> tuple[str, str, str]:
    """(candidate, reference, fp8 kernel), or a UsageError naming the bad one and the choices."""
    if args.candidate is None:
        raise UsageError(
            "compare needs --candidate (fp16, bf16, fp32, fp8-e4m3, ...), or --against FILE, which takes it from "
            "the record"
        )
    try:
        candidate = check_name(args.candidate, candidates, "candidate")  # torch's names too: float32 is fp32
        return (
            candidate,
            check_name(args.reference or _default_reference(args, candidate), REFERENCES, "reference"),
            check_name(args.fp8_kernel or "auto", FP8_KERNELS, "fp8 kernel"),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _default_reference(args: argparse.Namespace, candidate: str) -> str:
    """fp32, or fp64 for an fp32 candidate compared on the model's own device (not for a record, whose
    fp32 floor the other machine's run is compared with)."""
    if getattr(args, "save_reference", None) is not None or getattr(args, "against", None) is not None:
        return "fp32"
    return default_reference(candidate, getattr(args, "device", None))


ACROSS_HELP = """\
Across machines (when the two cannot run side by side): on machine A
  fpdoctor compare model.py:make --candidate fp16 --save-reference a.json.gz
copy a.json.gz to machine B and run there
  fpdoctor compare model.py:make --against a.json.gz
B runs the same compare and names the first module where it departs from A (beyond the fp64
noise floor, or NaN/Inf on one machine only), or says that the inputs, weights or computation
differ. The record is gzip'd JSON, about 97 KiB per module call at most."""


def run(args: argparse.Namespace) -> int:
    from fpdoctor.cli import model_spec
    from fpdoctor.precision.compare.compare import ReferenceFailed, compare
    from fpdoctor.precision.record.record import CompareRecord, RecordError

    record = None
    transform = None
    if args.candidate is not None and model_spec.is_function_spec(args.candidate):  # a function of the user's
        transform = _transform_args(args)
    elif args.against is not None:  # the record first: a bad file is known before a long run
        try:
            record = CompareRecord.load(args.against)
        except RecordError as exc:
            raise UsageError(str(exc)) from None
        candidate, reference, fp8_kernel = args.candidate, args.reference, args.fp8_kernel
    elif args.save_reference is not None and args.candidate is None:
        args.candidate = "fp32"
    if record is None and transform is None:
        candidate, reference, fp8_kernel = check_precision_args(args, CANDIDATES)
    if args.save_reference is not None:
        _check_record_path(args)
    if args.device is not None:
        from fpdoctor.precision.candidates import check_device

        try:
            check_device(args.device)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    model, inputs = model_spec.load(args.model)
    if transform is not None:
        try:
            result = compare(model, inputs, candidate=transform, decisions=args.decisions)
        except ReferenceFailed as exc:
            raise UsageError(f"{exc}; {exc.fix}") from None
        except ValueError as exc:  # the function made no model, or its model does not run on the inputs
            raise UsageError(str(exc)) from None
        emit(result.report.to_dict(), args)
        return result.report.exit_code
    try:
        result = compare(
            model,
            inputs,
            candidate=candidate,
            reference=reference,
            device=args.device,
            fp8_kernel=fp8_kernel,
            module=args.module,
            save_reference=args.save_reference,
            against=record,
            inputs_as_given=args.inputs_as_given,
            decisions=args.decisions,
        )
    except ReferenceFailed as exc:
        raise UsageError(f"{exc}; {exc.fix}") from None
    except ValueError as exc:  # --module names no module of this model; a setting the record does not have
        raise UsageError(str(exc)) from None
    if args.save_reference is not None:  # the command to run on machine B, with this MODEL spelled out
        summary = result.report.data["summary"]
        mine = f"compare {args.model} --against"
        summary[:] = [(k, v.replace("compare MODEL --against", mine) if isinstance(v, str) else v) for k, v in summary]
    emit(result.report.to_dict(), args)
    return result.report.exit_code


def _transform_args(args: argparse.Namespace) -> Any:
    """`--candidate FILE.py:FUNCTION`: the function, after the options it cannot take are refused."""
    from fpdoctor.cli import model_spec

    given = {
        "--reference": args.reference, "--device": args.device, "--module": args.module,
        "--save-reference": args.save_reference, "--against": args.against,
        "--inputs-as-given": args.inputs_as_given or None,
        "--fp8-kernel": args.fp8_kernel,
    }  # fmt: skip
    extra = [k for k, v in given.items() if v is not None]
    if extra:
        raise UsageError(
            f"--candidate {args.candidate} (a model your function makes, judged against fp64 in fp32) takes no "
            f"{', '.join(extra)}"
        )
    return model_spec.load_function(args.candidate)


def _check_record_path(args: argparse.Namespace) -> None:
    """Before the run: a record that could not be written would lose it."""
    from pathlib import Path

    target = Path(args.save_reference)
    if target.is_dir():
        raise UsageError(f"{target} is a directory; give a file name for --save-reference")
    if not target.parent.exists():
        raise UsageError(f"{target.parent} does not exist; create it or choose another path for --save-reference")
    if args.output and Path(args.output).resolve() == target.resolve():
        raise UsageError("--save-reference and -o name the same file; the record and the report need one each")
