"""One finding per cause in a training run: a cause seen again on a later step adds to its count.

A model that overflows fp16 at one op does so on every step: forty skipped steps are one cause,
not forty findings of each kind. A finding's cause is its name and where it happened (the op,
module and phase a replay named, the rank); the first occurrence keeps its step, message and
evidence, and says how many optimizer steps showed the same and which (`occurrences`,
`first_step`, `last_step`, `steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fpdoctor.report.model import Finding

# the steps a finding lists; its count goes on
STEPS_LISTED = 20


def cause_of(finding: Finding) -> tuple[Any, ...]:
    """What makes two findings the same cause: the name and where (op, module, phase, source, rank)."""
    where = finding.where
    return (
        finding.name,
        where.get("op"),
        where.get("module"),
        where.get("phase"),
        where.get("file"),
        where.get("line"),
        where.get("rank"),
        finding.evidence.get("origin"),
    )


@dataclass
class _Seen:
    index: int  # in the run's findings
    first: Finding
    steps: list[int] = field(default_factory=list)
    occurrences: int = 1


class Causes:
    """Adds findings to `findings` (the run's list, shared with its front end), one per cause."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        self._seen: dict[tuple[Any, ...], _Seen] = {}

    def add(self, finding: Finding, key: tuple[Any, ...] | None = None) -> None:
        key = cause_of(finding) if key is None else key
        step = finding.evidence.get("step")
        seen = self._seen.get(key)
        if seen is None or seen.index >= len(self.findings) or self.findings[seen.index].name != finding.name:
            self._seen[key] = _Seen(len(self.findings), finding, [step] if isinstance(step, int) else [])
            self.findings.append(finding)
            return
        seen.occurrences += 1
        if isinstance(step, int) and step not in seen.steps:
            seen.steps.append(step)
        self.findings[seen.index] = _repeated(seen)

    def annotate(self, names: tuple[str, ...], step: int, text: str, evidence: dict[str, Any]) -> None:
        """Add what the front end knows besides to the findings `names` of `step` (as first seen)."""
        for seen in self._seen.values():
            if seen.first.name in names and seen.first.evidence.get("step") == step:
                seen.first = annotated(seen.first, text, evidence)
                self.findings[seen.index] = annotated(self.findings[seen.index], text, evidence)

    def count(self, key: tuple[Any, ...]) -> int:
        seen = self._seen.get(key)
        return seen.occurrences if seen is not None else 0


def _repeated(seen: _Seen) -> Finding:
    first, steps = seen.first, seen.steps
    listed = ", ".join(str(s) for s in steps[:STEPS_LISTED]) + (", ..." if len(steps) > STEPS_LISTED else "")
    many = len(steps) if steps else seen.occurrences
    text = f" The same on {many} optimizer steps ({listed})." if steps else f" Seen {seen.occurrences} times."
    evidence: dict[str, Any] = {**first.evidence, "occurrences": seen.occurrences}
    if steps:
        evidence.update(first_step=steps[0], last_step=steps[-1], steps=steps[:STEPS_LISTED])
    return replace(first, message=first.message + text, evidence=evidence)


def annotated(finding: Finding, text: str, evidence: dict[str, Any]) -> Finding:
    return replace(finding, message=finding.message + text, evidence={**finding.evidence, **evidence})
