"""Every finding code as data: code, name, severity, title, documentation, fix, references.

Codes are stable and never reused (like ruff's rule codes). A capability creates findings with
`make(name, ...)`, so the code, title and default severity always come from here.
`fpdoctor explain CODE|NAME` and `fpdoctor rules` read this catalogue.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from fpdoctor.report.model import Finding, Severity, Trial


@dataclass(frozen=True, kw_only=True)
class RuleInfo:
    """One catalogue entry: what a finding code means. (A rule of the env engine, `env.rules.Rule`,
    is the check that produces findings; this is what they say.)"""

    code: str
    name: str
    severity: Severity
    title: str
    what: str  # what it detects
    why: str  # why it matters
    fix: str  # the general fix; findings carry the exact one for the user's versions
    references: tuple[str, ...] = ()
    since: str = "0.1.0"
    # Why no finding of this code can have its fix tried by fpdoctor (an install, an action on the
    # machine, a change on another machine); empty where the fix is a change to the user's run
    # that can be tried, so that every such finding must carry its own trial or its own reason.
    untried: str = ""

    def __post_init__(self) -> None:
        if not (self.code[:3].isalpha() and self.code[3:].isdigit() and len(self.code) == 6):
            raise ValueError(f"rule code must look like ENV001, got {self.code!r}")
        if self.name != self.name.lower() or " " in self.name:
            raise ValueError(f"rule name must be a lower-case slug, got {self.name!r}")


@cache
def _all_rules() -> tuple[RuleInfo, ...]:
    from fpdoctor.catalog.crash import CRS_RULES
    from fpdoctor.catalog.dtype import DTY_RULES
    from fpdoctor.catalog.env import ENV_RULES
    from fpdoctor.catalog.hardware import HWR_RULES
    from fpdoctor.catalog.numerics import NUM_RULES, TRN_RULES

    return ENV_RULES + NUM_RULES + DTY_RULES + TRN_RULES + CRS_RULES + HWR_RULES


class UnknownRuleError(LookupError):
    pass


def rules() -> tuple[RuleInfo, ...]:
    return _all_rules()


@cache
def _index() -> tuple[dict[str, RuleInfo], dict[str, RuleInfo]]:
    """The rules by code and by name, built once: `make` looks one up for every finding."""
    rules = _all_rules()
    return {r.code: r for r in rules}, {r.name: r for r in rules}


def get(code_or_name: str) -> RuleInfo:
    key = code_or_name.strip()
    by_code, by_name = _index()
    rule = by_code.get(key.upper()) or by_name.get(key.lower())
    if rule is None:
        raise UnknownRuleError(code_or_name)
    return rule


def make(
    name: str,
    *,
    message: str,
    fix: str | None = None,
    severity: Severity | None = None,
    where: Mapping[str, Any] | None = None,
    evidence: Mapping[str, Any] | None = None,
    references: tuple[str, ...] | list[str] = (),
    title: str | None = None,
    trial: Trial | None = None,
) -> Finding:
    """Build a finding for catalogue rule `name`; unspecified fields come from the catalogue, the
    fix's trial too where the catalogue says why this code's fixes cannot be tried."""
    rule = get(name)
    refs = tuple(dict.fromkeys([*references, *rule.references]))  # keep order, drop repeats
    return Finding(
        code=rule.code,
        name=rule.name,
        severity=severity or rule.severity,
        title=title or rule.title,
        message=message,
        fix=rule.fix if fix is None else fix,
        where=dict(where or {}),
        evidence=dict(evidence or {}),
        references=refs,
        trial=trial if trial is not None else Trial.untried(rule.untried) if rule.untried else None,
    )


__all__ = ["RuleInfo", "UnknownRuleError", "get", "make", "rules"]
