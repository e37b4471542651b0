"""`fpdoctor trace [--dtype fp16|bf16] -- SCRIPT.py [ARGS...]`: a script the user will not edit."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Any

from fpdoctor.cli.output import UsageError, add_output_args, emit

_AUTOCAST = {"fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "trace",
        help="run a script under fpdoctor.trace() and report the op that produced NaN/Inf",
        description="Runs SCRIPT.py as __main__ with its arguments, tracing every aten op.",
    )
    p.add_argument("--dtype", help="run the script under autocast to fp16 or bf16 (a what-if)")
    p.add_argument("--raise-on-nonfinite", action="store_true", help="stop the script at the producing op")
    p.add_argument(
        "--headroom",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per-module value histograms for under/overflow what-ifs (default: on)",
    )
    add_output_args(p)
    p.add_argument("script", metavar="SCRIPT.py")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = args.script
    if not os.path.isfile(script):
        raise UsageError(f"{script}: no such script; usage: fpdoctor trace [--dtype fp16|bf16] -- SCRIPT.py [ARGS...]")
    dtype_name = None
    if args.dtype:
        dtype_name = _AUTOCAST.get(args.dtype.lower())
        if dtype_name is None:
            raise UsageError(f"--dtype {args.dtype!r} is not supported here; use fp16 or bf16")
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args

    import contextlib
    import runpy

    import torch

    import fpdoctor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = torch.autocast(device, dtype=getattr(torch, dtype_name)) if dtype_name else contextlib.nullcontext()
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    failure: str | None = None
    try:
        raise_on = "nonfinite" if args.raise_on_nonfinite else None
        with fpdoctor.trace(raise_on=raise_on, headroom=args.headroom) as session, autocast:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            failure = f"the script exited with {exc.code}"
    except fpdoctor.NonFiniteError as exc:
        failure = f"stopped at the producing op: {exc}"
    except Exception as exc:  # the script's own error: show it, still report what was traced
        traceback.print_exc()
        failure = f"the script raised {type(exc).__name__}: {exc}"
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    report = session.report
    assert report is not None
    if failure:
        report.data.setdefault("not_checked", {})["script"] = failure
    if dtype_name:
        report.data["summary"].insert(0, ("autocast", f"{device} {dtype_name}"))
    report.data["summary"].insert(0, ("script", " ".join([script, *script_args])))
    emit(report.to_dict(), args)
    return max(report.exit_code, 1 if failure else 0)
