"""Crash capture: run a command, and when a process it started dies, say what it was doing.

`run_command(argv)` runs any launcher (`python train.py`, `torchrun ...`, `accelerate launch`,
a shell script) with every Python process it starts instrumented through a `sitecustomize`
on PYTHONPATH (faulthandler to a per-process file, a process record, uncaught exceptions,
optionally the breadcrumb op ring), passes the command's output through unchanged, and
returns its exit status with a report: which process failed first and of what, its Python
stack, the ops in flight, native frames, the environment doctor's verdicts and new kernel-log
lines. Nothing is printed here: the command's own streams pass through, the caller renders.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fpdoctor.crash.launcher import CommandError, launch, resolve
from fpdoctor.report.model import Report

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT_BUDGET_S = 4.5  # of the 5 s from a death to its report (its budget, benchmarks/README.md), the rest is rendering

_PASS = object()  # default stream target: the caller's own sys.stdout / sys.stderr at call time


@dataclass
class RunResult:
    report: Report
    exit_code: int  # the command's exit status as a shell gives it (128+N for a death by signal N)
    signal: int | None = None  # the signal the command died of: `fpdoctor run` dies of it too

    @property
    def failed(self) -> bool:
        """Something inside the command failed: a process crashed, raised or was killed (a command
        that only exited non-zero has its `nonzero-exit` finding in the report, and its output says why)."""
        return bool(self.report.data.get("failures"))


def run_command(
    argv: list[str],
    *,
    breadcrumbs: bool = False,
    env_from: str | dict[str, Any] | None = None,
    wait_s: float | None = None,
    stdout: Any = _PASS,
    stderr: Any = _PASS,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    run_dir: str | None = None,
    environment: bool = True,
    program: Sequence[str] = ("fpdoctor",),
    repro: str | None = None,
) -> RunResult:
    """Run argv under crash capture and return its report and exit status.

    stdout/stderr: where the command's streams go: the caller's sys.stdout/sys.stderr by
    default, None to discard, a file descriptor, or any object with write() (bytes for binary
    files and buffers, text for text streams). program: how the re-run command the report
    prints starts (the CLI passes how fpdoctor itself was started). env_from: a facts JSON / collect_env report path
    (or a facts dict) whose environment verdicts are joined instead of this machine's;
    environment=False joins none. wait_s: by default the command ends when its launcher ends it,
    however long a rank's failure takes to shut the job down; a number stops a command still
    running that many seconds after a rank failed. run_dir: keep the per-process files there
    (by default a temporary directory, removed afterwards). repro: with breadcrumbs, a directory
    that gets a reproducer of the op in flight when a process dies of a fatal signal (crash/repro.py).

    Raises CommandError when argv cannot be started and fpdoctor.errors.InputError for an
    env_from file that cannot be read, both before anything runs.
    """
    if wait_s is not None and wait_s < 0:
        raise ValueError(f"wait_s must be >= 0, got {wait_s}")
    argv = [str(a) for a in argv]
    base_env = dict(os.environ if env is None else env)
    resolve(argv, base_env)
    facts, source = _environment_source(env_from)
    if repro is not None:
        from fpdoctor.numerics.trace.repro import check_dir

        repro = check_dir(repro)
    own_dir = run_dir is None
    directory = tempfile.mkdtemp(prefix="fpdoctor-run-") if run_dir is None else os.path.abspath(run_dir)
    os.makedirs(directory, exist_ok=True)
    try:
        return _run(
            argv,
            base_env,
            directory,
            breadcrumbs=breadcrumbs,
            facts=facts,
            source=source,
            rerun=rerun_command(argv, env_from, wait_s=wait_s, program=program),
            environment=environment,
            wait_s=wait_s,
            stdout=sys.stdout if stdout is _PASS else stdout,
            stderr=sys.stderr if stderr is _PASS else stderr,
            cwd=cwd,
            repro=repro if breadcrumbs else None,
        )
    finally:
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


def _environment_source(env_from: str | dict[str, Any] | None) -> tuple[dict[str, Any] | None, str | None]:
    if env_from is None:
        return None, None
    if isinstance(env_from, dict):
        return env_from, "saved facts"
    from fpdoctor.env.parse import load

    return load(env_from), f"file {env_from}"


def child_environment(base: dict[str, str], run_dir: str, breadcrumbs: bool) -> dict[str, str]:
    env = dict(base)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = SITE_DIR + (os.pathsep + path if path else "")
    env["FPDOCTOR_RUN_DIR"] = run_dir
    env["FPDOCTOR_RUN_PKG"] = PACKAGE_ROOT
    env.pop("FPDOCTOR_RUN_RANK", None)  # set by the job's ranks for what they start (sitecustomize)
    if breadcrumbs:
        env["FPDOCTOR_RUN_BREADCRUMBS"] = "1"
        crumbs = _breadcrumbs()
        if crumbs is not None:
            env.update(crumbs.library_log_env(run_dir))
    else:
        env.pop("FPDOCTOR_RUN_BREADCRUMBS", None)
    return env


def _breadcrumbs() -> Any:
    try:
        from fpdoctor.crash import breadcrumbs
    except ImportError:
        return None
    return breadcrumbs


def rerun_command(
    argv: list[str],
    env_from: str | dict[str, Any] | None,
    *,
    wait_s: float | None = None,
    program: Sequence[str] = ("fpdoctor",),
) -> str:
    """The exact command that runs argv again with breadcrumbs on (crash twice, learn once),
    with the options that change what runs (--env-from, --wait), quoted for a POSIX shell."""
    words = [*program, "run", "--breadcrumbs"]
    if isinstance(env_from, str):
        words += ["--env-from", env_from]
    if wait_s is not None:
        words += ["--wait", f"{wait_s:g}"]
    return shlex.join([*words, "--", *argv])


def _run(
    argv: list[str],
    base_env: dict[str, str],
    run_dir: str,
    *,
    breadcrumbs: bool,
    facts: dict[str, Any] | None,
    source: str | None,
    rerun: str,
    environment: bool,
    wait_s: float | None,
    stdout: Any,
    stderr: Any,
    cwd: str | None,
    repro: str | None = None,
) -> RunResult:
    from fpdoctor.crash.collect import Watch
    from fpdoctor.crash.machine import EnvironmentJoin

    join = EnvironmentJoin(facts, source) if environment else None
    watch = Watch(run_dir)
    launched = launch(
        argv,
        env=child_environment(base_env, run_dir, breadcrumbs),
        cwd=cwd,
        stdout=stdout,
        stderr=stderr,
        wait_s=wait_s,
        watch=watch,
        on_failure=join.start if join is not None else lambda: None,
        alive=watch.pids,
    )
    # what only the report needs is imported once the command has ended
    from fpdoctor.crash.collect import collect
    from fpdoctor.crash.findings import Context, failures
    from fpdoctor.crash.machine import kernel_log_since
    from fpdoctor.crash.report import build

    collected = collect(
        run_dir,
        child_pid=launched.pid,
        returncode=launched.returncode,
        stderr_tail=launched.stderr_tail,
        gone=watch.gone,
    )
    not_checked: dict[str, str] = {}
    crumbs = _breadcrumbs() if breadcrumbs else None
    if breadcrumbs and crumbs is None:
        not_checked["breadcrumbs"] = "this fpdoctor has no breadcrumb recorder (fpdoctor.crash.breadcrumbs)"
    ctx = Context(
        launched=launched,
        collected=collected,
        breadcrumbs=breadcrumbs,
        rerun=rerun,
        wait_s=wait_s,
        not_checked=not_checked,
    )
    if failures(ctx) and launched.exit_status == 0:
        # handled inside a command that succeeded: notes, without the machine's verdicts
        _crumbs_for(crumbs, run_dir, collected.processes, {e.process.pid for e in failures(ctx)}, not_checked)
    elif failures(ctx):
        if join is not None:
            join.start()
        ctx.kernel = kernel_log_since(launched.started)
        for p in collected.processes:
            if p.pid in ctx.kernel.oom_killed and p.outcome().kind == "vanished":
                p.returncode = -9  # the kernel log names it: the out-of-memory killer's SIGKILL
        events = failures(ctx)
        _crumbs_for(crumbs, run_dir, collected.processes, {e.process.pid for e in events}, not_checked)
        texts = [collected.stderr_text[-20000:]]
        texts += [f"Fatal Python error: {e.process.fault.header}" for e in events if e.process.fault is not None]
        texts += [f"{x.get('type')}: {x.get('message')}" for e in events for x in e.process.exceptions]
        if join is not None:
            # the budget: the report within 5 s of the death; the verdicts get what is left of it
            death = min(e.time for e in events)
            ctx.environment = join.result(texts, timeout=max(1.0, death + REPORT_BUDGET_S - time.time()))
    report = build(ctx)
    if repro is not None and launched.exit_status != 0:
        from fpdoctor.crash.repro import attach

        try:
            report = attach(report, ctx, repro)
        except Exception as exc:  # the reproducer is ours: the crash report stands without it
            report.data.setdefault("not_checked", {})["reproducer"] = f"{type(exc).__name__}: {exc}"
    died = -launched.returncode if launched.returncode < 0 else None
    return RunResult(report=report, exit_code=launched.exit_status, signal=died)


def _crumbs_for(crumbs: Any, run_dir: str, processes: list[Any], failed: set[int], not_checked: dict[str, str]) -> None:
    """The op rings of the processes that failed and of every rank."""
    if crumbs is None:
        return
    for p in processes:
        if p.pid in failed or p.is_rank:
            _read_breadcrumbs(crumbs, run_dir, p, not_checked)


def _read_breadcrumbs(crumbs: Any, run_dir: str, process: Any, not_checked: dict[str, str]) -> None:
    try:
        process.ops = list(crumbs.read(run_dir, process.pid))
        process.library_log = list(crumbs.library_log_tail(run_dir, process.pid))
    except Exception as exc:  # a torn or foreign file: the report goes on without it
        not_checked[f"breadcrumbs of pid {process.pid}"] = f"{type(exc).__name__}: {exc}"


__all__ = ["CommandError", "RunResult", "run_command"]
