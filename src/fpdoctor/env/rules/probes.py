"""probe-crashed / probe-wrong-result / probe-timed-out, joined with the rule that explains them."""

from __future__ import annotations

from collections.abc import Iterable

from fpdoctor import catalog
from fpdoctor.env.rules import Context
from fpdoctor.report.model import Finding

CRASH_SIGNALS = {"SIGFPE", "SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL"}


def _explained_by(ctx: Context, signal: str | None) -> str:
    if signal == "SIGFPE":
        for f in ctx.findings:
            if f.name == "cublas-h20-sigfpe":
                return f" {f.code} {f.name} explains it: {f.title[0].lower()}{f.title[1:]}."
    related = [f for f in ctx.findings if f.name in ("library-shadowed", "arch-not-in-build", "driver-too-old")]
    if related:
        return f" See also {related[0].code} {related[0].name}."
    return ""


def probe_results(ctx: Context) -> Iterable[Finding]:
    torch = ctx.facts.torch
    signal = torch.get("signal")
    if signal and torch.get("stage") in ("force-load", "cuda-init"):
        what = (
            "the 64×64 fp32 GEMM that makes torch load cuBLAS"
            if torch["stage"] == "force-load"
            else "CUDA initialisation"
        )
        yield catalog.make(
            "probe-crashed",
            message=f"The environment check's child died of {signal} during {what}.{_explained_by(ctx, signal)}",
            evidence={"signal": signal, "stage": torch["stage"], "stderr_tail": (torch.get("stderr") or "")[-500:]},
            fix=_fix(ctx, signal),
        )
    for probe in ctx.facts.probes:
        status = probe.get("status")
        label = f"{probe.get('dtype')} GEMM {probe.get('shape')}"
        evidence = {
            k: probe.get(k)
            for k in ("dtype", "shape", "device", "signal", "returncode", "seconds", "max_abs_err", "tolerance")
            if probe.get(k) is not None
        }
        where = {"probe": probe.get("name"), "dtype": probe.get("dtype")}
        if status == "crashed":
            sig = probe.get("signal")
            yield catalog.make(
                "probe-crashed",
                message=f"The {label} probe died of {sig or 'a crash'} in its child process.{_explained_by(ctx, sig)}",
                where=where,
                evidence=evidence,
                fix=_fix(ctx, sig),
            )
        elif status == "wrong":
            yield catalog.make(
                "probe-wrong-result",
                message=(
                    f"The {label} probe differs from the float64 reference by {probe.get('max_abs_err'):.3g} "
                    f"(tolerance {probe.get('tolerance'):.3g})."
                ),
                where=where,
                evidence=evidence,
                fix=_WRONG_FIX,
            )
        elif status == "timeout":
            yield catalog.make(
                "probe-timed-out",
                message=f"The {label} probe did not finish within {probe.get('seconds')} s and was killed.",
                where=where,
                evidence=evidence,
                fix=_TIMEOUT_FIX,
            )


def _fix(ctx: Context, signal: str | None) -> str:
    for f in ctx.findings:
        if (signal == "SIGFPE" and f.name == "cublas-h20-sigfpe") or f.name == "library-shadowed":
            return f.fix
    return (
        "# no known cause matches this crash, so there is no fix to run; report it upstream with this report:\n"
        "fpdoctor env --probe --format markdown -o fpdoctor-env.md   # attach fpdoctor-env.md to the issue"
    )


_WRONG_FIX = (
    "fpdoctor env --probe   # run the probes again: a result that is wrong once and right now points at the GPU\n"
    "fpdoctor health --duration 10   # GEMM fingerprints repeated and compared across GPUs"
)
_TIMEOUT_FIX = (
    "nvidia-smi   # a wedged GPU shows high utilisation with no process, or ERR!\n"
    "sudo dmesg | grep -i xid   # Xid errors in the kernel log explain most wedged GPUs"
)
