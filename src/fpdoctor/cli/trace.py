"""`fpdoctor trace [--dtype fp16|bf16] [--headroom] -- SCRIPT.py [ARGS...]`: a script the user will not edit.

The script runs as `__main__` under `fpdoctor.trace()`. When it dies, the user's own traceback is
printed (without fpdoctor's and runpy's frames), the exception is a finding, the exit status is the
one python would have given (trace_outcome.py, with `--fail-on` for a script that ended well), and
a dtype or device error is explained as `fpdoctor audit` explains it. Under torchrun (RANK and
WORLD_SIZE set) every rank writes its own report, `-o FILE` becoming FILE.rankN.ext, as soon as
its script ends, raises, is stopped at a non-finite op or is terminated (torchrun sends SIGTERM
to the survivors when one rank fails); whichever rank completes the set also writes FILE, every
rank's findings merged. No collective is used, so a rank that hangs or dies cannot hang the others.
A script terminated by SIGTERM gets its report of what ran, then this process dies of SIGTERM too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
from typing import Any

from fpdoctor.cli import ranks
from fpdoctor.cli.output import UsageError, add_output_args, add_progress_arg, emit_after_program
from fpdoctor.cli.trace_outcome import (
    FAIL_ON,
    TERMINATED,
    Terminated,
    catch_sigterm,
    default_fail_on,
    die_of_sigterm,
    exception_finding,
    exit_code_of,
    terminated,
    user_traceback,
)
from fpdoctor.cli.trace_outcome import status as exit_status


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "trace",
        help="run a script under fpdoctor.trace() and report the op that produced NaN/Inf",
        description="Runs SCRIPT.py as __main__ with its arguments, tracing every aten op. Under torchrun each "
        "rank writes FILE.rankN (with -o FILE) and the last rank to finish writes FILE with all ranks' findings.",
    )
    p.add_argument(
        "--dtype",
        help="a what-if: train the script as a real fp16 or bf16 autocast run would (fresh weight casts every "
        "step, backward and the optimizer step outside autocast)",
    )
    p.add_argument("--raise-on-nonfinite", action="store_true", help="stop the script at the producing op")
    p.add_argument(
        "--fail-on",
        choices=FAIL_ON,
        help="when a script that ended well exits 1: on an error-level finding (default), on a warning too, or "
        "never (the default under torchrun, so that a rank's findings never make the launcher stop the others); "
        "a script that raised or called sys.exit(n) always exits as python would have",
    )
    p.add_argument(
        "--headroom",
        action="store_true",
        help="add per-module value histograms (underflow shares, fp16 what-ifs of fp32 modules); "
        "about 10%% more time than the trace alone (1.08-1.13x measured on small CPU training steps)",
    )
    p.add_argument(
        "--repro",
        metavar="DIR",
        help="write a standalone reproducer of the op of origin into DIR (repro.py needing torch only, its "
        "inputs in safetensors or raw bytes, never a pickle), run it once and say whether it reproduced; "
        "reads every result at once (a host sync per op on a GPU)",
    )
    add_output_args(p, instead_of="stderr (stdout is the script's)")
    add_progress_arg(p)
    p.add_argument("script", metavar="SCRIPT.py")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    script = args.script
    if not os.path.isfile(script):
        raise UsageError(f"{script}: no such script; usage: fpdoctor trace [--dtype fp16|bf16] -- SCRIPT.py [ARGS...]")
    dtype_name = None
    if args.dtype:
        from fpdoctor.precision.names import autocast_dtype

        try:  # the same names, aliases and "did you mean" as compare and plan
            dtype_name = autocast_dtype(args.dtype)
        except ValueError as exc:
            raise UsageError(f"--dtype: {exc}") from None
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.repro is not None:
        from fpdoctor.errors import InputError
        from fpdoctor.numerics.trace.repro import check_dir

        try:
            check_dir(args.repro)
        except InputError as exc:
            raise UsageError(str(exc)) from None
    dist = ranks.rank_info()
    ranks.forget_earlier(args.output, dist)

    import runpy

    from fpdoctor import progress

    with progress.task("trace: import torch"):
        import torch

    import fpdoctor

    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast: Any = contextlib.nullcontext()
    if dtype_name:
        from fpdoctor.numerics.trace.autocast_run import AutocastWhatIf

        autocast = AutocastWhatIf(device, getattr(torch, dtype_name))
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    failure: str | None = None
    error: BaseException | None = None
    ended: Any = None  # the finding for how the script ended: an exception, sys.exit(n)
    code = 0  # what `python SCRIPT.py` would have exited with
    killed = False  # by SIGTERM: after the report, this process dies of it too
    previous = catch_sigterm()
    raise_on = "nonfinite" if args.raise_on_nonfinite else None
    # made before the script's try: a failure of ours to make it is not the script's error
    session = fpdoctor.trace(raise_on=raise_on, headroom=args.headroom, repro=args.repro)
    try:
        with (
            session,
            progress.task(f"trace {script}", status=lambda: _so_far(session)),
            autocast,
        ):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exit_code_of(exc.code)
        if code:
            failure = f"the script exited with {exc.code}"
            if exc.code is not None and not isinstance(exc.code, int):
                sys.stderr.write(f"{exc.code}\n")  # as python prints sys.exit("message")
            ended = exception_finding(exc, script, code)
    except fpdoctor.NonFiniteError as exc:
        failure = f"stopped at the producing op: {exc}"
        code = 1  # stopped before its end, as asked: the rest of the job did not run
    except Terminated:
        killed, failure = True, TERMINATED + (" (under torchrun: another rank failed)" if dist is not None else "")
    except Exception as exc:  # the script's own error: show it, still report what was traced
        progress.close()  # the traceback goes to the terminal as written, not under a redraw
        sys.stderr.write(user_traceback(exc, script))
        failure = f"the script raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        code = 1  # python's status for an uncaught exception
        ended = exception_finding(exc, script, code)
        error = exc
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    report = session.report
    assert report is not None
    if error is not None:
        from fpdoctor.numerics.trace.op_error import explain_op_error

        try:
            explained = explain_op_error(session.tracer, error)
        except Exception as exc:  # explaining is ours: its failure is reported, the user's error stays the story
            report.data.setdefault("not_checked", {})["explain"] = f"{type(exc).__name__}: {exc}"
            explained = None
        if explained is not None:
            report.findings.insert(0, explained)
        error = None  # drop the frames it holds (the script's tensors)
    if ended is not None:  # after what was traced: a NaN made before it may be its cause
        report.findings.append(ended)
    if failure:
        report.data.setdefault("not_checked", {})["script"] = failure
    if killed:
        terminated(report)
    summary = report.data.setdefault("summary", [])
    if dtype_name:
        summary.insert(0, ("autocast", f"{device} {dtype_name}"))
    summary.insert(0, ("script", " ".join([script, *script_args])))
    if dist is not None:  # under torch.distributed every finding says where (ARCHITECTURE.md, contract 2)
        report.findings[:] = [
            dataclasses.replace(f, where={**f.where, "rank": dist.rank, "host": dist.host}) for f in report.findings
        ]
        ranks.mark(report, dist)
    status = exit_status(code, report, args.fail_on or default_fail_on(dist is not None))
    progress.close()  # the report goes to stderr too: the display is gone before it
    if dist is not None and args.output:
        ranks.write_rank(report.to_dict(), args, dist)
    else:
        emit_after_program(report.to_dict(), args)
    return die_of_sigterm() if killed else status


def _so_far(session: Any) -> str:
    """What the trace has seen so far, read by the progress display a few times a second from the
    tracer's own counters (never a call per op)."""
    steps = session._steps.steps
    text = f"{session.tracer.ops_seen:,} ops traced"
    return text + (f", {steps} optimizer step{'s' if steps != 1 else ''}" if steps else "")
