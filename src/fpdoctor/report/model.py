"""The report model every capability returns: a `Report` holding `Finding`s (ARCHITECTURE.md, contract 1).

Findings are plain data. They are built from the catalogue (`fpdoctor.catalog.make`), so a code,
its name, title and references always travel together; a capability only adds what it saw.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fpdoctor._version import __version__

SCHEMA = "fpdoctor.report/1"

# `data["status"]` of a report whose run did not reach its end: cut short (a terminated script, a check
# that could not finish) or still going (a report rewritten while its run goes on). Never an "ok".
UNFINISHED = ("incomplete", "in progress")


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


def severity_rank(value: str) -> int:
    """The rank of a severity as a report's JSON spells it ("error" -> 2); one this version does
    not know (a newer fpdoctor's) ranks lowest."""
    try:
        return Severity(value).rank
    except ValueError:
        return 0


@dataclass(frozen=True, kw_only=True)
class Trial:
    """Whether a finding's fix was tried, and what it did (SPEC 3.2: every printed fix says so).

    Either `tried`: what was `changed`, `on` which input or steps, and the `metric` `before` ->
    `after`, measured by re-running with the fix in place; or not tried, with the `reason`. A fix
    that was tried and did not help is not a fix: the finding prints another, or none."""

    tried: bool
    changed: str = ""
    on: str = ""
    metric: str = ""
    before: float | str | None = None
    after: float | str | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.tried and not (self.changed and self.metric):
            raise ValueError("a tried fix says what was changed and what was measured")
        if not self.tried and not self.reason:
            raise ValueError("an untried fix says why it was not tried")

    @classmethod
    def checked(
        cls, changed: str, *, metric: str, before: float | str | None, after: float | str | None, on: str = ""
    ) -> Trial:
        return cls(tried=True, changed=changed, on=on, metric=metric, before=before, after=after)

    @classmethod
    def untried(cls, reason: str) -> Trial:
        return cls(tried=False, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        if not self.tried:
            return {"status": "not-tried", "reason": self.reason}
        out: dict[str, Any] = {"status": "checked", "changed": self.changed, "metric": self.metric}
        out |= {"before": self.before, "after": self.after}
        if self.on:
            out["on"] = self.on
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Trial:
        if d.get("status") == "checked":
            return cls.checked(
                str(d.get("changed") or "?"),
                metric=str(d.get("metric") or "?"),
                before=d.get("before"),
                after=d.get("after"),
                on=str(d.get("on") or ""),
            )
        return cls.untried(str(d.get("reason") or "not said"))

    def text(self) -> str:
        """One line, as every renderer prints it under the fix."""
        if not self.tried:
            return f"not tried: {self.reason}"
        on = f" on {self.on}" if self.on else ""
        return f"checked{on}: {self.changed}; {self.metric} {_figure(self.before)} -> {_figure(self.after)}"


def _figure(value: float | str | None) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "?" if value is None else str(value)


@dataclass(frozen=True, kw_only=True)
class Finding:
    """One problem, with the evidence that shows it and the fix that removes it."""

    code: str
    name: str
    severity: Severity
    title: str
    message: str
    fix: str = ""
    where: Mapping[str, Any] = field(default_factory=dict)
    evidence: Mapping[str, Any] = field(default_factory=dict)
    references: tuple[str, ...] = ()
    trial: Trial | None = None  # whether `fix` was tried (see `unproven`)

    def __post_init__(self) -> None:
        if not isinstance(self.severity, Severity):
            raise ValueError(f"severity must be a Severity, got {self.severity!r}")
        if not self.code or not self.name:
            raise ValueError("a finding needs both a code and a name")

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "title": self.title,
            "message": self.message,
            "where": _known(self.where, keep=("module",)),
            "evidence": _known(self.evidence),
            "fix": self.fix,
            **({"fix_trial": self.trial.to_dict()} if self.trial is not None else {}),
            "references": list(self.references),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Finding:
        """Read back `to_dict` (a finding another process or rank sent as JSON)."""
        return cls(
            code=d["code"],
            name=d["name"],
            severity=Severity(d["severity"]),
            title=d["title"],
            message=d["message"],
            fix=d.get("fix") or "",
            where=dict(d.get("where") or {}),
            evidence=dict(d.get("evidence") or {}),
            references=tuple(d.get("references") or ()),
            trial=Trial.from_dict(d["fix_trial"]) if isinstance(d.get("fix_trial"), Mapping) else None,
        )

    @property
    def unproven(self) -> bool:
        """A fix printed at warning or error level with neither its measured effect nor why it could
        not be tried: what the contract forbids (tests/conftest.py fails every test that makes one)."""
        return bool(self.fix.strip()) and self.severity.rank >= Severity.WARNING.rank and self.trial is None


def _known(values: Mapping[str, Any], keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """Keys whose value is unknown are omitted, not null (ARCHITECTURE.md, contract 2); `where.module` is the
    exception: null there is a fact (an op outside any module), not a gap."""
    return {k: v for k, v in values.items() if v is not None or k in keep}


@dataclass(frozen=True)
class Judged:
    """What a rule engine (env rules, health checks) made of its facts: the findings, and what it
    could not judge and why (a rule that raised, a table without a row), for the report's not_checked."""

    findings: list[Finding]
    not_checked: dict[str, str]


@dataclass(kw_only=True)
class Report:
    """What one command found; `data` holds the capability's facts and tables."""

    command: str
    findings: list[Finding] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    version: str = __version__

    def extend(self, findings: Iterable[Finding]) -> None:
        self.findings.extend(findings)

    @property
    def verdict(self) -> str:
        """The worst severity among the findings; a run that did not reach its end (`UNFINISHED`)
        was not judged to its end, so it is at least "warning", never "ok" (its exit status is not changed)."""
        worst = max((f.severity.rank for f in self.findings), default=0)
        if self.data.get("status") in UNFINISHED:
            worst = max(worst, Severity.WARNING.rank)
        return {0: "ok", 1: "warning", 2: "error"}[worst]

    @property
    def exit_code(self) -> int:
        """0 without error-level findings, 1 with them; bad input exits 2 before any report."""
        return 1 if self.verdict == "error" else 0

    def sorted_findings(self) -> list[Finding]:
        """Errors first, then warnings, then notes; stable within a severity."""
        return sorted(self.findings, key=lambda f: -f.severity.rank)

    def by_name(self, name: str) -> list[Finding]:
        return [f for f in self.findings if f.name == name]

    def to_dict(self) -> dict[str, Any]:
        """The public JSON shape, secrets redacted (nothing secret leaves the machine)."""
        from fpdoctor.report.redact import redact

        raw = {
            "schema": SCHEMA,
            "command": self.command,
            "version": self.version,
            "verdict": self.verdict,
            "findings": [f.to_dict() for f in self.sorted_findings()],
            "data": self.data,
        }
        redacted: dict[str, Any] = redact(raw)
        return redacted

    def to_json(self, indent: int | None = 2) -> str:
        return json_text(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        """The text rendering, as `fpdoctor` prints it (no colour)."""
        from fpdoctor.report.render import render

        return render(self.to_dict(), "text", color=False)


def _standard(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {k: _standard(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_standard(v) for v in value]
    return value


def json_text(value: Any, indent: int | None = 2) -> str:
    """Standard JSON (RFC 8259 has no NaN or Infinity): a non-finite number is written as the
    string "nan", "inf" or "-inf", so every strict parser reads the report."""
    return json.dumps(_standard(value), indent=indent, sort_keys=False, default=str, allow_nan=False)
