"""cublas-h20-sigfpe: NVIDIA H20 with a cuBLAS older than 12.4.5.8 (incidents 1 and 2)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from packaging.version import Version

from fpdoctor import catalog
from fpdoctor.env.citations import confidence_text, references
from fpdoctor.env.fixes import TORCH_CHANGE_COST, interpreter, pip
from fpdoctor.env.refdata import INDEX_URL, version
from fpdoctor.env.rules import Context
from fpdoctor.report.model import Finding, Severity

# The first version with independent fix reports (known_issues.yaml): users' reports, not an
# NVIDIA statement, so the finding says so.
FIXED = Version("12.4.5.8")
# 12.3.x was reported to work once and to crash once (NGC 23.12): suggest, never conclude.
CONFLICTING = Version("12.3")
_H20 = re.compile(r"\bH20\b")  # not H200
THRESHOLD_NOTE = (
    f"{FIXED} is the first cuBLAS that users independently report as fixing it; NVIDIA has not stated a root "
    "cause or a fixed version, and 12.3.4.1 is reported both working and crashing."
)


def effective_cublas(ctx: Context) -> tuple[Version | None, str, dict[str, Any]]:
    """The cuBLAS version that runs, from the best evidence available, and how it is known:
    observed (loaded), installed, or inferred from the torch build's pin."""
    facts = ctx.facts
    loaded = [c for c in facts.loaded or [] if c["library"] in ("cublasLt", "cublas") and version(c.get("version"))]
    if loaded:
        best = sorted(loaded, key=lambda c: c["library"] != "cublasLt")[0]
        return version(best["version"]), f"loaded from {best['path']}", best
    wheels = [w for w in facts.wheels if "cublas" in w["libraries"] and version(w["version"])]
    if wheels:
        w = wheels[0]
        return version(w["version"]), f"installed wheel {w['package']} {w['version']}; which copy loads is not shown", w
    tv, variant = facts.torch_version, facts.variant
    if tv and variant:
        pinned = ctx.ref.bundled_cublas(tv, variant)
        if pinned:
            shown = facts.torch.get("version") or f"{tv}+{variant}"
            return pinned[0], f"inferred from torch {shown}'s pin; the copy that loads is not shown", dict(pinned[1])
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
                    "confidence": confidence_text(issue["confidence"]),
                },
                fix="\n".join(
                    [
                        "# first find out which GPU and which cuBLAS ran it: on that machine, in that environment,",
                        "fpdoctor env",
                        "# if it is an H20 with cuBLAS older than 12.4.5.8:",
                        pip(interpreter(facts), f'install "nvidia-cublas-cu12=={FIXED}"'),
                    ]
                ),
                references=references(issue["sources"])[:6],
            )
        return
    if facts.cpu_only_build or (facts.build_cuda and facts.build_cuda.major != 12):
        return  # CUDA 11 builds were the reported workaround; CPU builds load no cuBLAS
    cublas, source, row = effective_cublas(ctx)
    if cublas is None:
        build = facts.build_cuda
        if not (build and build < Version("12.4")):
            return
        source = (
            f"inferred from the CUDA {build} build (its cuBLAS is 12.{build.minor}.x); the copy that loads is not shown"
        )
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
    py = interpreter(facts)
    package = "nvidia-cublas-cu12"
    fix = [
        pip(py, f'install "{package}=={FIXED}"') + "   # pip warns about torch's pin: expected, and harmless here",
        "# then make that copy the one that loads (it must come before any system CUDA directory):",
        f"export LD_LIBRARY_PATH=\"$({py} -c 'import nvidia.cublas as m; print(m.__path__[0])')/lib:$LD_LIBRARY_PATH\"",
        "# or move to a torch whose wheels pin cuBLAS 12.4.5.8 (2.5.x/2.6.x cu124; 2.4.0 cu124 pins 12.4.2.65):",
        pip(py, f'install "torch==2.5.1" --index-url {INDEX_URL.format(variant="cu124")}'),
        TORCH_CHANGE_COST,
    ]
    refs = references(issue["sources"])[:6]
    if row.get("cuda_variant", "").endswith("(PyPI default)") and facts.torch_version:
        # PyPI's JSON lists the wheel's pinned requirements (requires_dist): the pin, checkable.
        refs.insert(0, f"https://pypi.org/pypi/torch/{facts.torch_version.base_version}/json")
    yield catalog.make(
        "cublas-h20-sigfpe",
        severity=severity,
        message=(
            f"{len(h20)} × {', '.join(names)} with cuBLAS {ver} ({source}). cuBLAS before {FIXED} dies with "
            f"SIGFPE (integer divide by zero in cuBLASLt's heuristics) on H20, typically in the first "
            f"nn.Linear.{story} {THRESHOLD_NOTE}"
        ),
        where={"gpus": [g.get("index") for g in h20]},
        evidence={
            # An observed (loaded) version stands alone; any other says how it was found.
            "cublas": ver if source.startswith("loaded") else f"{ver} ({source})",
            "cublas_source": source if source.startswith("loaded") else None,
            "gpus": names,
            "matched": matched,
            "fixed_in": f"{FIXED} (user reports)",
            "confidence": confidence_text(issue["confidence"]),
        },
        fix="\n".join(fix),
        references=refs,
    )
