"""What a callback leaves behind: the report (the sentinel's shape), its file, and a few lines for
the framework's logger."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fpdoctor.integrations._watch import StepWatch
from fpdoctor.numerics.training.live import in_progress
from fpdoctor.report.model import Finding, Report

# a line per finding in the log is enough; the report file holds the rest
_MESSAGE_CHARS = 240


def build(watch: StepWatch | None, framework: str, stop_on: str | None = None) -> Report:
    """The report of a training run so far: the sentinel's counts, verdicts and timeline; with
    `stop_on`, why a run that level stopped ended where it did."""
    if watch is None:
        return Report(command="sentinel", data={"framework": framework, "steps": 0})
    report = watch.report(framework)
    return stopped(report, watch, stop_on) if stop_on is not None else report


def check_path(path: str | None) -> str | None:
    """A report path the callback can write at the end of training: checked now, not after the run."""
    if path is None:
        return None
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"report_path {path} is a directory; give a file name such as {target / 'fpdoctor.json'}")
    if not target.parent.exists():
        raise ValueError(f"report_path {path}: {target.parent} does not exist; create it or choose another path")
    return path


def path_for_rank(path: str, rank: int | None, world: int) -> str:
    """report.json on one process; report.rank1.json on rank 1 of several (each rank writes its own)."""
    if rank is None or world <= 1:
        return path
    from fpdoctor.report.write import rank_path

    return rank_path(path, rank)


def write(report: Report, path: str) -> None:
    """Atomically, in the format the extension names (.json, .md, .html; text otherwise)."""
    from fpdoctor.report.write import write as write_report

    write_report(report.to_dict(), path)


def live_writer(watch: StepWatch, framework: str, path: str) -> Callable[[], None]:
    """What rewrites `path` as findings arrive: the report so far, marked "in progress"."""
    return lambda: write(in_progress(build(watch, framework), watch.steps), path)


def stopped(report: Report, watch: StepWatch, level: str) -> Report:
    """A run that `stop_on` stopped was not checked to its end: "incomplete", and why, first."""
    step = watch.stop_step
    finding = watch.live.stopped
    if step is None:
        return report
    if finding is None:  # under torch.distributed: another rank's finding stopped every rank
        said = f"another rank's finding at stop_on={level!r} (its report names it) after step {step}"
    else:
        at = finding.evidence.get("step", step)
        said = f"{finding.code} {finding.name} at step {at}, the first finding at stop_on={level!r}"
    if watch.steps <= step:
        report.data["status"] = "incomplete"
        said = f"stopped by {said}: the rest was not run"
    else:
        went_on = "the framework went on, as Lightning does until min_steps or min_epochs"
        said = f"ran on to step {watch.steps} after {said} ({went_on})"
    report.data.setdefault("summary", []).insert(0, ("ended", said))
    return report


def summary_lines(report: Report, framework: str) -> list[str]:
    """One line for a clean run; then one per finding, worst first."""
    data = report.data
    head = (
        f"fpdoctor: {data.get('steps', 0)} optimizer steps checked, {data.get('nonfinite_steps', 0)} non-finite, "
        f"{data.get('skipped_steps', 0)} skipped"
    )
    amp = data.get("amp")
    if isinstance(amp, dict):
        head += f", {amp['skipped_steps']} AMP overflow skips ({amp['skip_rate']:.1%})"
    head += f" ({framework})"
    lines = [head]
    for f in report.sorted_findings():
        message = f.message if len(f.message) <= _MESSAGE_CHARS else f.message[: _MESSAGE_CHARS - 3] + "..."
        lines.append(f"  {f.code} {f.name} [{f.severity.value}]: {message}")
    return lines


def step_line(findings: list[Finding], step: int) -> str | None:
    """The findings of one bad step, as one log line (None when it had none)."""
    parts = [f"{f.name}: {f.message}" for f in findings if f.evidence.get("step") == step]
    if not parts:
        return None
    return f"fpdoctor: step {step}: " + " | ".join(parts)
