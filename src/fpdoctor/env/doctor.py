"""`diagnose_env`: collect (live or from a file) -> judge with the rule base -> one Report."""

from __future__ import annotations

from collections.abc import Sequence
from copy import deepcopy
from typing import Any

from fpdoctor.env.facts import Facts
from fpdoctor.env.rules import evaluate
from fpdoctor.env.summary import summary
from fpdoctor.report.model import Report
from fpdoctor.report.redact import redact

# What one GEMM per dtype, run once, cannot show, and where to look instead.
PROBE_LIMITS = (
    "one GEMM per dtype, run once, cannot catch an intermittent or history-dependent fault (a GPU that "
    "fails after hours, when hot, or only in some kernels); next: `fpdoctor health --duration 10` repeats "
    "deterministic GEMM fingerprints and compares them across GPUs (under torchrun, across ranks)"
)


def diagnose_env(
    *,
    from_file: str | Sequence[str] | None = None,
    facts: dict[str, Any] | None = None,
    probe: bool | None = None,
    probe_specs: list[dict[str, Any]] | None = None,
    probe_timeout_s: float = 60.0,
    child: Any = None,
) -> Report:
    """Diagnose this machine, a saved facts dict, or files about one machine (collect_env text,
    facts JSON, logs, nvidia-smi output; "-" reads standard input), joined into one set of facts.

    `probe=None` runs the GEMM probes only when collecting on this machine and torch sees a GPU;
    with `facts` or `from_file`, probes run only for explicit `probe_specs` (the casebook's).
    Raises `fpdoctor.errors.InputError` for a file that cannot be diagnosed.
    """
    here = facts is None and from_file is None  # the facts describe this machine, now
    if facts is not None:
        # The caller's dict stays as it was: probe results, texts and not-checked reasons are
        # added to a copy, so the same facts diagnose the same a second time.
        facts = deepcopy(facts)
    elif from_file is not None:
        from fpdoctor.env.parse import load_all

        facts = load_all([from_file] if isinstance(from_file, str) else list(from_file))
    else:
        from fpdoctor.env.collect import collect_live

        facts = collect_live(child=child)
    view = Facts(facts)
    if probe is None:
        probe = here and bool(view.cuda_available)
    if probe and (here or probe_specs):
        from fpdoctor.env.probe import default_specs, run_probes

        if probe_specs is None:
            device = "cuda" if view.cuda_available else "cpu"
            caps = [str(g["compute_capability"]) for g in view.gpus if g.get("compute_capability")]
            major, _, minor = caps[0].partition(".") if caps else ("", "", "")
            probe_specs = default_specs(device, (int(major), int(minor or 0)) if caps else None)
        facts["probes"] = run_probes(probe_specs, timeout_s=probe_timeout_s)
        for result in facts["probes"]:
            if result.get("status") == "error":
                # An exception is not a crash, but its text ("no kernel image ...") is evidence.
                facts.setdefault("texts", []).append(str(result.get("error")))
                facts.setdefault("not_checked", {})[f"probe {result['name']}"] = f"raised {result.get('error')}"
    elif probe:
        facts.setdefault("not_checked", {})["probes"] = "probes run only on a live machine, not on a file"

    judged = evaluate(view)
    findings = judged.findings
    rows = summary(view)
    if here and view.gpus:
        row, hardware = health_join()
        rows.append(row)
        findings += hardware
    not_checked = {**(facts.get("not_checked") or {}), **judged.not_checked}
    if facts.get("probes"):
        not_checked["intermittent GPU faults"] = PROBE_LIMITS
    for item in facts.get("missing") or []:
        not_checked.setdefault(item, "not shown in the input")
    return Report(
        command="env",
        findings=findings,
        data={"facts": redact(facts), "summary": rows, "not_checked": not_checked},
    )


def health_join() -> tuple[tuple[str, str], list[Any]]:
    """On a machine with NVIDIA GPUs: the GPU-health summary line and its warning/error findings
    (`fpdoctor health` without fingerprints: NVML and the kernel log, no torch, under a second)."""
    try:
        from fpdoctor.health import health

        report = health().report
    except Exception as exc:  # the environment verdict stands on its own
        return ("GPU health", f"not checked: {type(exc).__name__}: {exc}"), []
    status = next((str(v) for k, v in report.data.get("summary", []) if k == "status"), report.verdict)
    found = [f for f in report.findings if f.severity.value in ("error", "warning")]
    return ("GPU health", f"{status} (`fpdoctor health --duration 10` adds GEMM fingerprints)"), found
