"""`fpdoctor watch [--report FILE] -- [python] train.py ARGS`: the training sentinel, no code change.

The script runs as `__main__` under `fpdoctor.integrations.script.ScriptWatch`: every optimizer
step of every optimizer it creates is checked on the device, a non-finite step is kept from the
weights, replayed as it ran and classified, and the job goes on. A line on stderr says each bad
step's verdict as it comes, and each finding when it is decided; the report follows the script's
end (on stderr, or to FILE). FILE is also written at the start and rewritten as findings arrive
("in progress"), so a job killed at any point leaves a readable report. The exit status is the
script's, and a script terminated by SIGTERM (or interrupted by Ctrl-C) ends this process by
SIGTERM (SIGINT) too, after its report. `--stop-on LEVEL`
ends the script at the optimizer step after its first finding at LEVEL (`StopRun`, raised in its
thread as KeyboardInterrupt is: its `finally` blocks run) and exits 1 (STOPPED).
Under torchrun every rank writes FILE.rankN and whichever rank completes the set writes FILE,
every rank's findings merged (as `fpdoctor trace` does).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import sys
from typing import Any

from fpdoctor.cli import ranks
from fpdoctor.cli.output import UsageError, add_output_args, emit_after_program
from fpdoctor.cli.trace_outcome import (
    TERMINATED,
    Terminated,
    catch_sigterm,
    die_of_sigterm,
    exception_finding,
    exit_code_of,
    terminated,
    user_traceback,
)
from fpdoctor.report import write

INTERRUPTED = "interrupted (KeyboardInterrupt, Ctrl-C) before the script ended"
USAGE = "usage: fpdoctor watch [--report FILE] -- [python [OPTIONS]] SCRIPT.py | -m MODULE [ARGS...]"
# the exit status of a run that a finding at the --stop-on level stopped (or would have: the script
# caught the stop, or ended first): 1, as for error-level findings everywhere, unless the script's own is not 0
STOPPED = 1
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")  # python, python3, python3.12: the interpreter word
# python's own options, as `python OPTIONS script.py` takes them: -u and -B are applied here; the
# others change how the interpreter itself runs, so the watch starts again in one run with them
_HERE = frozenset("uBq")
_AGAIN = frozenset("ObvdR")
_WITH_VALUE = frozenset("WX")
_SUPPORTED = "-u -B -O -OO -b -v -d -q -R -W ARG -X OPT -m MODULE"
# set in the interpreter started again: its options are in force, they are not applied twice
_RESTARTED = "FPDOCTOR_WATCH_PYTHON_OPTIONS"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "watch",
        help="run a training script unmodified with the sentinel: bad steps skipped, replayed and classified",
        description="Runs SCRIPT.py as __main__ with its arguments. Every optimizer step is checked; a non-finite "
        "step is kept from the weights, replayed as it ran and classified (deterministic at an op, or a "
        "transient fault); the job goes on and exits with the script's own status.",
    )
    add_output_args(p, instead_of="stderr (stdout is the script's)")
    p.add_argument("--report", dest="output", metavar="FILE", help="write the report to FILE (same as -o)")
    p.add_argument("--no-replay", action="store_true", help="skip bad steps without replaying them")
    p.add_argument(
        "--reference-every",
        type=int,
        default=500,
        metavar="N",
        help="compare the model's backward at steps 1, 1+N, 1+2N, ... with the same step in fp32 without "
        "autocast or loss scaling (two more forwards and backwards on each; default 500, which also compares "
        "steps 10 and 100 and the step after a flat loss, and paces itself to 0.5%% of the run; 0: off)",
    )
    p.add_argument(
        "--device-skip",
        action="store_true",
        help="skip bad steps on the device for every optimizer, not only fused ones on a GPU (a foreach one's "
        "step is undone on the device: a copy of its weights and state per step); no host read per step",
    )
    p.add_argument(
        "--stop-on",
        choices=("error", "warning"),
        default=None,
        help="end the script at the optimizer step after its first finding at this level (or worse), write the "
        f"report and exit {STOPPED} (for CI); default: the job goes on",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="[python] SCRIPT.py ARGS")
    p.set_defaults(run=run)


def _python_options(words: list[str]) -> tuple[list[str], list[str]]:
    """Split `OPTIONS rest` as python reads its command line: (options, each a separate word with
    its value attached, e.g. -Wignore; rest). An option python has that this cannot honour is one
    line, exit 2."""
    options: list[str] = []
    while words and words[0].startswith("-") and words[0] not in ("-", "-m") and not words[0].startswith("--"):
        word, words = words[0], words[1:]
        letters = word[1:]
        while letters:
            letter, letters = letters[0], letters[1:]
            if letter == "m":  # -um: the rest of the word is the module's name, as python reads it
                return options, ["-m", *([letters] if letters else []), *words]
            if letter in _WITH_VALUE:
                value = letters or (words[0] if words else "")
                if not value:
                    raise UsageError(f"-{letter} needs an argument, as python's does; {USAGE}")
                if not letters:
                    words = words[1:]
                options.append(f"-{letter}{value}")
                break
            if letter not in _HERE and letter not in _AGAIN:
                raise UsageError(
                    f"-{letter}: python's option -{letter} is not supported here (supported: {_SUPPORTED}); {USAGE}"
                )
            options.append(f"-{letter}")
    if words and words[0].startswith("--"):
        raise UsageError(f"{words[0]}: python's options other than {_SUPPORTED} are not supported here; {USAGE}")
    return options, words


def _apply_here(options: list[str]) -> None:
    """-u and -B, in this process and the script's children, as python would set them."""
    if "-u" in options:  # unbuffered: this process's streams and its children's
        os.environ["PYTHONUNBUFFERED"] = "1"
        for stream in (sys.stdout, sys.stderr):
            reconfigure = getattr(stream, "reconfigure", None)
            if reconfigure is not None:
                reconfigure(write_through=True)
    if "-B" in options:  # no .pyc files written for the script's imports
        sys.dont_write_bytecode = True
        os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


def _script_of(command: list[str]) -> tuple[str, list[str], bool, list[str]]:
    """(script or module, its arguments, whether it is a module, python's options before it):
    what `python OPTIONS ...` would run."""
    words = command[1:] if command[:1] == ["--"] else list(command)
    options: list[str] = []
    if words and (_PYTHON.fullmatch(os.path.basename(words[0])) or words[0] == sys.executable):
        options, words = _python_options(words[1:])
        _apply_here(options)
        if words[:1] == ["-m"]:
            if len(words) < 2:
                raise UsageError(f"-m needs a module name; {USAGE}")
            return words[1], words[2:], True, options
    if not words:
        raise UsageError(f"no script given; {USAGE}")
    if words[0].startswith("-"):
        raise UsageError(f"{words[0]}: python's options other than {_SUPPORTED} are not supported here; {USAGE}")
    if not os.path.isfile(words[0]):
        raise UsageError(f"{words[0]}: no such script; {USAGE}")
    return words[0], words[1:], False, options


def _start_again(options: list[str], command: list[str]) -> None:
    """Options that change the interpreter itself (-O, -W, -X, ...): this command run again by an
    interpreter started with them, as `python OPTIONS -m fpdoctor watch ...` (the process is replaced:
    same pid, same environment, under torchrun too)."""
    again = [o for o in options if o[1] in _AGAIN or o[1] in _WITH_VALUE]
    if not again or os.environ.get(_RESTARTED) == "1":
        return
    argv = sys.argv[1:]
    if not command or argv[len(argv) - len(command) :] != command:
        raise UsageError(f"python's options {' '.join(again)} need `fpdoctor watch` run from the command line")
    os.environ[_RESTARTED] = "1"
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *options, "-m", "fpdoctor", *argv])


def run(args: argparse.Namespace) -> int:
    if args.reference_every < 0:
        raise UsageError(f"--reference-every must be 0 (off) or a number of steps, got {args.reference_every}")
    script, script_args, as_module, options = _script_of(args.command)
    _start_again(options, args.command)
    os.environ.pop(_RESTARTED, None)  # the script's own children start afresh
    dist = ranks.rank_info()
    ranks.forget_earlier(args.output, dist)

    import runpy

    from fpdoctor.integrations.entry_point import ENV_STOP_ON, ENV_SWITCH
    from fpdoctor.integrations.script import ScriptWatch, stderr_line
    from fpdoctor.numerics.training.live import StopRun, stop_level

    # a Lightning Trainer gets the fpdoctor callback (its loop steps the optimizer with a closure, so
    # the callback judges those steps); one the script passes itself wins, as always
    os.environ.setdefault(ENV_SWITCH, "1")
    if args.stop_on:  # ...and stops where the watch would: its findings are this run's too
        os.environ.setdefault(ENV_STOP_ON, args.stop_on)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.getcwd() if as_module else os.path.dirname(os.path.abspath(script)))
    code = 0
    killed = False  # by SIGTERM: after the report, this process dies of it too
    interrupted = False  # by KeyboardInterrupt (Ctrl-C): after the report, this process dies of SIGINT, as python does
    previous = catch_sigterm()
    watcher = ScriptWatch(
        replay=not args.no_replay,
        reference_every=args.reference_every,
        notify=stderr_line,
        device_skip=True if args.device_skip else None,
        stop_on=stop_level(args.stop_on),
    )
    unwatched: str | None = None
    try:
        watcher.__enter__()
    except Exception as exc:  # ours: the script still runs, unwatched, and the report says so
        unwatched = f"{type(exc).__name__}: {exc}"
    if args.output:  # written now and as findings arrive: a job killed at any point leaves a readable report
        path = write.rank_path(args.output, dist.rank) if dist is not None else args.output

        def so_far() -> None:
            report = _labelled(watcher.in_progress(), script, script_args, dist)
            write.write(report.to_dict(), path, args.format)

        watcher.live.writer = so_far
        watcher.live.behind = True
        watcher.live.settle(now=True)
    failure: str | None = None
    error: BaseException | None = None
    try:
        if as_module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exit_code_of(exc.code)
        if code:
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)  # as python prints sys.exit("message")
            failure, error = f"the script exited with {exc.code}", exc
    except Terminated:
        killed, failure = True, TERMINATED
    except StopRun as stop:
        failure = f"stopped by --stop-on {args.stop_on} at {stop.finding.code} {stop.finding.name}"
    except KeyboardInterrupt as exc:  # printed as python prints it; the report, then python's death by SIGINT
        sys.stderr.write(user_traceback(exc, script))
        interrupted, failure = True, INTERRUPTED
    except Exception as exc:  # the script's own error: printed as python would, then the report
        sys.stderr.write(user_traceback(exc, script))
        code = 1
        failure = f"the script raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        error = exc
    finally:
        watcher.close()
        sys.argv, sys.path[:] = saved_argv, saved_path
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    report = watcher.report
    if unwatched:
        report.data.setdefault("not_checked", {})["watch"] = f"the watch could not start ({unwatched})"
    if failure:
        report.data.setdefault("not_checked", {})["script"] = failure
    if error is not None:  # a script that raised is never OK
        report.findings.append(exception_finding(error, script, code))
        error = None  # drop the frames it holds (the script's tensors)
    if killed:
        terminated(report)
    if interrupted:  # not checked to its end: INCOMPLETE, never OK
        report.data["status"] = "incomplete"
        report.data.setdefault("summary", []).insert(0, ("ended", f"{INTERRUPTED}: the rest was not checked"))
    stopped = watcher.stopped_by  # the watch's own stop, or a callback's it switched on (training ended there)
    if stopped is not None:
        by_callback = stopped is not watcher.live.stopped
        _stopped(
            report, stopped, args.stop_on, ended=by_callback or (failure is not None and failure.startswith("stopped"))
        )
        code = code or STOPPED
    report = _labelled(report, script, script_args, dist)
    if dist is not None and args.output:
        ranks.write_rank(report.to_dict(), args, dist)
    else:
        emit_after_program(report.to_dict(), args)
    if interrupted:
        from fpdoctor.signals import die_of

        return die_of(signal.SIGINT)
    return die_of_sigterm() if killed else code


def _labelled(report: Any, script: str, script_args: list[str], dist: Any) -> Any:
    """The script's command line first; under torchrun this rank's place beside the judge's findings."""
    command = " ".join([script, *script_args])
    report.data.setdefault("summary", []).insert(0, ("script", command))
    # a fix that sends to another command names this script as that command takes it (`trace -- train.py`)
    report.findings[:] = [
        dataclasses.replace(f, fix=f.fix.replace("<your script>", command)) if "<your script>" in f.fix else f
        for f in report.findings
    ]
    if dist is not None:
        ranks.mark(report, dist)
    return report


def _stopped(report: Any, finding: Any, level: str, *, ended: bool) -> None:
    """A run --stop-on stopped was not checked to its end: INCOMPLETE, and why, first."""
    step = finding.evidence.get("step")
    at = f" at step {step}" if step is not None else ""
    said = f"{finding.code} {finding.name}{at}, the first finding at --stop-on {level}"
    if ended:
        report.data["status"] = "incomplete"
        said = f"stopped by {said}: the rest was not run"
    else:
        said = f"ran to its end after {said} (the script caught the stop, or ended first)"
    report.data.setdefault("summary", []).insert(0, ("ended", said))
