"""A training run's findings as they are decided, not only at its end.

Every finding of a step judge goes into its `FindingLog`, the one place a finding is added (the
judge's own, the `Causes` that count a repeated cause under its first finding, a front end's). A
new finding there is handed to the run's `Live`, which

- notes the first finding at the `stop_on` level (`stopped`), for the front end to end the run at
  its next step boundary;
- when the judge has finished with the step (`settle`): has the front end's `writer` rewrite its
  report file (atomically, the whole report so far, marked "in progress"), never on a step without
  a new finding, and no more often than keeps the rewrites under `WRITE_SHARE` of the run's time;
  then says each new finding on one line (`fpdoctor: step 412: TRN003 loss-scale-collapsed (error)
  - title`), on stderr by default or through the front end's own `say`. The file is written before
  the line is said: whoever reads the line finds the finding in the file, and a job killed at any
  point leaves a readable report holding every finding decided before its last rewrite.

A finding counted again under its cause (its step added to the first one's) is not a new line.
Nothing here raises into the user's step: a writer that fails is one line, once, and no more
rewrites are tried.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, SupportsIndex

from fpdoctor.report.model import Finding, Report, Severity

# The live rewrites of a report file take at most this share of the run's time: after a rewrite
# that cost t seconds, the next one waits until t / WRITE_SHARE have passed (a new finding in the
# meantime is written at the first step boundary after that).
WRITE_SHARE = 0.02
STOP_LEVELS = ("error", "warning")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def line_of(finding: Finding, step: int | None = None) -> str:
    """One line: `fpdoctor: [rank R ][thread 'T' ]step N: CODE name (severity) - title`; the thread's
    name where it is not the main thread (two models trained in two threads, a Sentinel each: whose?)."""
    at = finding.evidence.get("step", step)
    rank = finding.where.get("rank")
    thread = threading.current_thread()
    words = [
        f"rank {rank}" if rank is not None else "",
        f"thread {thread.name!r}" if thread is not threading.main_thread() else "",
        f"step {at}" if at is not None else "",
    ]
    place = " ".join(w for w in words if w)
    lead = f"fpdoctor: {place}: " if place else "fpdoctor: "
    return f"{lead}{finding.code} {finding.name} ({finding.severity.value}) \u2014 {finding.title}"


def stop_level(value: str | None) -> Severity | None:
    """`stop_on` as given ("error", "warning" or None) -> the severity that stops a run; ValueError otherwise."""
    if value is None:
        return None
    if value not in STOP_LEVELS:
        raise ValueError(f"stop_on must be one of {', '.join(STOP_LEVELS)} or None, got {value!r}")
    return Severity(value)


class StopRun(BaseException):
    """A run ended at a step boundary by its first finding at the `stop_on` level (`finding`).

    Raised in the script's own thread, as KeyboardInterrupt is, and for the same reason not an
    `Exception`: the script's `except Exception` lets it through, while its `finally` blocks and
    `with` exits run (a checkpoint being written is finished, a file closed)."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(f"stopped at {finding.code} {finding.name}")
        self.finding = finding


def in_progress(report: Report, steps: int | None = None) -> Report:
    """`report` as its file holds it while the run goes on: status "in progress" (never an ok), and
    a first summary row that says a run killed now stops here."""
    report.data["status"] = "in progress"
    at = f" at step {steps}" if steps is not None else ""
    row = ("ended", f"not yet: written while the run went on{at}, rewritten as findings arrive")
    report.data.setdefault("summary", []).insert(0, row)
    return report


class Live:
    """What a running judge does with each new finding: say it, mark the report file behind, note a stop.

    `say`: where the line goes (None: nowhere). `rank`: this process's rank under torch.distributed;
    a finding about another rank (every rank adds every rank's agreed findings) is said by that
    rank only. `stop_on`: the severity whose first finding asks the run to stop. `writer`: the front
    end's whole report so far to its file."""

    def __init__(self, *, say: Callable[[str], None] | None = _stderr, stop_on: Severity | None = None) -> None:
        self.say = say
        self.stop_on = stop_on
        self.rank: int | None = None
        self.writer: Callable[[], None] | None = None
        self.stopped: Finding | None = None  # the first finding at the stop_on level
        self.behind = False  # a finding arrived since the report file was last written
        self._unsaid: list[Finding] = []
        self.writes = 0
        self.write_seconds = 0.0  # spent rewriting the report file, all rewrites together
        self._next_write = 0.0  # time.perf_counter() before which no rewrite starts

    def added(self, finding: Finding) -> None:
        """A new finding: the file behind, its line due, a stop noted."""
        self.behind = True
        self._unsaid.append(finding)
        if self.stop_on is not None and self.stopped is None and finding.severity.rank >= self.stop_on.rank:
            self.stopped = finding

    def replaced(self, old: Finding, new: Finding) -> None:
        """A finding replaced: a count kept current is not said again; another finding where one
        stood (two findings of one cause folded into one) is, instead of the old one if that was
        not said yet."""
        if any(f is old for f in self._unsaid):
            self._unsaid = [new if f is old else f for f in self._unsaid]
        elif new.name != old.name:
            self.behind = True
            self._unsaid.append(new)

    def removed(self, finding: Finding) -> None:
        """A finding withdrawn (a stall called on the run's first steps that training went past): the
        file behind, its line not said if it was not yet, a stop it asked for no longer asked."""
        self.behind = True
        self._unsaid = [f for f in self._unsaid if f is not finding]
        if self.stopped is finding:
            self.stopped = None

    def settle(self, *, now: bool = False) -> None:
        """At a step boundary: rewrite the report file if a finding arrived since the last rewrite and
        the rewrites' share of the time allows (`now`: whatever the share, a stop's last word); then
        say the new findings. Never raises."""
        if self.behind and self.writer is not None:
            start = time.perf_counter()
            if now or start >= self._next_write:
                self._write(start)
        unsaid, self._unsaid = self._unsaid, []
        for finding in unsaid:
            rank = finding.where.get("rank")
            if rank is None or self.rank is None or rank == self.rank:  # another rank's is said there
                self._say(line_of(finding))

    def _write(self, start: float) -> None:
        assert self.writer is not None
        self.behind = False
        try:
            self.writer()
        except Exception as exc:  # the file cannot be written: said once, the run goes on
            self.writer = None
            self._say(f"fpdoctor: the report file could not be rewritten while the run goes on ({exc}); "
                      "it is written at the end")  # fmt: skip
            return
        spent = time.perf_counter() - start
        self.writes += 1
        self.write_seconds += spent
        self._next_write = start + spent / WRITE_SHARE

    def note(self, line: str) -> None:
        """A line of fpdoctor's own (not a finding), said now."""
        self._say(line)

    def _say(self, line: str) -> None:
        if self.say is None:
            return
        with contextlib.suppress(Exception):  # a closed stderr: the finding is in the report all the same
            self.say(line)


class FindingLog(list[Finding]):
    """A run's findings; every new one is handed to `live` as it is added. Replacing one (a cause
    counted again, a stalled episode's counts kept current) is not a new finding."""

    def __init__(self, live: Live, found: Iterable[Finding] = ()) -> None:
        super().__init__(found)
        self.live = live

    def append(self, finding: Finding) -> None:
        super().append(finding)
        self.live.added(finding)

    def __setitem__(self, index: Any, finding: Any) -> None:
        old = self[index]
        super().__setitem__(index, finding)
        if isinstance(old, Finding) and isinstance(finding, Finding):
            self.live.replaced(old, finding)

    def __delitem__(self, index: Any) -> None:
        old = self[index]
        super().__delitem__(index)
        for finding in old if isinstance(old, list) else [old]:
            self.live.removed(finding)

    def extend(self, found: Iterable[Finding]) -> None:
        for finding in found:
            self.append(finding)

    def __iadd__(self, found: Iterable[Finding]) -> FindingLog:  # type: ignore[override,misc]
        self.extend(found)
        return self

    def insert(self, index: SupportsIndex, finding: Finding) -> None:
        super().insert(index, finding)
        self.live.added(finding)
