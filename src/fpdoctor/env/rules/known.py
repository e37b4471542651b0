"""Known problems from `known_issues.yaml`: error text, versions, and the conditions they state.

A finding needs evidence, and its code says how much there is (one code, one severity):
- known-issue-crash (error): a confirmed crash's own error text is in the input;
- known-issue (warning): the problem's error text is in the input, or its version condition holds
  together with every other condition it states;
- known-issue-possible (info): a version condition holds but a condition it needs is not shown
  (multi-node, CUDA graphs, an environment variable, hardware evidence), or the source is unconfirmed.
A generic symptom (a NaN loss, "Bus error", a watchdog timeout) never makes a finding on its own:
it needs a stated condition shown beside it. A condition the input contradicts drops the issue.

Issues that have a dedicated rule (H20 cuBLAS, arch, driver, NumPy ABI, duplicate libraries) are
matched here too, so those rules can quote the matching line, but only reported by them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from fpdoctor import catalog
from fpdoctor.env.citations import confidence_text, references
from fpdoctor.env.fixes import data_fix, interpreter
from fpdoctor.env.refdata import sm_number, version
from fpdoctor.report.model import Finding

HANDLED_ELSEWHERE = {
    "H20_CUBLAS_SIGFPE",
    "ARCH_NOT_IN_TORCH_BUILD",
    "DRIVER_TOO_OLD_FOR_CUDA",
    "NUMPY2_ABI",
    "DUPLICATE_CUDA_RUNTIME_LIBS",
}

# Symptoms that many unrelated failures print: a match says little until a stated condition of the
# issue is shown beside it.
WEAK_SYMPTOMS = frozenset(
    {
        r"(?i)loss.*\bnan\b",  # any training script prints it
        "Bus error",  # any process touching a bad mapping
        "Watchdog caught collective operation timeout",  # any hung collective
        "ScaledDotProductCudnnAttentionBackward0",  # names the op, not the fault
        "RPC call to sample_tokens timed out",  # any stalled vLLM engine
        r"undefined symbol: cuda\w+",  # any mismatched CUDA library
    }
)
# Conditions written in words: the input shows them only through the issue's own error text.
_WORDS = ("topology", "trigger", "applies_to", "gpu")
# What counts as hardware evidence for an issue of kind `hardware` (Xid lines, ECC errors).
HARDWARE = re.compile(r"NVRM: Xid|\bXid \(PCI:|uncorrectable ECC|ECC_UNCORRECTABLE|fallen off the bus", re.IGNORECASE)
_VERSIONS = re.compile(r"\d+\.\d+(?:\.\d+|\.x)?")


@functools.lru_cache(maxsize=1)
def _compiled() -> list[tuple[str, list[tuple[re.Pattern[str], bool]]]]:
    from fpdoctor.env.refdata import refdata

    return [
        (issue["id"], [(re.compile(s), s in WEAK_SYMPTOMS) for s in issue.get("symptoms") or []])
        for issue in refdata().known_issues
    ]


def _lines(pattern: re.Pattern[str], texts: list[str], lines: list[str]) -> None:
    for text in texts:
        for m in pattern.finditer(text):
            start = text.rfind("\n", 0, m.start()) + 1
            end = text.find("\n", m.end())
            line = text[start : end if end != -1 else None].strip()[:240]
            if line not in lines and len(lines) < 5:
                lines.append(line)


def matched_issues(texts: Iterable[str], *, weak: bool = False) -> dict[str, list[str]]:
    """Known-issue id -> the distinct lines in `texts` that match one of its specific symptoms
    (`weak=True`: its generic ones)."""
    texts = list(texts)
    found: dict[str, list[str]] = {}
    for issue_id, patterns in _compiled():
        for pattern, is_weak in patterns:
            if is_weak == weak:
                _lines(pattern, texts, found.setdefault(issue_id, []))
        if not found.get(issue_id):
            found.pop(issue_id, None)
    return found


@dataclass
class Conditions:
    shown: list[str] = field(default_factory=list)  # stated conditions the input shows to hold
    unknown: list[str] = field(default_factory=list)  # stated conditions the input does not show
    against: list[str] = field(default_factory=list)  # stated conditions the input shows to be false
    trigger: bool = False  # a version condition precise enough to raise the issue on its own


def _spec(text: str) -> SpecifierSet | None:
    text = text.strip()
    if text.endswith(".x"):
        text = f"=={text[:-2]}.*"
    elif text[:1].isdigit():
        text = f"=={text}"
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        return None


def _nccl(issue: dict[str, Any], nccl: Version | None, out: Conditions) -> None:
    cond = issue.get("conditions") or {}
    precise = {
        k: cond[k] for k in ("nccl_version", "nccl_version_range", "nccl_version_lt") if isinstance(cond.get(k), str)
    }
    for key, text in precise.items():
        spec = SpecifierSet(f"<{text}") if key == "nccl_version_lt" else _spec(text)
        if spec is None:
            continue
        if nccl is None:
            out.unknown.append(f"NCCL {text}")
        elif nccl in spec:
            out.trigger = True
            out.shown.append(f"NCCL {nccl} (the issue: {'<' if key == 'nccl_version_lt' else ''}{text})")
        else:
            out.against.append(f"NCCL {nccl}")
    seen = cond.get("nccl_version_seen")
    if seen and not precise:
        # Versions seen in reports are not a proven range: the same minor release counts.
        minors = {
            ".".join(v.split(".")[:2])
            for v in _VERSIONS.findall(" ".join(map(str, seen)) if isinstance(seen, list) else str(seen))
        }
        minors |= {v[:-2] for v in _VERSIONS.findall(issue.get("title", "")) if v.endswith(".x")}
        if nccl is None:
            out.unknown.append("NCCL " + "/".join(sorted(minors)) + ".x")
        elif any(nccl in SpecifierSet(f"=={m}.*") for m in minors):
            out.shown.append(f"NCCL {nccl}")
        else:
            out.against.append(f"NCCL {nccl}")


def conditions(issue: dict[str, Any], ctx: Any, nccl: Version | None, hardware: list[str]) -> Conditions:
    """Each condition `issue` states, as shown, unknown or contradicted by the facts."""
    facts = ctx.facts
    cond = issue.get("conditions") or {}
    out = Conditions()
    _nccl(issue, nccl, out)
    if isinstance(cond.get("torch_version"), str):
        spec = _spec(cond["torch_version"].split(" (")[0])
        tv = facts.torch_version
        if spec is not None and tv is None:
            out.unknown.append(f"torch {cond['torch_version']}")
        elif spec is not None and tv is not None:
            (out.shown if Version(tv.base_version) in spec else out.against).append(f"torch {tv}")
    ccs = [sm_number(str(g["compute_capability"])) for g in facts.gpus if g.get("compute_capability")]
    for key, wanted in (("compute_capability", "=="), ("compute_capability_lt", "<")):
        if key in cond:
            limit = sm_number(str(cond[key]))
            ok = [cc for cc in ccs if (cc == limit if wanted == "==" else cc < limit)]
            if not ccs:
                out.unknown.append(f"a GPU with compute capability {wanted.strip('=')}{cond[key]}")
            else:
                (out.shown if ok else out.against).append(
                    f"compute capability {', '.join(str(c / 10) for c in sorted(set(ccs)))}"
                )
    if isinstance(cond.get("env"), str):
        name, _, value = cond["env"].partition("=")
        env = facts.raw.get("env") or {}
        if name in env:
            (out.shown if env[name] == value else out.against).append(f"{name}={env[name]}")
        elif env and not facts.offline:
            out.against.append(f"{name} not set")
        else:
            out.unknown.append(cond["env"])
    for key in _WORDS:
        if isinstance(cond.get(key), str):
            out.unknown.append(cond[key])
    if issue.get("kind") == "hardware":
        if hardware:
            out.shown.append(f"hardware evidence: {hardware[0]}")
        else:
            out.unknown.append("hardware evidence (an Xid or ECC error on that GPU)")
    return out


def finding_name(issue: dict[str, Any], *, text: bool, unknown: list[str]) -> str:
    """The catalogue entry for a matched issue: one code per amount of evidence."""
    if issue.get("confidence") == "unconfirmed":
        return "known-issue-possible"
    if text:
        return (
            "known-issue-crash"
            if issue.get("kind") == "crash" and issue.get("confidence") == "confirmed"
            else "known-issue"
        )
    return "known-issue-possible" if unknown else "known-issue"


def known_issues(ctx: Any) -> Iterable[Finding]:
    nccl = version(
        ctx.facts.torch.get("nccl") or next((w["version"] for w in ctx.facts.wheels if "nccl" in w["libraries"]), None)
    )
    cited = {f.evidence.get("known_issue") for f in ctx.findings}  # e.g. the cause of an import failure
    hardware: list[str] = []
    for text in ctx.facts.texts:
        hardware += [line.strip()[:160] for line in text.splitlines() if HARDWARE.search(line)][:3]
    python = interpreter(ctx.facts)
    for issue in ctx.ref.known_issues:
        if issue["id"] in HANDLED_ELSEWHERE or issue["id"] in cited:
            continue
        lines = ctx.symptoms.get(issue["id"]) or []
        weak = ctx.weak_symptoms.get(issue["id"]) or []
        cond = conditions(issue, ctx, nccl, hardware)
        if lines:
            cond.unknown = []  # the issue's own error text is the evidence of its conditions
        elif cond.against or not (cond.trigger or (weak and cond.shown)):
            continue
        name = finding_name(issue, text=bool(lines), unknown=cond.unknown)
        how = (
            "its error text is in the input"
            if lines
            else "; ".join(cond.shown) + (f" (beside: {weak[0]})" if weak else "")
        )
        message = f"{issue['id']} {'may apply' if name == 'known-issue-possible' else 'applies'}: {how}."
        if name == "known-issue-possible" and cond.unknown:
            message += f" It also needs {', '.join(cond.unknown)}, which the input does not show."
        if issue.get("confidence") == "unconfirmed":
            message += " Its only source is unconfirmed: a suggestion, not a verdict."
        evidence: dict[str, Any] = {"issue": issue["id"], "confidence": confidence_text(issue.get("confidence"))}
        if lines or weak:
            evidence["matched"] = lines or weak
        if cond.shown:
            evidence["shown"] = cond.shown
        if cond.unknown:
            evidence["not_shown"] = cond.unknown
        fix = data_fix(issue.get("fix"), python)
        if issue.get("kind") == "hardware":
            fix += (
                "\nfpdoctor health --duration 10   # per-GPU GEMM fingerprints; under torchrun, compared across ranks"
            )
        yield catalog.make(
            name,
            title=issue["title"],
            message=message,
            evidence=evidence,
            fix=fix,
            references=references(issue.get("sources") or []),
        )
