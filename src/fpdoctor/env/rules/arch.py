"""arch-not-in-build: each GPU's compute capability against the build's SASS/PTX targets."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.citations import cite, confidence_text
from fpdoctor.env.fixes import TORCH_CHANGE_COST, interpreter
from fpdoctor.env.refdata import sm_number
from fpdoctor.env.rules import Context, cap_severity
from fpdoctor.env.suggest import covers, sass_covers, suggest_build
from fpdoctor.report.model import Finding, Severity


def _no_build_fix(ctx: Context, cc: int) -> str:
    """Why no command can be given, and what would make one possible."""
    rows = [r for r in ctx.ref.arch_rows if r.platform == "linux-x86_64" and covers(r, cc)]
    if not rows:
        return (
            f"# no official torch build in fpdoctor's table covers sm_{cc} yet, so there is no install command;\n"
            f"# build torch from source with TORCH_CUDA_ARCH_LIST={cc // 10}.{cc % 10}, or try a nightly build"
        )
    oldest_cuda = min(r.cuda for r in rows)
    floor = ctx.ref.family_floor(oldest_cuda.major, ctx.facts.windows)
    need = f" >= {ctx.ref.driver_text(floor[1], ctx.facts.windows)}" if floor else ""
    return (
        f"# the builds that cover sm_{cc} need CUDA {oldest_cuda}+ and a driver{need}; this machine has driver "
        f"{ctx.facts.driver_text or '(unknown)'}, so no build that runs here covers it: upgrade the driver first\n"
        "# (it comes from the OS packages or NVIDIA's installer, so fpdoctor gives no command for it),\n"
        "# then run fpdoctor env again for the torch build to install"
    )


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
            origin = (
                f"inferred from fpdoctor's table of official torch {row.torch_minor} {row.variant} wheels "
                f"({cite(row.source)}), not read from this install"
            )
            return arch, origin, row.confidence
    return None, "", ""


def arch_not_in_build(ctx: Context) -> Iterable[Finding]:
    facts = ctx.facts
    if facts.cpu_only_build:
        return
    arch, origin, confidence = _arch_list(ctx)
    build = facts.build_cuda
    ccs = sorted({sm_number(g["compute_capability"]) for g in facts.gpus if g.get("compute_capability")})
    if ccs and arch is None and facts.torch_version and facts.variant:
        ctx.not_checked["GPU architecture coverage"] = (
            f"fpdoctor's table has no arch list for torch {facts.torch_version} {facts.variant}; "
            "`fpdoctor env` on that machine reads the build's own list"
        )
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
        fix = f"{suggestion.command(interpreter(facts))}\n{TORCH_CHANGE_COST}" if suggestion else _no_build_fix(ctx, cc)
        names = sorted({g["name"] for g in gpus})
        evidence: dict[str, Any] = {
            "gpus": names,
            "compute_capability": f"{cc // 10}.{cc % 10}",
            "arch_list": arch,
            "arch_list_source": origin,
            "confidence": confidence_text(confidence),
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
                + (" (inferred from fpdoctor's table of official wheels)" if arch and not facts.arch_list else "")
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
            fix=(
                "# the input does not show which GPU and which torch build, so no install command can be given;\n"
                "# on that machine, in that environment, this names the build to install:\n"
                "fpdoctor env"
            ),
            evidence={"matched": ctx.symptoms["ARCH_NOT_IN_TORCH_BUILD"]},
        )
