"""`fpdoctor health` / `fpdoctor.health()`: one-shot GPU health, no daemon, no CUDA in the caller.

Per GPU the NVML facts (ECC mode and counts, retired pages, remapped rows, clock-event reasons,
temperature, power, PCIe replays, recovery action), the kernel log's NVIDIA lines (Xids explained
with NVIDIA's catalogue, GPUs fallen off the bus), and, when asked for, GEMM fingerprints compared
across repeats, references and GPUs (`fpdoctor.health.fingerprint`, run in child processes).
What could not be read says why and is never reported as healthy (`report.data["status"]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fpdoctor.errors import InputError
from fpdoctor.health.model import GpuFacts, HealthFacts
from fpdoctor.report.model import Report


@dataclass
class HealthResult:
    """What `health()` returns: the report, the facts it was judged from, the fingerprints if run."""

    report: Report
    facts: HealthFacts
    fingerprints: Any = None  # fpdoctor.health.fingerprint.FingerprintResult when fingerprints ran
    reporting: bool = True  # False on torchrun ranks other than 0: rank 0 reports for all

    @property
    def gpus(self) -> list[GpuFacts]:
        return self.facts.gpus

    @property
    def exit_code(self) -> int:
        """What `fpdoctor health` exits with, a scheduler's drain/undrain gate: 1 an error-level
        finding, 0 every source read and no error, 2 no verdict (something NOT CHECKED or INCOMPLETE,
        nothing read an error). `report.exit_code` is 0/1 by findings alone, as for every command.
        Under torchrun with fingerprints every rank has the same report, so the same exit status."""
        from fpdoctor.health.report import exit_code

        return exit_code(self.report)


def health(
    *,
    duration: float = 0.0,
    from_files: str | Sequence[str] | None = None,
    device: str | None = None,
    nvml: Any = None,
) -> HealthResult:
    """Check this machine's GPUs (or saved files with `from_files`: kernel logs, `nvidia-smi -q`
    output, health JSON).

    duration: seconds of GEMM fingerprints per GPU; 0 (the default here, 3 on the command line)
    reads facts only, in well under a second, without importing torch. Fingerprints run first, in
    child processes, so Xids or ECC errors they provoke are in the facts read after them.
    device: where fingerprints run: 'cuda' or None every GPU of this node (under torchrun, this
    rank's GPU), 'cuda:N' that GPU, 'cpu' the CPU (on a machine without an NVIDIA driver the CPU's
    fingerprints are then the whole verdict: there is no GPU whose facts could be missing).
    nvml: a replacement for the pynvml module (tests).
    Raises InputError for unusable files and ValueError for a bad duration or device
    (fingerprint.DeviceNotFound for a cuda:N this machine lacks).
    """
    from fpdoctor.health.fingerprint import check_device, check_duration

    duration = check_duration(duration)
    device = None if device is None else check_device(device)
    from fpdoctor.health.collect import collect_files, collect_live
    from fpdoctor.health.findings import judge
    from fpdoctor.health.report import build

    paths = [from_files] if isinstance(from_files, str) else list(from_files or [])
    if paths and duration > 0:
        raise ValueError("fingerprints run on this machine; they cannot be combined with saved files (from_files)")
    from fpdoctor.health.ranks import dist_env

    dist = dist_env()

    def read_facts() -> HealthFacts:
        return collect_files(paths) if paths else collect_live(nvml_module=nvml)

    fingerprints = None
    facts = None
    if duration > 0:
        from fpdoctor.health.fingerprint import FingerprintResult, run_fingerprints

        no_gpu = _no_gpu(nvml) if device in (None, "cuda") and dist is None else None
        if no_gpu:  # nothing to fingerprint: spare the import of torch (most of a second or more)
            fingerprints = FingerprintResult(
                notes=[f"{no_gpu}: fingerprints not run; --device cpu runs them on the CPU"]
            )
        else:
            # The facts are read once every rank's fingerprints are done, so the Xids and ECC errors
            # their load provoked are in them. Under torchrun every rank then judges rank 0's facts
            # with every rank's fingerprints: one merged report, the same verdict and exit status on
            # every rank (a rank that exits otherwise makes torchrun stop the others and fail the job).
            fingerprints = run_fingerprints(duration, device=device, share=read_facts)
            facts = fingerprints.shared[0]
    if facts is None:
        facts = read_facts()
    judged = judge(facts)
    report = build(facts, judged.findings, fingerprints=fingerprints, failed=judged.not_checked, device=device)
    # without fingerprints nothing is gathered across ranks: one report per node, from local rank 0
    reporting = fingerprints.reporting if fingerprints is not None else dist is None or dist.local_rank == 0
    return HealthResult(report=report, facts=facts, fingerprints=fingerprints, reporting=reporting)


def _no_gpu(nvml_module: Any) -> str | None:
    """Why there is no GPU on this machine (no NVIDIA driver, NVML sees none), or None."""
    from fpdoctor.health import nvml

    try:
        gpus, _ = nvml.collect(nvml=nvml_module)
    except nvml.NvmlUnavailable as exc:
        if exc.unusable:
            return f"no GPU can be used ({exc})"
        return "no NVIDIA driver on this machine" if exc.no_driver else None
    return None if gpus else "NVML sees no NVIDIA GPU"


__all__ = ["GpuFacts", "HealthFacts", "HealthResult", "InputError", "health"]
