"""One finding per cause in a training run: a cause seen again on a later step adds to its count.

A model that overflows fp16 at one op does so on every step: forty skipped steps are one cause,
not forty findings of each kind. A finding's cause is its name and where it happened (the op,
module and phase a replay named, the rank); the first occurrence keeps its step, message and
evidence, and says how many optimizer steps showed the same and which (`occurrences`,
`first_step`, `last_step`, `steps`).

Two findings can also name one cause from two sides: weights whose updates round away in bf16
(TRN010, the mechanism, measured on the weights) make the reference step's update depart already in
the optimizer's own step, cured on fp32 copies of the weights and state (TRN018 at its intended
stage). Printed apart, the consequence came first and the fix twice; they are one finding: the
mechanism's message and fix, with the reference step's evidence and its check of that fix (on the
same gradients, the updates of fp32 copies depart no more), where the first of the two stood.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fpdoctor.report.model import Finding, Severity

# the steps a finding lists; its count goes on
STEPS_LISTED = 20
MECHANISM = "update-rounded-away"
REFERENCE = "update-departs-from-reference"


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
    items: list[Any] = field(default_factory=list)  # the dataset items each occurrence's rows were (bad data)


class Causes:
    """Adds findings to `findings` (the run's list, shared with its front end), one per cause."""

    def __init__(self, findings: list[Finding]) -> None:
        self.findings = findings
        self._seen: dict[tuple[Any, ...], _Seen] = {}
        self._folded: set[tuple[Any, ...]] = set()  # reference findings folded into a mechanism's

    def add(self, finding: Finding, key: tuple[Any, ...] | None = None) -> None:
        key = cause_of(finding) if key is None else key
        if key in self._folded:
            return  # the reference step seeing again a cause already told as its mechanism
        step = finding.evidence.get("step")
        if self._fold(finding, key):
            return
        seen = self._seen.get(key)
        if seen is None or seen.index >= len(self.findings) or self.findings[seen.index].name != finding.name:
            seen = _Seen(len(self.findings), finding, [step] if isinstance(step, int) else [])
            seen.items = _items(finding)
            self._seen[key] = seen
            self.findings.append(finding)
            return
        seen.occurrences += 1
        if isinstance(step, int) and step not in seen.steps:
            seen.steps.append(step)
        seen.items += [i for i in _items(finding) if i not in seen.items]
        self.findings[seen.index] = _repeated(seen)

    def _fold(self, finding: Finding, key: tuple[Any, ...]) -> bool:
        """Fold `finding` and an earlier finding of the same cause told from the other side into one."""
        if finding.name not in (MECHANISM, REFERENCE):
            return False
        other = REFERENCE if finding.name == MECHANISM else MECHANISM
        for old_key, seen in list(self._seen.items()):
            if old_key in self._folded or seen.index >= len(self.findings):
                continue
            old = self.findings[seen.index]
            if old.name != other or old.evidence.get("reference_step") is not None:
                continue
            mechanism, reference = (finding, old) if finding.name == MECHANISM else (old, finding)
            if not _one_cause(mechanism, reference):
                continue
            merged = _merged(mechanism, reference)
            mechanism_key = key if finding.name == MECHANISM else old_key
            self._folded.add(old_key if finding.name == MECHANISM else key)
            self._seen.pop(old_key, None)
            steps = [s for s in [mechanism.evidence.get("step")] if isinstance(s, int)]
            self._seen[mechanism_key] = _Seen(seen.index, merged, steps)
            self.findings[seen.index] = merged
            return True
        return False

    def annotate(self, names: tuple[str, ...], step: int, text: str, evidence: dict[str, Any]) -> None:
        """Add what the front end knows besides to the findings `names` of `step` (as first seen)."""
        for seen in self._seen.values():
            if seen.first.name in names and seen.first.evidence.get("step") == step:
                seen.first = annotated(seen.first, text, evidence)
                self.findings[seen.index] = annotated(self.findings[seen.index], text, evidence)

    def count(self, key: tuple[Any, ...]) -> int:
        seen = self._seen.get(key)
        return seen.occurrences if seen is not None else 0


def _one_cause(mechanism: Finding, reference: Finding) -> bool:
    """The reference step's departure is the mechanism's: at the intended stage, on the same rank,
    and gone on fp32 copies of the weights and state (what the mechanism's fix, master weights, does)."""
    trial = reference.trial
    return (
        reference.evidence.get("stage") == "intended"
        and trial is not None
        and trial.tried
        and trial.after == 0
        and mechanism.where.get("rank") == reference.where.get("rank")
    )


def _merged(mechanism: Finding, reference: Finding) -> Finding:
    ev = reference.evidence
    text = (
        f" The reference step measures it (what the live line printed as {reference.code} {reference.name} is this "
        f"same cause, not another finding): at step {ev.get('step')}, with gradients that agree with the fp32 "
        f"step's, the update of {ev.get('departed_count')} of {ev.get('compared')} parameters departs from the "
        "update the same optimizer makes over fp32 copies of the weights and state; on those copies none does."
    )
    keep = ("stage", "step", "optimizer", "departed", "departed_count", "compared")
    # one finding for the two: as severe as the more severe (a reference step's warning is never told as info)
    worse = max(mechanism.severity, reference.severity, key=lambda s: Severity(s).rank)
    return replace(
        mechanism,
        severity=Severity(worse),
        message=mechanism.message + text,
        evidence={**mechanism.evidence, "reference_step": {k: ev[k] for k in keep if k in ev}},
        trial=reference.trial,
    )


def _items(finding: Finding) -> list[Any]:
    """The dataset items the finding's rows were (a replayed step's bad rows, named by the DataLoader)."""
    experiment = finding.evidence.get("experiment")
    rows = finding.evidence.get("rows") or (experiment.get("rows") if isinstance(experiment, dict) else None)
    return list(rows.get("dataset_indices") or []) if isinstance(rows, dict) else []


def _repeated(seen: _Seen) -> Finding:
    first, steps = seen.first, seen.steps
    listed = ", ".join(str(s) for s in steps[:STEPS_LISTED]) + (", ..." if len(steps) > STEPS_LISTED else "")
    many = len(steps) if steps else seen.occurrences
    text = f" The same on {many} optimizer steps ({listed})." if steps else f" Seen {seen.occurrences} times."
    evidence: dict[str, Any] = {**first.evidence, "occurrences": seen.occurrences}
    if steps:
        evidence.update(first_step=steps[0], last_step=steps[-1], steps=steps[:STEPS_LISTED])
    if len(seen.items) > len(_items(first)):  # each step's own bad items, not the first step's alone
        named = ", ".join(str(i) for i in seen.items[:STEPS_LISTED]) + (
            " ..." if len(seen.items) > STEPS_LISTED else ""
        )
        text += f" The dataset items on those steps: {named}."
        evidence["dataset_indices_all"] = seen.items[:STEPS_LISTED]
    return replace(first, message=first.message + text, evidence=evidence)


def annotated(finding: Finding, text: str, evidence: dict[str, Any]) -> Finding:
    return replace(finding, message=finding.message + text, evidence={**finding.evidence, **evidence})
