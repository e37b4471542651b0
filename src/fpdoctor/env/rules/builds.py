"""Rules about the torch build itself: import, CUDA support, duplicates, NumPy ABI."""

from __future__ import annotations

import re
from collections.abc import Iterable

from fpdoctor import catalog
from fpdoctor.env.refdata import INDEX_URL, sm_number
from fpdoctor.env.rules import Context
from fpdoctor.env.suggest import suggest_build
from fpdoctor.report.model import Finding

_MISSING_LIB = re.compile(r"(?P<lib>lib[\w.+-]+\.so[\w.]*): cannot open shared object file")
_UNDEFINED = re.compile(r"undefined symbol: (?P<sym>\S+)")


def reinstall_command(version: str | None) -> str:
    """Reinstall exactly this torch, from the index of its CUDA variant when it has one."""
    if not version:
        return "python -m pip install --force-reinstall torch"
    public, _, local = version.partition("+")
    if local.startswith(("cu", "rocm", "cpu")):
        return (
            f'python -m pip install --force-reinstall "torch=={public}" --index-url {INDEX_URL.format(variant=local)}'
        )
    return f'python -m pip install --force-reinstall "torch=={public}"'


def _import_cause(error: str, signal: str | None, version: str | None) -> tuple[str, str]:
    """A one-line cause and a fix for an import failure the known-issues table does not name."""
    reinstall = reinstall_command(version)
    if signal == "SIGILL":
        return (
            "`import torch` died of SIGILL: the CPU lacks an instruction set the wheel was built for "
            "(AVX2 on old or emulated CPUs).",
            "Run on a CPU with AVX2, or install a build for this CPU.",
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
            f"{reinstall}  # reinstalls the nvidia-* wheels torch depends on\n"
            "# or add the directory holding it to LD_LIBRARY_PATH",
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
            f"cd elsewhere and retry; otherwise {reinstall}",
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
    if known:
        issue = ctx.ref.known_issue(known[0])
        cause, fix = issue["title"], "\n".join(issue.get("fix") or [])
        evidence["matched"] = ctx.symptoms[known[0]]
        evidence["known_issue"] = known[0]
    else:
        installs = ctx.facts.raw.get("torch_installs", {}).get("installs") or []
        cause, fix = _import_cause(
            error + "\n" + (torch.get("traceback") or ""),
            torch.get("signal"),
            installs[0]["version"] if installs else None,
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
    if not gpus or facts.cpu_only_build is not True:
        return
    ccs = [sm_number(g["compute_capability"]) for g in gpus if g.get("compute_capability")]
    suggestion = suggest_build(
        ctx.ref, torch_version=facts.torch_version, capabilities=ccs, driver=facts.driver, windows=facts.windows
    )
    names = sorted({g["name"] for g in gpus})
    capabilities = ", ".join(sorted({str(g.get("compute_capability")) for g in gpus}))
    where = "PyPI's default torch for Windows is CPU-only; " if facts.windows else ""
    fix = suggestion.command if suggestion else catalog.get("cpu-only-build").fix
    yield catalog.make(
        "cpu-only-build",
        message=(
            f"torch {facts.torch.get('version')} has no CUDA support, but the machine has "
            f"{len(gpus)} NVIDIA GPU(s): {', '.join(names)}. {where}"
            f"The suggested build covers compute capability {capabilities}"
            + (f" and runs on driver {facts.driver_text}." if facts.driver else ".")
        ),
        fix=fix,
        evidence={
            "torch": facts.torch.get("version"),
            "gpus": names,
            "driver": facts.driver_text,
            "suggested_index": suggestion.index_url if suggestion else None,
        },
    )


def duplicate_torch_install(ctx: Context) -> Iterable[Finding]:
    installs = ctx.facts.raw.get("torch_installs", {}).get("installs") or []
    debris = ctx.facts.raw.get("torch_installs", {}).get("debris") or []
    distinct = {(i.get("installer"), i.get("location"), i.get("version")) for i in installs}
    if len(distinct) < 2 and not debris:
        return
    lines = [
        f"torch {i.get('version')} ({i.get('installer') or 'unknown installer'}"
        + (f", {i['location']}" if i.get("location") else "")
        + ")"
        for i in installs
    ]
    lines += [f"leftover of an interrupted pip run: {d}" for d in debris]
    fix = "python -m pip uninstall -y torch   # repeat until pip says it is not installed\n"
    if any(i.get("installer") == "conda" for i in installs):
        fix += "conda remove --force pytorch\n"
    fix += "\n".join(f"rm -rf '{d}'" for d in debris)
    fix += "\npython -m pip install torch   # once, with the index URL of the CUDA variant you need"
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
    version = numpy.get("version") or (ctx.facts.raw.get("numpy") or {}).get("version")
    yield catalog.make(
        "numpy-abi-mismatch",
        message=(
            "A compiled module was built against NumPy 1.x and runs under NumPy "
            f"{version or '2.x'}" + (f"; torch.from_numpy fails: {interop}" if broken else "") + "."
        ),
        evidence={"numpy": version, "interop": interop, "matched": matched, "confidence": issue.get("confidence")},
        fix="\n".join(issue["fix"]),
    )
