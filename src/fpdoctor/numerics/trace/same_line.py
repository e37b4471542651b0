"""One line, one cause: what a line does later in the run belongs to the finding that names the
line's first non-finite value.

A producer's finding (nonfinite-produced, nonfinite-zeroed) is experimented on at its first
occurrence: its fix is checked there. The same line may do more later: another of its ops grows
to the format's limit (a sum of squares whose squares overflow once the gradients grow), which
the headroom check reports as overflow-risk, and the same op overflows again where a later op
masks it (nonfinite-masked). Printed apart, the first reads as the whole fix and the others as
separate problems ("usually nothing"); applied as printed, the line overflows again. Here the
producer's fix takes the whole line (every op of it in fp32, the near-limit op named) and the
findings at the same line that only repeat it are dropped.
"""

from __future__ import annotations

import dataclasses

from fpdoctor.report.model import Finding

_PRODUCERS = ("nonfinite-produced", "nonfinite-zeroed")
# a reduction's own fix (nonfinite.fix text): not enough where another op of the line reaches the limit
_REDUCTION_HINT = " (a reduction: .sum(dtype=torch.float32))"
_ALTERNATIVES = (" Also possible, not tried:", " Or run it in bf16")


def line_of(finding: Finding) -> str | None:
    """'file.py:22' of a finding's source location ('file.py:22 in fn'), or None."""
    at = finding.evidence.get("location")
    return at.split(" in ", 1)[0] if isinstance(at, str) and at else None


def merged(findings: list[Finding]) -> list[Finding]:
    """`findings` with each producer's finding holding what its line does later (see the docstring)."""
    producers = {line_of(f) or "": f for f in findings if f.name in _PRODUCERS and line_of(f) is not None}
    if not producers:
        return findings
    out: list[Finding] = []
    widened: dict[str, Finding] = {}
    for f in findings:
        at = line_of(f) or ""
        first = producers.get(at)
        if first is None or f is first or f.name in _PRODUCERS:
            out.append(f)
        elif f.name == "overflow-risk" and f.where.get("op") != first.where.get("op"):
            widened[at] = f  # folded into the producer's fix below
        elif f.name in {"nonfinite-masked", "overflow-risk"}:
            continue  # the same op at the same line, later: the producer's finding says it
        else:
            out.append(f)
    return [_widen(f, widened[line_of(f) or ""]) if f.name in _PRODUCERS and line_of(f) in widened else f for f in out]


def _widen(first: Finding, near: Finding) -> Finding:
    """The producer's fix over its whole line: another op of it comes near the limit later."""
    op = near.where.get("op") or "another op"
    number = (line_of(first) or "").rpartition(":")[2]
    share = near.evidence.get("share")
    limit = f"{share:.0%} of {near.evidence.get('target')}'s max" if isinstance(share, float) else "the limit"
    absmax = near.evidence.get("absmax")
    fix = first.fix.replace(_REDUCTION_HINT, "")
    # after the checked sentence, before the alternatives not tried
    cut = min((k for k in (fix.find(m) for m in _ALTERNATIVES) if k >= 0), default=len(fix))
    wider = (
        f" Not only {first.where.get('op') or 'that op'}: {op} on line {number} reaches {limit} later in the run"
        + (f" (absmax {absmax:.4g})" if isinstance(absmax, float) else "")
        + f", and overflows once its inputs grow: compute every op of line {number} in fp32 (its operands "
        ".float() before the first of them), the result cast back after the line."
    )
    fix = fix[:cut] + wider + fix[cut:]
    evidence = {**first.evidence, "same_line_near_limit": {"op": op, "share": share, "absmax": absmax}}
    return dataclasses.replace(first, fix=fix, evidence=evidence)
