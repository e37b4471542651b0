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
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from fpdoctor.cli.output import (
    UsageError,
    add_output_args,
    add_progress_arg,
    emit_after_program,
    write_atomic,
    write_or_stderr,
)
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
)
from fpdoctor.cli.trace_outcome import status as exit_status
from fpdoctor.report.write import rank_path

_FPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's plumbing between a Python call and a dispatch mode (dynamo's disable wrapper around
# __torch_dispatch__, the op overload's __call__): absent from a plain run's traceback
_DISPATCH_PLUMBING = ("_compile.py", "_dynamo", "_python_dispatch.py", "_ops.py")


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


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    host: str
    run: str  # what makes rank files of one launch belong together
    started: float


def rank_info() -> RankInfo | None:
    """This process's place under torchrun (or any launcher setting RANK and WORLD_SIZE)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if world < 2:
        return None
    run = ":".join(
        os.environ.get(k, "")
        for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    )
    return RankInfo(rank, world, int(os.environ.get("LOCAL_RANK", rank)), socket.gethostname(), run, time.time())


def _sidecar(path: str, rank: int) -> Path:
    """The JSON a rank leaves for the merge, whatever format the user asked for; removed after it."""
    p = Path(path)
    return p.with_name(f".{p.name}.rank{rank}.fpdoctor.json")


def user_traceback(error: BaseException, script: str) -> str:
    """The traceback a plain `python SCRIPT.py` would print: from the script's first frame to the
    last frame before fpdoctor's dispatch mode took the call (runpy and fpdoctor frames dropped)."""
    te = traceback.TracebackException.from_exception(error)
    frames = list(te.stack)
    target = os.path.abspath(script)
    start = next((i for i, f in enumerate(frames) if os.path.abspath(f.filename) == target), 0)
    kept = []
    for frame in frames[start:]:
        if os.path.abspath(frame.filename).startswith(_FPDOCTOR_DIR + os.sep):
            break  # the tracer and what it called: not the user's code
        kept.append(frame)
    while kept and "torch" in kept[-1].filename and any(p in kept[-1].filename for p in _DISPATCH_PLUMBING):
        kept.pop()
    te.stack = traceback.StackSummary.from_list(kept)
    return "".join(te.format())


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
    dist = rank_info()
    if args.output and dist is not None:
        with contextlib.suppress(OSError):  # an earlier launch's, never merged (an unwritable -o is said at the end)
            _sidecar(args.output, dist.rank).unlink()

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
    if dist is not None:
        _mark_rank(report, dist)
    status = exit_status(code, report, args.fail_on or default_fail_on(dist is not None))
    progress.close()  # the report goes to stderr too: the display is gone before it
    if dist is not None and args.output:
        _write_rank(report.to_dict(), args, dist)
    else:
        emit_after_program(report.to_dict(), args)
    return die_of_sigterm() if killed else status


def _so_far(session: Any) -> str:
    """What the trace has seen so far, read by the progress display a few times a second from the
    tracer's own counters (never a call per op)."""
    steps = session._steps.steps
    text = f"{session.tracer.ops_seen:,} ops traced"
    return text + (f", {steps} optimizer step{'s' if steps != 1 else ''}" if steps else "")


def _mark_rank(report: Any, dist: RankInfo) -> None:
    """Under torch.distributed every finding says where (ARCHITECTURE.md, contract 2): rank and host."""
    report.findings[:] = [
        dataclasses.replace(f, where={**f.where, "rank": dist.rank, "host": dist.host}) for f in report.findings
    ]
    report.data["distributed"] = {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "local_rank": dist.local_rank,
        "host": dist.host,
    }
    report.data["summary"].insert(0, ("rank", f"{dist.rank} of {dist.world_size} on {dist.host}"))


def _write_rank(doc: dict[str, Any], args: argparse.Namespace, dist: RankInfo) -> None:
    """This rank's FILE.rankN, its merge sidecar, and FILE itself when this rank completes the set.
    A file that cannot be written is one line on stderr and the report there instead: the exit
    status stays the script's."""
    from fpdoctor.report.render import render

    if not write_or_stderr(rank_path(args.output, dist.rank), render(doc, args.format, color=False)):
        return  # the directory will not take the sidecar and FILE either
    side = {"run": dist.run, "started": dist.started, "rank": dist.rank, "report": doc}
    try:
        write_atomic(str(_sidecar(args.output, dist.rank)), render(side, "json"))
    except UsageError as exc:  # this rank's own file is written: only the merged FILE will miss it
        sys.stderr.write(f"fpdoctor: {exc}; {args.output} will not merge rank {dist.rank}\n")
        return
    merged = merge_ranks(args.output, dist)
    if merged is not None:
        write_or_stderr(args.output, render(merged, args.format, color=False))
        for r in range(dist.world_size):
            _sidecar(args.output, r).unlink(missing_ok=True)


# A rank file of the same launch started within this window of ours; older ones are stale.
_SAME_LAUNCH_S = 6 * 3600


def merge_ranks(path: str, dist: RankInfo) -> dict[str, Any] | None:
    """Every rank's report as one, once each rank of this launch has left its sidecar; else None."""
    from fpdoctor.report.model import Finding, Report, Severity, Trial

    docs = []
    for r in range(dist.world_size):
        try:
            side = json.loads(_sidecar(path, r).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # not written yet (or merged and removed by another rank just now)
        if side.get("run") != dist.run or abs(float(side.get("started", 0)) - dist.started) > _SAME_LAUNCH_S:
            return None
        docs.append(side["report"])
    findings = [
        Finding(
            code=f["code"],
            name=f["name"],
            severity=Severity(f["severity"]),
            title=f"rank {f.get('where', {}).get('rank', r)}: {f['title']}",
            message=f["message"],
            fix=f.get("fix", ""),
            where=f.get("where", {}),
            evidence=f.get("evidence", {}),
            references=tuple(f.get("references", ())),
            trial=Trial.from_dict(f["fix_trial"]) if isinstance(f.get("fix_trial"), dict) else None,
        )
        for r, doc in enumerate(docs)
        for f in doc.get("findings", [])
    ]
    # the same finding from several ranks (`watch`: every rank reports the faulty rank alike) once
    unique: dict[str, Finding] = {}
    for f in findings:
        key = json.dumps([f.code, f.message, f.where, f.evidence], sort_keys=True, default=str)
        unique.setdefault(key, f)
    findings = list(unique.values())
    # where the values went bad first: a rank that made them before ranks that received them
    findings.sort(key=lambda f: f.evidence.get("origin") == "collective")
    ranks = [
        {
            "rank": doc["data"].get("distributed", {}).get("rank", r),
            "host": doc["data"].get("distributed", {}).get("host"),
            "verdict": doc.get("verdict"),
            "findings": len(doc.get("findings", [])),
            "file": rank_path(path, r),
            "not_checked": doc["data"].get("not_checked", {}),
        }
        for r, doc in enumerate(docs)
    ]
    bad = [str(x["rank"]) for x in ranks if x["verdict"] != "ok"]
    summary = [
        ("ranks", f"{dist.world_size} ({', '.join(sorted({str(x['host']) for x in ranks}))})"),
        ("ranks with findings", ", ".join(bad) or "none"),
    ]
    merged = Report(
        command="trace",
        findings=findings,
        data={
            "summary": summary,
            "distributed": {"world_size": dist.world_size, "merged": True},
            "ranks": ranks,
            "table": {
                "title": "ranks",
                "columns": ["rank", "host", "verdict", "findings", "file"],
                "rows": [
                    [str(x["rank"]), str(x["host"]), str(x["verdict"]), str(x["findings"]), x["file"]] for x in ranks
                ],
            },
        },
    )
    return merged.to_dict()
