"""arch-not-in-build: each GPU's compute capability against the build's SASS/PTX targets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.refdata import sm_number
from fpdoctor.env.rules import Context, cap_severity
from fpdoctor.env.suggest import sass_covers, suggest_build
from fpdoctor.report.model import Finding, Severity


def _arch_list(ctx: Context) -> tuple[list[str] | None, str, str]:
    """The build's arch list, where it came from, and how sure that source is."""
    live = ctx.facts.arch_list
    if live:
        origin = "torch.cuda.get_arch_list()" if not ctx.facts.offline else "the report's own text"
        return live, origin, "confirmed"
    tv, variant = ctx.facts.torch_version, ctx.facts.variant
    if tv and variant:
        row = ctx.ref.arch_row(tv, variant)
        if row:
            arch = [f"sm_{s}" for s in row.sass] + ([f"compute_{row.ptx}"] if row.ptx else [])
            return arch, f"fpdoctor table for torch {row.torch_minor} {row.variant} ({row.source})", row.confidence
    return None, "", ""


def arch_not_in_build(ctx: Context) -> Iterable[Finding]:
    facts = ctx.facts
    if facts.cpu_only_build:
        return
    arch, origin, confidence = _arch_list(ctx)
    build = facts.build_cuda
    ccs = sorted({sm_number(g["compute_capability"]) for g in facts.gpus if g.get("compute_capability")})
    reported = False
    for cc in ccs:
        gpus = [g for g in facts.gpus if g.get("compute_capability") and sm_number(g["compute_capability"]) == cc]
        first = ctx.ref.first_cuda_for_sm.get(cc)
        toolkit_too_old = bool(build and first and build < first[0])
        severity: Severity | None = None
        detail = ""
        if arch:
            sass = [sm_number(a) for a in arch if a.startswith("sm_")]
            ptx = [sm_number(a) for a in arch if a.startswith("compute_")]
            if any(sass_covers(s, cc) for s in sass):
                continue
            if any(p <= cc for p in ptx) and not toolkit_too_old:
                severity = Severity.WARNING
                detail = (
                    f" It can run only through PTX JIT of compute_{max(p for p in ptx if p <= cc)}: a slow first "
                    "start, and bundled libraries may have no kernels for it."
                )
            else:
                severity = Severity.ERROR
        elif toolkit_too_old:
            severity, origin, confidence = Severity.ERROR, "the build's CUDA version", first[1]["confidence"]  # type: ignore[index]
        if severity is None:
            continue
        if toolkit_too_old:
            detail += f" CUDA {build} predates sm_{cc} (first supported in CUDA {first[0]})."  # type: ignore[index]
        suggestion = suggest_build(
            ctx.ref, torch_version=facts.torch_version, capabilities=ccs, driver=facts.driver, windows=facts.windows
        )
        fix = suggestion.command if suggestion else catalog.get("arch-not-in-build").fix
        fix += (
            "\n# then rebuild or reinstall CUDA extensions (flash-attn, xformers, apex, custom ops) for the new build"
        )
        names = sorted({g["name"] for g in gpus})
        evidence: dict[str, Any] = {
            "gpus": names,
            "compute_capability": f"{cc // 10}.{cc % 10}",
            "arch_list": arch,
            "arch_list_source": origin,
            "confidence": confidence,
            "torch": facts.torch.get("version"),
        }
        if ctx.symptoms.get("ARCH_NOT_IN_TORCH_BUILD"):
            evidence["matched"] = ctx.symptoms["ARCH_NOT_IN_TORCH_BUILD"]
        reported = True
        yield catalog.make(
            "arch-not-in-build",
            severity=cap_severity(severity, confidence),
            message=(
                f"{', '.join(names)} (sm_{cc}) is not covered by torch {facts.torch.get('version')}"
                + (f" whose targets are {' '.join(arch)}" if arch else "")
                + f".{detail}"
                + (f" {suggestion.pin} from {suggestion.index_url} covers it." if suggestion else "")
            ),
            fix=fix,
            evidence=evidence,
        )
    if not reported and ctx.symptoms.get("ARCH_NOT_IN_TORCH_BUILD"):
        yield catalog.make(
            "arch-not-in-build",
            message="The text shows PyTorch refusing this GPU: no kernel image for its compute capability.",
            fix=catalog.get("arch-not-in-build").fix,
            evidence={"matched": ctx.symptoms["ARCH_NOT_IN_TORCH_BUILD"]},
        )
