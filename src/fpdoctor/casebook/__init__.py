"""The casebook behind `fpdoctor demo`: each incident fpdoctor exists for, reproduced on a CPU and diagnosed.

A case declares which findings its diagnosis must contain, so the demo checks itself: a case
whose report lacks them did not reproduce, and `fpdoctor demo` exits 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fpdoctor.report.model import Report


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    incident: int  # the incident's number, as `fpdoctor demo` lists them
    title: str
    story: str
    expect: frozenset[str]  # finding names the diagnosis must contain
    run: Callable[[], Report]


@dataclass(frozen=True)
class Outcome:
    report: Report
    found: frozenset[str]

    def reproduces(self, case: Case) -> bool:
        return case.expect <= self.found


def _cases() -> tuple[Case, ...]:
    from fpdoctor.casebook import attention, crash, faulty_gpu, fp8, h20, unet

    return (
        h20.SIGFPE,
        h20.SHADOWED,
        crash.SIGFPE_RUN,
        attention.NAN_FRAMES,
        unet.TIME_EMBED,
        fp8.FP8_OUTLIERS,
        faulty_gpu.FAULTY_GPU,
    )


CASES: tuple[Case, ...] = _cases()


def run_case(case: Case) -> Outcome:
    report = case.run()
    return Outcome(report, frozenset(f.name for f in report.findings))
