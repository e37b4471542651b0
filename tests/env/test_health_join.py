"""`fpdoctor env` on a machine with NVIDIA GPUs shows their health (facts only, no fingerprints)."""

from __future__ import annotations

import importlib

from fpdoctor.env import doctor
from fpdoctor.health import HealthResult
from fpdoctor.health.model import HealthFacts
from fpdoctor.report.model import Report, Severity


def _health(findings):
    def fake(**_kwargs):
        report = Report(command="health", findings=findings, data={"summary": [["status", "problems found on 1 GPU"]]})
        return HealthResult(report=report, facts=HealthFacts())

    return fake


def test_the_summary_line_and_the_hardware_findings_join_the_environment_report(monkeypatch):
    from fpdoctor import catalog

    health = importlib.import_module("fpdoctor.health")  # the package; `fpdoctor.health` is the function
    xid = catalog.make("xid-error", message="Xid 79 on 0000:52:00.0", where={"pci": "0000:52:00.0"})
    note = catalog.make("gpu-throttled", message="power cap while idle", severity=Severity.INFO)
    monkeypatch.setattr(health, "health", _health([xid, note]))
    row, found = doctor.health_join()
    assert row[0] == "GPU health" and row[1].startswith("problems found on 1 GPU")
    assert [f.name for f in found] == ["xid-error"]  # info-level health notes stay in `fpdoctor health`


def test_a_health_read_that_fails_is_said_not_raised(monkeypatch):
    health = importlib.import_module("fpdoctor.health")

    def broken(**_kwargs):
        raise OSError("NVML hung")

    monkeypatch.setattr(health, "health", broken)
    row, found = doctor.health_join()
    assert row == ("GPU health", "not checked: OSError: NVML hung") and found == []
