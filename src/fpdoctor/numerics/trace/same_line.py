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

One overflow, two lines: the same op of the same values on another line in the same step (a loss
in both directions by hand, log(exp(logits).sum(1)) and log(exp(logits).sum(0)) on two lines) is
the same cause. Each line's finding is checked on its own line; the first's fix, applied alone,
leaves the other overflowing. The first finding's fix names every such line, and says which.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
        return _same_values(findings)  # a scaler's recurring cause widens the same way
    out: list[Finding] = []
    widened: dict[str, Finding] = {}
    told: set[tuple[str, str, str]] = set()  # a first non-finite value's line, op and fix
    for f in findings:
        at = line_of(f) or ""
        first = producers.get(at)
        if f.name in _PRODUCERS:
            said = (at, str(f.where.get("op")), f.fix)
            if f.name == "nonfinite-zeroed" and said in told:
                continue  # the same op's Inf, zeroed by what read it (its backward): the same cause, said once
            if f.name == "nonfinite-produced":
                told.add(said)
            out.append(f)
        elif first is None or f is first:
            out.append(f)
        elif f.name == "overflow-risk" and f.where.get("op") != first.where.get("op"):
            widened[at] = f  # folded into the producer's fix below
        elif f.name in {"nonfinite-masked", "overflow-risk"}:
            continue  # the same op at the same line, later: the producer's finding says it
        else:
            out.append(f)
    out = [_widen(f, widened[line_of(f) or ""]) if f.name in _PRODUCERS and line_of(f) in widened else f for f in out]
    return _same_values(out)


def _same_values(findings: list[Finding]) -> list[Finding]:
    """The first producer's finding of each op on the same values in the same step, with the other
    lines that did the same (see the module docstring)."""
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for f in findings:
        inputs = f.evidence.get("inputs")
        if f.name in _PRODUCERS and line_of(f) is not None and inputs:
            key = (str(f.where.get("op")), str(f.evidence.get("step")), repr(inputs))
            groups.setdefault(key, []).append(f)
    wider: dict[int, list[str]] = {}
    for group in groups.values():
        lines = list(dict.fromkeys(line_of(f) or "" for f in group))
        if len(lines) > 1:
            wider[id(group[0])] = lines[1:]
    # the same op in the same step on other values (the trace's other producers): the first producer's
    # fix, which a user applies first, names those lines too, not experimented on
    out, widened = [], False
    for found in findings:
        f = found
        first = f.name in (*_PRODUCERS, "grad-scaler-stalled") and not widened
        more = f.evidence.get("same_op_at") if first else None
        forms = f.evidence.get("forms_at") if first else None
        if forms:  # lines a form names are said with their own stable form, not "the same change"
            more = [line for line in more or [] if line not in forms]
            f = _forms_at(f, forms)
        if id(found) in wider:
            out.append(_also_at(f, wider[id(found)]))
        elif more:
            out.append(_also_at(f, list(more), same_values=False))
        else:
            out.append(f)
        widened = widened or first
    return out


def _also_at(first: Finding, others: list[str], *, same_values: bool = True) -> Finding:
    """The first finding's fix over the other lines where the same op overflows in the same step: on
    the same values (checked in their own findings), or on others (`same_values` False: not
    experimented on, as the trace experiments on the first producers only)."""
    op = first.where.get("op") or "the op"
    here = (line_of(first) or "").rpartition(":")[2]
    numbers = [here, *(at.rpartition(":")[2] for at in others)]
    named = ", ".join(numbers[:-1]) + f" and {numbers[-1]}"
    where = f"line{'s' if len(others) > 1 else ''} {', '.join(at.rpartition(':')[2] for at in others)}"
    if same_values:
        wider = (
            f" Not only line {here}: {op} of the same values makes the same non-finite result on {where} in the "
            f"same step (its own finding below): make the change on lines {named}; on one line alone, the other "
            "still overflows."
        )
    else:
        checked = set(others) <= set(first.evidence.get("same_op_checked") or [])
        wider = (
            f" Not only line {here}: {op} makes the same non-finite result on {where} in the same step, from its own "
            + (
                "values (the same change checked there on them too)"
                if checked
                else "values (not experimented on: the first producer was)"
            )
            + f": make the same change on lines {named}."
        )
    evidence = {**first.evidence, ("same_values_at" if same_values else "same_op_lines"): others}
    return dataclasses.replace(first, fix=_inserted(first.fix, wider), evidence=evidence)


def _forms_at(first: Finding, forms: dict[str, dict[str, Any]]) -> Finding:
    """The first finding's fix over the other lines that write a hand-written composite (stable.Met):
    those whose exp overflowed too, and those finite in this run that overflow once their x grows."""
    said = []
    for at, met in forms.items():
        number = at.rpartition(":")[2]
        if met["overflowed"]:
            said.append(
                f"line {number} overflows too, in {met['written']}: write {met['stable']} there"
                + (" (checked on the values it read)" if met["checked"] else "")
            )
        else:
            said.append(
                f"line {number} writes {met['written']} too, finite in this step (largest |x| {met['absmax']:.3g}; "
                f"exp overflows {met['dtype']} once x passes {met['edge']:.4g}): write {met['stable']} there as well"
            )
    wider = " The same code on other lines: " + "; ".join(said) + "."
    return dataclasses.replace(first, fix=_inserted(first.fix, wider))


def _widen(first: Finding, near: Finding) -> Finding:
    """The producer's fix over its whole line: another op of it comes near the limit later."""
    op = near.where.get("op") or "another op"
    number = (line_of(first) or "").rpartition(":")[2]
    share = near.evidence.get("share")
    limit = f"{share:.0%} of {near.evidence.get('target')}'s max" if isinstance(share, float) else "the limit"
    absmax = near.evidence.get("absmax")
    # a fix that replaces the whole line (clip_grad_norm_ with a norm taken in fp32) covers its other ops
    whole = first.fix.startswith("clip_grad_norm_")
    wider = (
        f" Not only {first.where.get('op') or 'that op'}: {op} on line {number} reaches {limit} later in the run"
        + (f" (absmax {absmax:.4g})" if isinstance(absmax, float) else "")
        + (
            ": the fp32 norm above replaces it too."
            if whole
            else f", and overflows once its inputs grow: compute every op of line {number} in fp32 (its operands "
            ".float() before the first of them), the result cast back after the line."
        )
    )
    fix = _inserted(first.fix.replace(_REDUCTION_HINT, ""), wider)
    evidence = {**first.evidence, "same_line_near_limit": {"op": op, "share": share, "absmax": absmax}}
    return dataclasses.replace(first, fix=fix, evidence=evidence)


def _inserted(fix: str, wider: str) -> str:
    """`wider` put into a fix after its checked sentence, before the alternatives not tried."""
    cut = min((k for k in (fix.find(m) for m in _ALTERNATIVES) if k >= 0), default=len(fix))
    return fix[:cut] + wider + fix[cut:]
