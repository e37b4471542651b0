"""How a traced script ended, and the exit status `fpdoctor trace` gives for it.

The job first: a script that raised is never OK. Its exception is a finding (CRS002
`uncaught-exception`, or CRS003 `cuda-error` for a CUDA-stack error, as `fpdoctor run` says it)
with its type, message and the script's line, and trace exits as `python SCRIPT.py` would have:
1 for an uncaught exception, the code of `sys.exit(n)`. A script that ended well exits by
`--fail-on`: `error` (the default of a plain run, for CI) exits 1 on an error-level finding,
`warning` on a warning too, `never` exits 0. Under torchrun the default is `never`: a rank that
exits non-zero makes the launcher terminate every other rank, healthy ones still working
included, so a finding must not end the job its report is about.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from typing import Any

from fpdoctor import catalog
from fpdoctor.report.model import Finding, Report

_FPDOCTOR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torch's plumbing between a Python call and a dispatch mode (dynamo's disable wrapper around
# __torch_dispatch__, the op overload's __call__): absent from a plain run's traceback
_DISPATCH_PLUMBING = ("_compile.py", "_dynamo", "_python_dispatch.py", "_ops.py")

FAIL_ON = ("error", "warning", "never")
TERMINATED = "terminated by SIGTERM before the script ended"


class Terminated(BaseException):
    """SIGTERM while the script ran: unwinds it so that the report is still written."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def catch_sigterm() -> Any:
    """While the script runs, SIGTERM raises Terminated, so that its report is still written; the
    handler this replaced, for the caller to put back. None where SIGTERM was not at its default
    action (an inherited SIG_IGN): python would keep that for the script, and so does this."""
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def terminated(report: Report) -> None:
    """A script terminated before its end was not checked to its end: the headline says so
    (INCOMPLETE, never OK), and the summary says why, after the script's name."""
    report.data["status"] = "incomplete"
    report.data.setdefault("summary", []).insert(0, ("ended", f"{TERMINATED}: the rest was not checked"))


def die_of_sigterm() -> int:
    """After the report: end this process by SIGTERM, as the script would have died of it (the shell
    sees a death by signal, a launcher 'Signal 15'), not by an exit status the script never gave.
    Returns 128+SIGTERM, the shell's number for it, only where the signal cannot be delivered."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream: the death is what matters now
            stream.flush()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    return 128 + signal.SIGTERM


def default_fail_on(under_launcher: bool) -> str:
    return "never" if under_launcher else "error"


def status(script_code: int, report: Report, fail_on: str) -> int:
    """The script's own non-zero exit status; else 1 where the findings reach `fail_on`."""
    if script_code:
        return script_code
    if fail_on == "never":
        return 0
    worst = report.verdict
    return 1 if worst == "error" or (fail_on == "warning" and worst == "warning") else 0


def exit_code_of(code: Any) -> int:
    """What `python SCRIPT.py` exits with for `sys.exit(code)`: None is 0, an int itself, else 1."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _user_line(error: BaseException) -> tuple[str, int, str] | None:
    """The innermost line of the user's own code in the exception's traceback."""
    from fpdoctor.userframes import user_location

    tb = error.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return user_location(tb.tb_frame)


def exception_finding(error: BaseException, script: str, code: int) -> Finding:
    """The script's uncaught exception (a non-zero `sys.exit` included) as a finding."""
    from fpdoctor.meanings import explain_text

    kind = type(error).__qualname__
    if type(error).__module__ not in ("builtins", "__main__"):
        kind = f"{type(error).__module__}.{kind}"
    text = str(error.code if isinstance(error, SystemExit) else error)
    first = text.strip().splitlines()[0][:300] if text.strip() else ""
    line = _user_line(error)
    at = f"{line[0]}:{line[1]} in {line[2]}" if line else None
    explained = explain_text(f"{kind}: {text}") if not isinstance(error, SystemExit) else None
    if isinstance(error, SystemExit):
        lead = f"The script called sys.exit({error.code!r})"
        title = f"The script exited with status {code}"
    else:
        lead = f"The script raised {kind}" + (f": {first}" if first else "")
        title = f"The script raised {type(error).__name__}" + (f": {first[:120]}" if first else "")
    message = (
        lead
        + (f", at {at}" if at else "")
        + f". `python {script}` exits with {code} here, and so does this trace; the findings are what ran until then."
        + (f" {explained.meaning.text}" if explained is not None else "")
    )
    evidence: dict[str, Any] = {"exception": kind, "error": text[:1000], "exit_code": code}
    if at:
        evidence["location"] = at
    if explained is not None:
        evidence["error_kind"] = explained.key
    where: dict[str, Any] = {"file": line[0], "line": line[1], "function": line[2]} if line else {}
    # this trace already names the op behind a NaN/Inf: its findings, not "run trace", are the next step
    fix = explained.meaning.fix if explained is not None and explained.key != "nonfinite" else ""
    if isinstance(error, SystemExit):
        fix = f"The script chose to stop{f' at {at}' if at else ''}: what it printed before says why."
    return catalog.make(
        "cuda-error" if explained is not None and explained.finding == "cuda-error" else "uncaught-exception",
        title=title,
        message=message,
        where=where,
        evidence=evidence,
        fix=fix or f"Fix the error at {at or 'the line the traceback ends in'} (the traceback above is the script's).",
    )


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
