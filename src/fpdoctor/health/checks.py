"""The health checks' runner: every declared check, each on its own, one result.

A check is a small pure function of the facts that returns its findings: a machine check reads the
whole machine (the kernel log's Xids, GPUs fallen off the bus), a GPU check one GPU's NVML facts
and runs once per GPU. The checks are declared once, in report order, in
`fpdoctor.health.findings.all_checks`: the machine checks' findings first, then each GPU's.

A check that raises is said in the report's not_checked ("check NAME on GPU ...: failed with ...")
and the other checks' findings still come: a broken check must not hide what the others found,
and a machine whose checks did not all run is never reported healthy (health/report.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fpdoctor.health.model import GpuFacts, HealthFacts
from fpdoctor.report.model import Finding, Judged

MachineCheck = Callable[[HealthFacts], list[Finding]]
GpuCheck = Callable[[HealthFacts, GpuFacts], list[Finding]]


@dataclass(frozen=True)
class Check:
    """One health check; `name` (the catalogue names of the findings it makes) says it in not_checked."""

    name: str
    machine: MachineCheck | None = None
    gpu: GpuCheck | None = None

    def __post_init__(self) -> None:
        if (self.machine is None) == (self.gpu is None):
            raise ValueError(f"check {self.name}: give exactly one of machine= and gpu=")


def at_most_one(check: Callable[[HealthFacts, GpuFacts], Finding | None]) -> GpuCheck:
    """A GPU check that makes one finding or none, as a check that returns a list."""

    def listed(facts: HealthFacts, gpu: GpuFacts) -> list[Finding]:
        found = check(facts, gpu)
        return [] if found is None else [found]

    return listed


def run_checks(facts: HealthFacts, checks: list[Check]) -> Judged:
    """Run every check on `facts` (which no check changes); a failing one is recorded and skipped."""
    found: list[Finding] = []
    not_checked: dict[str, str] = {}

    def attempt(label: str, check: Callable[..., list[Finding]], *args: object) -> None:
        try:
            found.extend(check(*args))
        except Exception as exc:  # a broken check must not hide what the other checks found
            not_checked[label] = f"failed with {type(exc).__name__}: {exc}; please report this to fpdoctor"

    for check in checks:
        if check.machine is not None:
            attempt(f"check {check.name}", check.machine, facts)
    for gpu in facts.gpus:
        for check in checks:
            if check.gpu is not None:
                attempt(f"check {check.name} on {gpu.label()}", check.gpu, facts, gpu)
    return Judged(findings=found, not_checked=not_checked)
