"""driver-too-old: the driver against the CUDA the torch build needs (NVIDIA's tables)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.citations import cite, confidence_text, references
from fpdoctor.env.fixes import TORCH_CHANGE_COST, interpreter
from fpdoctor.env.refdata import sm_number
from fpdoctor.env.rules import Context
from fpdoctor.env.suggest import suggest_build
from fpdoctor.report.model import Finding, Severity

# A driver comes from the OS packages, NVIDIA's installer or the cloud image: no one command fits.
_DRIVER_HOW = "it comes from the OS packages or NVIDIA's installer, so fpdoctor gives no command for it"


def _source(row: dict[str, str]) -> dict[str, str | None]:
    return {"source": cite(row["source"]), "confidence": confidence_text(row["confidence"])}


def driver_too_old(ctx: Context) -> Iterable[Finding]:
    facts = ctx.facts
    build = facts.build_cuda
    driver = facts.driver
    max_cuda = facts.driver_max_cuda
    matched = ctx.symptoms.get("DRIVER_TOO_OLD_FOR_CUDA")
    ccs = [sm_number(g["compute_capability"]) for g in facts.gpus if g.get("compute_capability")]
    driver_text = facts.driver_text
    evidence: dict[str, Any] = {"driver": driver_text, "torch_cuda": str(build) if build else None}
    if matched:
        evidence["matched"] = matched

    family = ctx.ref.family_floor(build.major, facts.windows) if build else None
    # CUDA 10 and older have no minor-version compatibility: the exact toolkit's driver is the floor.
    floor = family or (ctx.ref.toolkit_floor(build, facts.windows) if build else None)
    if build and facts.windows and floor is None and ctx.ref.family_floor(build.major) is not None:
        # NVIDIA's table prints N/A for Windows from CUDA 13 (drivers no longer bundled): no floor to judge by.
        ctx.not_checked[f"driver floor for CUDA {build.major}.x on Windows"] = (
            f"NVIDIA's table gives no Windows minimum driver for CUDA {build.major}.x builds, so driver "
            f"{driver_text or '(unknown)'} was not checked against one"
        )
    if build and driver and floor is None and not facts.windows:
        ctx.not_checked[f"driver floor for CUDA {build}"] = (
            f"fpdoctor's table of NVIDIA's minimum drivers has no row for CUDA {build}; driver {driver_text} "
            "was not checked against one"
        )
    too_old = False
    if driver and floor and driver < floor[0]:
        too_old = True
        evidence.update(required=ctx.ref.driver_text(floor[1], facts.windows), **_source(floor[1]))
    elif not driver and max_cuda and build and max_cuda.major < build.major:
        # Only the driver's CUDA version is known ("found version 11040" means CUDA 11.4).
        too_old = True
        evidence["driver_max_cuda"] = str(max_cuda)
    elif matched and not (driver and floor):
        too_old = True
        if max_cuda:
            evidence["driver_max_cuda"] = str(max_cuda)

    if not too_old:
        # Above the family floor but below the exact toolkit's driver: runs under minor-version
        # compatibility, where PTX JIT of newer code and some APIs are unavailable.
        exact = ctx.ref.toolkit_floor(build, facts.windows) if build and family else None
        if build and driver and exact and driver < exact[0]:
            needed = ctx.ref.driver_text(exact[1], facts.windows)
            yield catalog.make(
                "driver-too-old",
                severity=Severity.INFO,
                title="The driver runs this CUDA build only under minor-version compatibility",
                message=(
                    f"Driver {driver_text} is below {needed}, the driver CUDA {build} shipped with, but above the "
                    f"CUDA {build.major}.x floor: ordinary kernels run; PTX JIT of newer code does not."
                ),
                fix=f"# only if kernels fail to JIT: upgrade the NVIDIA driver to >= {needed}; {_DRIVER_HOW}",
                evidence={**evidence, "required": needed, **_source(exact[1])},
                references=references([exact[1]["source"]]),
            )
        return

    newest = ctx.ref.newest_cuda_for_driver(driver, facts.windows) if driver else max_cuda
    suggestion = suggest_build(
        ctx.ref,
        torch_version=facts.torch_version,
        capabilities=ccs,
        driver=driver,
        windows=facts.windows,
        max_cuda=newest if not driver else None,
    )
    fix_lines = []
    if floor and build:
        scope = f"CUDA {build.major}.x builds" if family else f"CUDA {build} builds"
        system = "Windows" if facts.windows else "Linux"
        minimum = ctx.ref.driver_text(floor[1], facts.windows)
        fix_lines.append(
            f"# upgrade the NVIDIA driver to >= {minimum} (minimum for {scope} on {system}); {_DRIVER_HOW}"
        )
    else:
        fix_lines.append(
            "# upgrade the NVIDIA driver; the input does not show which CUDA this torch needs, so no minimum is "
            f"given; {_DRIVER_HOW}"
        )
    if suggestion and (build is None or suggestion.row.cuda < build):
        fix_lines.append(f"# or keep the driver and install a torch built for CUDA {suggestion.row.cuda}:")
        fix_lines.append(suggestion.command(interpreter(facts)))
        fix_lines.append(TORCH_CHANGE_COST)
    severity = Severity.ERROR
    msg_tail = ""
    if facts.cuda_available and driver:
        # CUDA still initialised: a forward-compatibility package (cuda-compat) is bridging the gap,
        # which NVIDIA supports only on data-centre GPUs.
        severity = Severity.WARNING
        msg_tail = (
            " CUDA still initialised, so a forward-compatibility package (cuda-compat) is probably in use; "
            "that works only on data-centre GPUs and breaks when the container or host changes."
        )
    what = (
        f"driver {driver_text}"
        if driver
        else f"a driver that supports at most CUDA {max_cuda}"
        if max_cuda
        else "the driver"
    )
    needs = f"CUDA {build}" if build else "a newer CUDA"
    yield catalog.make(
        "driver-too-old",
        severity=severity,
        message=f"torch {facts.torch.get('version') or '(version unknown)'} needs {needs}, but this machine has {what}."
        + msg_tail,
        fix="\n".join(fix_lines),
        evidence=evidence,
        references=references([floor[1]["source"]]) if floor else (),
    )
