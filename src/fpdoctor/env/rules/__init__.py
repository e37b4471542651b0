"""The environment rule base: one module per concern, registered in one explicit list.

A rule is `check(ctx) -> Iterable[Finding]`. Rules read facts through `Facts`, reference data
through `RefData`, and may read the findings of rules that ran before them (probes explain
their crashes with the cuBLAS rule's finding). Order matters only for that. A rule never
writes into the facts: what it could not judge, and why, goes into `ctx.not_checked`, so the same
facts judge the same a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from fpdoctor.env.facts import Facts
from fpdoctor.env.refdata import RefData, refdata
from fpdoctor.report.model import Finding, Judged, Severity


@dataclass
class Context:
    facts: Facts
    ref: RefData
    symptoms: dict[str, list[str]]  # known-issue id -> the lines of text that matched a specific symptom
    weak_symptoms: dict[str, list[str]] = field(default_factory=dict)  # ... that matched a generic one
    findings: list[Finding] = field(default_factory=list)
    not_checked: dict[str, str] = field(default_factory=dict)  # what a rule could not judge -> why


Rule = Callable[[Context], Iterable[Finding]]


def cap_severity(severity: Severity, confidence: str) -> Severity:
    """`unconfirmed` facts may suggest but never make an error (ARCHITECTURE.md, contract 6)."""
    if confidence == "unconfirmed" and severity is Severity.ERROR:
        return Severity.WARNING
    return severity


def all_rules() -> list[Rule]:
    from fpdoctor.env.rules import arch, builds, cublas, cuda_errors, driver, known, libraries, probes, startup

    return [
        builds.torch_import_failed,
        builds.cpu_only_build,
        builds.duplicate_torch_install,
        builds.numpy_abi_mismatch,
        startup.op_overridden_at_startup,
        driver.driver_too_old,
        arch.arch_not_in_build,
        cublas.cublas_h20_sigfpe,
        libraries.duplicate_cuda_library,
        libraries.library_shadowed,
        probes.probe_results,
        known.known_issues,
        cuda_errors.cuda_errors,
    ]


def evaluate(facts: Facts, ref: RefData | None = None) -> Judged:
    from fpdoctor.env.rules.known import matched_issues

    texts = facts.texts
    ctx = Context(
        facts=facts,
        ref=ref or refdata(),
        symptoms=matched_issues(texts),
        weak_symptoms=matched_issues(texts, weak=True),
    )
    for rule in all_rules():
        try:
            ctx.findings.extend(rule(ctx))
        except Exception as exc:  # a broken rule must not hide what the other rules found
            ctx.not_checked[f"rule {rule.__name__}"] = (
                f"failed with {type(exc).__name__}: {exc}; please report this to fpdoctor"
            )
    return Judged(findings=ctx.findings, not_checked=ctx.not_checked)
