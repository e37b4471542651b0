"""cublas-h20-sigfpe: NVIDIA H20 with a cuBLAS older than 12.4.5.8 (incidents 1 and 2)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from packaging.version import Version

from fpdoctor import catalog
from fpdoctor.env.refdata import INDEX_URL, version
from fpdoctor.env.rules import Context
from fpdoctor.report.model import Finding, Severity

FIXED = Version("12.4.5.8")  # first version with independent fix reports (known_issues.yaml)
# 12.3.x was reported to work once and to crash once (NGC 23.12): suggest, never conclude.
CONFLICTING = Version("12.3")
_H20 = re.compile(r"\bH20\b")  # not H200


def effective_cublas(ctx: Context) -> tuple[Version | None, str, dict[str, Any]]:
    """The cuBLAS version that runs, from the best evidence available, and where it came from."""
    facts = ctx.facts
    loaded = [c for c in facts.loaded or [] if c["library"] in ("cublasLt", "cublas") and version(c.get("version"))]
    if loaded:
        best = sorted(loaded, key=lambda c: c["library"] != "cublasLt")[0]
        return version(best["version"]), f"loaded: {best['path']}", best
    wheels = [w for w in facts.wheels if "cublas" in w["libraries"] and version(w["version"])]
    if wheels:
        w = wheels[0]
        return version(w["version"]), f"installed wheel {w['package']} {w['version']}", w
    tv, variant = facts.torch_version, facts.variant
    if tv and variant:
        pinned = ctx.ref.bundled_cublas(tv, variant)
        if pinned:
            return pinned[0], f"pinned by torch {tv} {variant} ({pinned[1]['source']})", dict(pinned[1])
    return None, "", {}


def cublas_h20_sigfpe(ctx: Context) -> Iterable[Finding]:
    facts = ctx.facts
    issue = ctx.ref.known_issue("H20_CUBLAS_SIGFPE")
    h20 = [g for g in facts.gpus if _H20.search(g.get("name", ""))]
    matched = ctx.symptoms.get("H20_CUBLAS_SIGFPE")
    if not h20:
        if matched and not facts.gpus:
            # The crash signature without GPU facts: a strong hint, not a verdict.
            yield catalog.make(
                "cublas-h20-sigfpe",
                severity=Severity.WARNING,
                message=(
                    "The log shows a SIGFPE crash with the signature of the H20 cuBLAS bug, but not which GPU "
                    "ran it. Run `fpdoctor env` on that machine to confirm."
                ),
                evidence={
                    "matched": matched,
                    "signals": (facts.raw.get("log") or {}).get("signals"),
                    "confidence": issue["confidence"],
                },
                fix="\n".join(issue["fix"]),
            )
        return
    if facts.cpu_only_build or (facts.build_cuda and facts.build_cuda.major != 12):
        return  # CUDA 11 builds were the reported workaround; CPU builds load no cuBLAS
    cublas, source, _ = effective_cublas(ctx)
    if cublas is None:
        build = facts.build_cuda
        if not (build and build < Version("12.4")):
            return
        source = f"inferred from the CUDA {build} build (its cuBLAS is 12.{build.minor}.x)"
    elif cublas >= FIXED:
        return
    severity = Severity.WARNING if cublas is not None and cublas >= CONFLICTING else Severity.ERROR
    upgraded = [w for w in facts.wheels if "cublas" in w["libraries"] and (version(w["version"]) or FIXED) >= FIXED]
    story = ""
    if upgraded and source.startswith("loaded"):
        story = (
            f" {upgraded[0]['package']} {upgraded[0]['version']} is installed, but the process loaded the "
            "older copy above, so the upgrade has no effect (see library-shadowed)."
        )
    ver = str(cublas) if cublas else "< 12.4"
    names = sorted({g["name"] for g in h20})
    fix = [
        f'python -m pip install "nvidia-cublas-cu12=={FIXED}"   # pip warns about torch\'s pin: expected',
        "# make the wheel's copy the one that loads (it must come before any system CUDA directory):",
        "export LD_LIBRARY_PATH=\"$(python -c 'import nvidia.cublas as m; print(m.__path__[0])')/lib"
        ':$LD_LIBRARY_PATH"',
        "# or move to a torch whose wheels pin cuBLAS 12.4.5.8 or newer:",
        f'python -m pip install "torch==2.5.1" --index-url {INDEX_URL.format(variant="cu124")}',
    ]
    yield catalog.make(
        "cublas-h20-sigfpe",
        severity=severity,
        message=(
            f"{len(h20)} × {', '.join(names)} with cuBLAS {ver} ({source}). cuBLAS before {FIXED} dies with "
            f"SIGFPE (integer divide by zero in cuBLASLt's heuristics) on H20, typically in the first "
            f"nn.Linear.{story}"
            + (
                " cuBLAS 12.3 is reported both working and crashing: treat with care."
                if severity is Severity.WARNING
                else ""
            )
        ),
        where={"gpus": [g.get("index") for g in h20]},
        evidence={
            "cublas": ver,
            "cublas_source": source,
            "gpus": names,
            "matched": matched,
            "fixed_in": str(FIXED),
            "confidence": issue["confidence"],
        },
        fix="\n".join(fix),
        references=[s for s in issue["sources"] if isinstance(s, str) and s.startswith("http")][:6],
    )
