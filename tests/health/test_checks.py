"""The health checks run one by one: a check that raises is said under "Not checked" and the other
checks' findings still come, and a machine whose checks did not all run is never called healthy."""

from __future__ import annotations

import copy

import pytest

import fpdoctor
from fpdoctor.health import findings as health_findings
from fpdoctor.health.checks import Check, run_checks
from fpdoctor.health.collect import collect_live
from fpdoctor.health.report import build
from tests.conftest import FIXTURES
from tests.health.fake_nvml import FakeNVML, device

RULES = FIXTURES / "health" / "rules"
CLEAN_DMESG = [
    "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
    "[    5.301122] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04  Release Build",
]
XID48 = (
    "[ 8812.100001] NVRM: Xid (PCI:0000:53:00): 48, pid=4242, name=pt_main_thread, An uncorrectable double "
    "bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0."
)
BROKEN = "failed with RuntimeError: boom; please report this to fpdoctor"


def _boom(*_args):
    raise RuntimeError("boom")


def _two_gpus():
    """GPU 0 throttled, GPU 1 with uncorrectable ECC errors and an Xid 48 in the kernel log."""
    bad = device(
        bus_id="00000000:53:00.0",
        uuid="GPU-509665ad-0000-4000-8000-000000000002",
        ecc={
            ("uncorrected", "volatile"): 1,
            ("uncorrected", "aggregate"): 1,
            ("corrected", "volatile"): 0,
            ("corrected", "aggregate"): 0,
        },
    )
    fake = FakeNVML([device(clock_reasons=0x40), bad])  # 0x40: hardware thermal slowdown
    return collect_live(nvml_module=fake, readers=(("dmesg", lambda: [*CLEAN_DMESG, XID48]),), host="node-1")


def _names(found):
    return [(f.name, f.where.get("index")) for f in found]


def test_every_check_is_declared_once_and_checks_are_well_formed():
    checks = health_findings.all_checks()
    assert len({c.name for c in checks}) == len(checks)
    with pytest.raises(ValueError, match="exactly one"):
        Check("both", machine=lambda facts: [], gpu=lambda facts, gpu: [])


def test_the_runner_gives_what_the_checks_gave_in_report_order():
    facts = _two_gpus()
    before = copy.deepcopy(facts.to_dict())
    judged = health_findings.judge(facts)
    assert facts.to_dict() == before  # checks read the facts, never write them
    assert judged.not_checked == {}
    assert _names(judged.findings) == [("xid-error", 1), ("gpu-throttled", 0), ("ecc-uncorrectable", 1)]


def test_a_raising_check_is_said_and_the_others_still_come(monkeypatch):
    facts = _two_gpus()
    expected = _names(health_findings.findings(facts))
    real = health_findings.all_checks()
    planted = [Check("planted", machine=_boom), *real, Check("planted-per-gpu", gpu=_boom)]
    monkeypatch.setattr(health_findings, "all_checks", lambda: planted)
    judged = health_findings.judge(facts)
    assert _names(judged.findings) == expected
    labels = [gpu.label() for gpu in facts.gpus]
    assert judged.not_checked == {
        "check planted": BROKEN,
        f"check planted-per-gpu on {labels[0]}": BROKEN,
        f"check planted-per-gpu on {labels[1]}": BROKEN,
    }


def test_a_check_failing_on_one_gpu_keeps_its_findings_on_the_others(monkeypatch):
    facts = _two_gpus()
    ecc = health_findings._ecc_finding

    def ecc_but_not_on_gpu_1(facts, gpu):
        if gpu.index == 1:
            raise KeyError("ecc")
        return ecc(facts, gpu)

    monkeypatch.setattr(health_findings, "_ecc_finding", ecc_but_not_on_gpu_1)
    judged = health_findings.judge(facts)
    assert _names(judged.findings) == [("xid-error", 1), ("gpu-throttled", 0)]
    assert list(judged.not_checked) == [f"check ecc-uncorrectable on {facts.gpus[1].label()}"]
    assert judged.not_checked[f"check ecc-uncorrectable on {facts.gpus[1].label()}"].startswith("failed with KeyError")


def test_the_report_says_the_failed_check_and_keeps_the_other_findings(monkeypatch):
    """Through `fpdoctor.health()`: the ECC check raising on a saved nvidia-smi file no longer ends
    the report; its throttling finding comes, and the text says what was not checked."""
    monkeypatch.setattr(health_findings, "_ecc_finding", _boom)
    report = fpdoctor.health(from_files=[str(RULES / "HWR006-gpu-throttled.txt")]).report
    assert [f.name for f in report.findings] == ["gpu-throttled"]
    ((key, why),) = [(k, v) for k, v in report.data["not_checked"].items() if k.startswith("check ")]
    assert key.startswith("check ecc-uncorrectable on GPU") and why == BROKEN
    assert "NOT CHECKED" in report.data["summary"][0][1] and "check ecc-uncorrectable" in report.data["summary"][0][1]
    text = str(report)
    assert "Not checked" in text and f"{key}: {BROKEN}" in text


def test_a_clean_machine_with_a_failed_check_is_incomplete_not_healthy():
    facts = collect_live(nvml_module=FakeNVML([device()]), readers=(("dmesg", lambda: CLEAN_DMESG),), host="node-1")
    judged = run_checks(facts, [*health_findings.all_checks(), Check("planted", machine=_boom)])
    report = build(facts, judged.findings, failed=judged.not_checked)
    assert report.verdict == "warning" and report.data["status"] == "incomplete"  # never a plain ok
    assert report.data["summary"][0][1].startswith("INCOMPLETE: no problem in what was checked, but check planted")
    assert report.data["not_checked"] == {"check planted": BROKEN}
    assert build(facts, judged.findings).data["status"] == "healthy"  # the same facts, every check run
