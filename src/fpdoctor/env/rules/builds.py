"""Rules about the torch build itself: import, CUDA support, duplicates, NumPy ABI."""

from __future__ import annotations

import re
from collections.abc import Iterable

from fpdoctor import catalog
from fpdoctor.env.citations import confidence_text
from fpdoctor.env.fixes import TORCH_CHANGE_COST, data_fix, interpreter, pip
from fpdoctor.env.refdata import INDEX_URL, cuda_variant, refdata, sm_number, version
from fpdoctor.env.rules import Context
from fpdoctor.env.suggest import suggest_build
from fpdoctor.env.understand import SHOWN, shorten
from fpdoctor.report.model import Finding, Severity

_MISSING_LIB = re.compile(r"(?P<lib>lib[\w.+-]+\.so[\w.]*): cannot open shared object file")
_UNDEFINED = re.compile(r"undefined symbol: (?P<sym>\S+)")


def reinstall_command(torch_version: str | None, python: str = "python") -> str:
    """Reinstall exactly this torch, from the index of its CUDA variant when it has one."""
    if not torch_version:
        return pip(python, "install --force-reinstall torch")
    public, _, local = torch_version.partition("+")
    if local.startswith(("cu", "rocm", "cpu")):
        return pip(python, f'install --force-reinstall "torch=={public}" --index-url {INDEX_URL.format(variant=local)}')
    return pip(python, f'install --force-reinstall "torch=={public}"')


def _import_cause(error: str, signal: str | None, torch_version: str | None, python: str) -> tuple[str, str]:
    """A one-line cause and a fix for an import failure the known-issues table does not name."""
    reinstall = reinstall_command(torch_version, python)
    if signal == "SIGILL":
        return (
            "`import torch` died of SIGILL: the CPU lacks an instruction set the wheel was built for "
            "(AVX2 on old or emulated CPUs).",
            "# no command fixes the CPU: run on one with AVX2 (grep -c avx2 /proc/cpuinfo counts them),\n"
            "# or build torch from source on this machine",
        )
    if signal:
        return (f"`import torch` died of {signal}.", reinstall)
    m = _MISSING_LIB.search(error)
    if m:
        lib = m["lib"]
        hint = ""
        if lib.startswith(("libcu", "libnccl", "libnvJitLink", "libcudnn")):
            hint = " A CUDA library that the torch wheel expects from an nvidia-* wheel is missing."
        return (
            f"The shared library {lib} cannot be found.{hint}",
            f"{reinstall}   # reinstalls the nvidia-* wheels torch depends on\n"
            f"# or, if {lib} is on this machine, add its directory to LD_LIBRARY_PATH",
        )
    m = _UNDEFINED.search(error)
    if m:
        return (
            f"A shared library is older than the one torch was linked against (undefined symbol {m['sym']}); "
            "usually a system CUDA directory on LD_LIBRARY_PATH shadows torch's own copy.",
            "unset LD_LIBRARY_PATH  # or remove the system CUDA lib directory from it, then retry",
        )
    if "No module named 'torch._C'" in error or "torch._C" in error:
        return (
            "torch's compiled extension is missing: the current directory may be a PyTorch source tree, "
            "or the wheel is half installed.",
            f"cd ~   # then retry; a PyTorch source tree in the current directory shadows the wheel\n{reinstall}",
        )
    return ("The import error does not match a known cause.", reinstall)


def torch_import_failed(ctx: Context) -> Iterable[Finding]:
    torch = ctx.facts.torch
    if torch.get("import") != "failed" or torch.get("stage") not in (None, "import", "start"):
        return
    error = (torch.get("error") or "").strip()
    known = [
        i
        for i in ("NUMPY2_ABI", "NVJITLINK_SYMBOL_MISMATCH", "CUDNN_RUNTIME_MISMATCH_LD_LIBRARY_PATH")
        if i in ctx.symptoms
    ]
    evidence = {
        "error": error.splitlines()[-1] if error else None,
        "signal": torch.get("signal"),
        "stage": torch.get("stage"),
    }
    python = interpreter(ctx.facts)
    if known:
        issue = ctx.ref.known_issue(known[0])
        cause, fix = issue["title"] + ".", data_fix(issue.get("fix"), python)
        evidence["matched"] = ctx.symptoms[known[0]]
        evidence["known_issue"] = known[0]
        evidence["confidence"] = confidence_text(issue.get("confidence"))
    else:
        installs = ctx.facts.raw.get("torch_installs", {}).get("installs") or []
        cause, fix = _import_cause(
            error + "\n" + (torch.get("traceback") or ""),
            torch.get("signal"),
            installs[0]["version"] if installs else None,
            python,
        )
    yield catalog.make(
        "torch-import-failed",
        message=f"{cause} Error: {evidence['error'] or evidence['signal']}",
        fix=fix,
        evidence=evidence,
    )


def cpu_only_build(ctx: Context) -> Iterable[Finding]:
    facts = ctx.facts
    gpus = facts.gpus
    if facts.cpu_only_build is not True:
        return
    if not gpus:
        yield from _cpu_only_beside_cuda(ctx)
        return
    ccs = [sm_number(g["compute_capability"]) for g in gpus if g.get("compute_capability")]
    suggestion = suggest_build(
        ctx.ref, torch_version=facts.torch_version, capabilities=ccs, driver=facts.driver, windows=facts.windows
    )
    names = sorted({g["name"] for g in gpus})
    capabilities = ", ".join(sorted({str(g.get("compute_capability")) for g in gpus}))
    where = "PyPI's default torch for Windows is CPU-only; " if facts.windows else ""
    python = interpreter(facts)
    if suggestion:
        fix = f"{suggestion.command(python)}\n{TORCH_CHANGE_COST}"
    else:
        fix = (
            f"# no official torch build in fpdoctor's table covers compute capability {capabilities} and runs on "
            f"driver {facts.driver_text}: upgrade the driver first (it comes from the OS or NVIDIA's installer)"
        )
    yield catalog.make(
        "cpu-only-build",
        message=(
            f"torch {facts.torch.get('version')} has no CUDA support, but the machine has "
            f"{len(gpus)} NVIDIA GPU(s): {', '.join(names)}. {where}"
            + (
                f"The suggested build covers compute capability {capabilities}"
                + (f" and runs on driver {facts.driver_text}." if facts.driver else ".")
                if suggestion
                else ""
            )
        ),
        fix=fix,
        evidence={
            "torch": facts.torch.get("version"),
            "gpus": names,
            "driver": facts.driver_text,
            "suggested_index": suggestion.index_url if suggestion else None,
        },
    )


def _cpu_only_beside_cuda(ctx: Context) -> Iterable[Finding]:
    """A CPU-only torch in a report that shows CUDA on the machine (a CUDA runtime, an NVIDIA
    driver) but whose GPU lines are missing: likely the wrong build, but the report cannot show it."""
    facts = ctx.facts
    runtime = (facts.raw.get("cuda_toolkit") or {}).get("version")
    if not facts.offline or not (runtime or facts.driver_text):
        return
    shown = ", ".join(
        ([f"CUDA runtime {runtime}"] if runtime else [])
        + ([f"NVIDIA driver {facts.driver_text}"] if facts.driver_text else [])
    )
    cuda = version(runtime)
    variant = cuda_variant(cuda) if cuda and cuda.major >= 11 else None
    python = interpreter(facts)
    tv = facts.torch_version
    rows = [r for r in refdata().arch_rows if r.variant == variant and r.platform == "linux-x86_64"] if variant else []
    same = [r for r in rows if tv and (r.torch_minor.major, r.torch_minor.minor) == (tv.major, tv.minor)]
    fix = ["nvidia-smi   # first: does this machine have an NVIDIA GPU the report did not list?"]
    index = INDEX_URL.format(variant=variant) if variant else ""
    if same and tv:
        fix += [
            pip(python, f'install --force-reinstall "torch=={tv.base_version}" --index-url {index}'),
            TORCH_CHANGE_COST,
        ]
    elif rows:
        newest = max(rows, key=lambda r: r.torch_minor)
        fix += [
            pip(python, f'install --force-reinstall "torch=={newest.torch_minor}.*" --index-url {index}'),
            TORCH_CHANGE_COST,
        ]
    else:
        fix.append(
            "# then install the CUDA build of torch that the driver runs: https://pytorch.org/get-started/locally/"
        )
    yield catalog.make(
        "cpu-only-build",
        severity=Severity.WARNING,
        title="PyTorch was built without CUDA, on a machine that shows CUDA",
        message=(
            f"torch {facts.torch.get('version')} has no CUDA support, while the report shows {shown}. "
            "The report has no GPU lines (cut short, or collect_env could not list them), so whether this machine "
            "has an NVIDIA GPU is not shown: if it has one, this torch cannot use it."
        ),
        fix="\n".join(fix),
        evidence={"torch": facts.torch.get("version"), "cuda_runtime": runtime, "driver": facts.driver_text},
    )


def duplicate_torch_install(ctx: Context) -> Iterable[Finding]:
    installs = ctx.facts.raw.get("torch_installs", {}).get("installs") or []
    debris = ctx.facts.raw.get("torch_installs", {}).get("debris") or []
    distinct = {(i.get("installer"), i.get("location"), i.get("version")) for i in installs}
    if len(distinct) < 2 and not debris:
        return
    lines = [
        f"torch {shorten(i.get('version'))} ({i.get('installer') or 'unknown installer'}"
        + (f", {shorten(i['location'], 2 * SHOWN)}" if i.get("location") else "")
        + ")"
        for i in installs
    ]
    lines += [f"leftover of an interrupted pip run: {d}" for d in debris]
    python = interpreter(ctx.facts)
    fix = pip(python, "uninstall -y torch") + "   # repeat until pip says it is not installed\n"
    if any(i.get("installer") == "conda" for i in installs):
        fix += "conda remove --force pytorch\n"
    fix += "\n".join(f"rm -rf '{d}'" for d in debris)
    fix += "\n" + reinstall_command(next((i.get("version") for i in installs if i.get("version")), None), python)
    fix += "   # once"
    yield catalog.make(
        "duplicate-torch-install",
        message="More than one PyTorch is visible: " + "; ".join(lines) + ".",
        fix=fix.strip(),
        evidence={"installs": installs, "debris": debris},
    )


def numpy_abi_mismatch(ctx: Context) -> Iterable[Finding]:
    matched = ctx.symptoms.get("NUMPY2_ABI")
    numpy = ctx.facts.torch.get("numpy") or {}
    interop = numpy.get("interop")
    broken = interop not in (None, "ok") and "not installed" not in str(interop)
    if not matched and not broken:
        return
    issue = ctx.ref.known_issue("NUMPY2_ABI")
    numpy_version = numpy.get("version") or (ctx.facts.raw.get("numpy") or {}).get("version")
    yield catalog.make(
        "numpy-abi-mismatch",
        message=(
            "A compiled module was built against NumPy 1.x and runs under NumPy "
            f"{numpy_version or '2.x'}" + (f"; torch.from_numpy fails: {interop}" if broken else "") + "."
        ),
        evidence={
            "numpy": numpy_version,
            "interop": interop,
            "matched": matched,
            "confidence": confidence_text(issue.get("confidence")),
        },
        fix=data_fix(issue["fix"], interpreter(ctx.facts)),
    )
