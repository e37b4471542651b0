"""Known problems from `known_issues.yaml`: error-text symptoms and NCCL version conditions.

Issues that have a dedicated rule (H20 cuBLAS, arch, driver, NumPy ABI, duplicate libraries)
are matched here too, so those rules can quote the matching line, but only reported by them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from fpdoctor import catalog
from fpdoctor.env.refdata import refdata, version
from fpdoctor.report.model import Finding, Severity

HANDLED_ELSEWHERE = {
    "H20_CUBLAS_SIGFPE",
    "ARCH_NOT_IN_TORCH_BUILD",
    "DRIVER_TOO_OLD_FOR_CUDA",
    "NUMPY2_ABI",
    "DUPLICATE_CUDA_RUNTIME_LIBS",
}


@functools.lru_cache(maxsize=1)
def _compiled() -> list[tuple[str, list[re.Pattern[str]]]]:
    return [(issue["id"], [re.compile(s) for s in issue.get("symptoms") or []]) for issue in refdata().known_issues]


def matched_issues(texts: Iterable[str]) -> dict[str, list[str]]:
    """Known-issue id -> the distinct lines in `texts` that match one of its symptoms."""
    texts = list(texts)
    found: dict[str, list[str]] = {}
    for issue_id, patterns in _compiled():
        for pattern in patterns:
            for text in texts:
                for m in pattern.finditer(text):
                    start = text.rfind("\n", 0, m.start()) + 1
                    end = text.find("\n", m.end())
                    line = text[start : end if end != -1 else None].strip()[:240]
                    lines = found.setdefault(issue_id, [])
                    if line not in lines and len(lines) < 5:
                        lines.append(line)
    return found


def severity_for(issue: dict[str, Any]) -> Severity:
    confidence = issue.get("confidence", "unconfirmed")
    if confidence == "unconfirmed":
        return Severity.INFO
    weak = "unvalidated" in str(issue.get("notes", "")) or "weak signal" in str(issue.get("symptoms"))
    if confidence == "confirmed" and issue.get("kind") == "crash" and not weak:
        return Severity.ERROR
    return Severity.WARNING


def _urls(sources: list[Any]) -> list[str]:
    return [s for s in sources if isinstance(s, str) and s.startswith("http")]


def _nccl_condition(issue: dict[str, Any], nccl: str | None) -> str | None:
    """The condition text when the installed NCCL version falls in the issue's range."""
    nv = version(nccl)
    if nv is None:
        return None
    cond = issue.get("conditions") or {}
    for key in ("nccl_version", "nccl_version_range"):
        spec_text = cond.get(key)
        if not isinstance(spec_text, str):
            continue
        spec_text = spec_text.strip()
        if spec_text.endswith(".x"):
            spec_text = f"=={spec_text[:-2]}.*"
        elif spec_text[0].isdigit():
            spec_text = f"=={spec_text}"
        try:
            if nv in SpecifierSet(spec_text):
                return f"NCCL {nccl} matches {key} {cond[key]!r}"
        except InvalidSpecifier:
            continue
    return None


def known_issues(ctx: Any) -> Iterable[Finding]:
    nccl = ctx.facts.torch.get("nccl") or next(
        (w["version"] for w in ctx.facts.wheels if "nccl" in w["libraries"]), None
    )
    cited = {f.evidence.get("known_issue") for f in ctx.findings}  # e.g. the cause of an import failure
    for issue in ctx.ref.known_issues:
        if issue["id"] in HANDLED_ELSEWHERE or issue["id"] in cited:
            continue
        lines = ctx.symptoms.get(issue["id"])
        condition = _nccl_condition(issue, nccl)
        if not lines and not condition:
            continue
        evidence: dict[str, Any] = {"issue": issue["id"], "confidence": issue.get("confidence")}
        if lines:
            evidence["matched"] = lines
        if condition:
            evidence["condition"] = condition
        yield catalog.make(
            "known-issue",
            title=issue["title"],
            severity=severity_for(issue)
            if lines
            else Severity.WARNING
            if issue.get("confidence") != "unconfirmed"
            else Severity.INFO,
            message=(
                f"Matched the known issue {issue['id']} "
                f"({'error text' if lines else 'installed version'}; source confidence: {issue.get('confidence')})."
            ),
            evidence=evidence,
            fix="\n".join(issue.get("fix") or []),
            references=_urls(issue.get("sources") or []),
        )
