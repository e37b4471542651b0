"""Facts -> findings: the severity rules, each with the case that must and must not escalate."""

from __future__ import annotations

import json

import pytest

from fpdoctor.health import collect, xid
from fpdoctor.health.findings import findings
from fpdoctor.health.model import GpuFacts, HealthFacts
from fpdoctor.report.model import Severity


def from_log(*lines: str, driver: str | None = None) -> HealthFacts:
    facts = HealthFacts(driver=driver)
    collect.add_kernel_log(facts, list(lines), "test.log", strict=True)
    return facts


def by_xid(facts: HealthFacts) -> dict[int, tuple[str, str]]:
    return {f.evidence["xid"]: (f.name, f.severity.value) for f in findings(facts) if "xid" in f.evidence}


XID13 = "[ 100.0] NVRM: Xid (PCI:0000:38:00): 13, pid=11, name=pt_main_thread, Graphics SM Warp Exception"


def test_application_xid_alone_is_a_warning():
    (f,) = findings(from_log(XID13, XID13.replace("100.0", "100.1")))
    assert (f.name, f.severity, f.evidence["xid"], f.evidence["count"]) == ("xid-error", Severity.WARNING, 13, 2)
    assert f.evidence["processes"] == ["pt_main_thread"] and f.evidence["pids"] == [11]
    assert "pt_main_thread (pid 11)" in f.message and "Usually the program's own fault" in f.message
    assert f.where == {"pci": "0000:38:00.0"}


@pytest.mark.parametrize("companion", sorted(xid.HARDWARE_COMPANIONS - {79}))
def test_application_xid_next_to_a_memory_xid_is_an_error(companion):
    other = f"[ 101.0] NVRM: Xid (PCI:0000:38:00): {companion}, pid=11, x"
    found = by_xid(from_log(XID13, other))
    assert found[13] == ("xid-error", "error")


def test_companion_on_another_gpu_or_in_another_boot_does_not_escalate():
    other_gpu = "[ 101.0] NVRM: Xid (PCI:0000:39:00): 48, pid=11, x"
    assert by_xid(from_log(XID13, other_gpu))[13] == ("xid-error", "warning")
    reboot = "[    0.000000] Linux version 6.8.0"
    earlier_boot = "[ 50.0] NVRM: Xid (PCI:0000:38:00): 94, pid=11, x"
    assert by_xid(from_log(earlier_boot, reboot, XID13))[13] == ("xid-error", "warning")


def test_xid79_companion_makes_gpu_lost_and_escalates():
    facts = from_log(XID13, "[ 102.0] NVRM: Xid (PCI:0000:38:00): 79, pid=11, GPU has fallen off the bus.")
    names = sorted((f.name, f.severity.value, f.evidence.get("xid")) for f in findings(facts))
    assert names == [("gpu-lost", "error", 79), ("xid-error", "error", 13)]


def test_application_xid_from_several_programs_is_an_error():
    other = XID13.replace("pid=11, name=pt_main_thread", "pid=12, name=other_app")
    (f,) = findings(from_log(XID13, other))
    assert f.severity is Severity.ERROR and "several programs" in f.message


def test_the_same_program_again_does_not_escalate():
    again = XID13.replace("pid=11", "pid=99")  # rerun of the same script: another pid, same name
    (f,) = findings(from_log(XID13, again))
    assert f.severity is Severity.WARNING and f.evidence["pids"] == [11, 99]


def _xid13(at: float, pid: str = "11", name: str = "pt_main_thread") -> str:
    return f"[ {at:.6f}] NVRM: Xid (PCI:0000:38:00): 13, pid={pid}, name={name}, Graphics SM Warp Exception"


def test_one_fault_logging_a_hundred_lines_is_one_occurrence_and_a_warning():
    (f,) = findings(from_log(*(_xid13(100 + i / 1000) for i in range(100))))
    assert f.severity is Severity.WARNING and f.evidence["count"] == 100


def test_the_same_process_at_three_separate_times_is_repeated():
    burst = [_xid13(t + i / 100) for t in (100.0, 400.0, 3700.0) for i in range(30)]
    (f,) = findings(from_log(*burst))
    assert f.severity is Severity.ERROR and f.evidence["pids"] == [11]
    assert "it came 3 separate times on this GPU (more than a minute apart)" in f.message
    (f,) = findings(from_log(*burst[:60]))  # twice: a rerun, still a warning
    assert f.severity is Severity.WARNING


def test_lines_without_pid_or_name_escalate_by_time():
    unknown = [_xid13(t, pid="'<unknown>'", name="<unknown>") for t in (100.0, 200.0, 300.0)]
    (f,) = findings(from_log(*unknown))
    assert f.evidence["pids"] is None and f.evidence["processes"] is None
    assert f.severity is Severity.ERROR and "3 separate times" in f.message
    (f,) = findings(from_log(*unknown[:2]))
    assert f.severity is Severity.WARNING


def test_three_processes_of_one_program_are_repeated():
    (f,) = findings(from_log(*(_xid13(100 + i, pid=str(pid)) for i, pid in enumerate((11, 12, 13)))))
    assert f.severity is Severity.ERROR and "3 processes hit it on this GPU (pid 11, 12, 13)" in f.message


def test_other_gpus_do_not_count_toward_repetition():
    lines = [_xid13(100.0), _xid13(200.0, pid="12"), _xid13(300.0, pid="13").replace("0000:38:00", "0000:39:00")]
    assert {f.where["pci"]: f.severity.value for f in findings(from_log(*lines))} == {
        "0000:38:00.0": "warning",
        "0000:39:00.0": "warning",
    }


def test_a_facts_file_from_before_episodes_counts_boots():
    group = {"pci": "0000:38:00.0", "xid": 13, "count": 3, "pids": [11]}
    facts = HealthFacts.from_dict({"gpus": [], "xids": [{**group, "boots": [0, 1, 2]}]})
    assert findings(facts)[0].severity is Severity.ERROR
    facts = HealthFacts.from_dict({"gpus": [], "xids": [{**group, "boots": [0]}]})
    assert findings(facts)[0].severity is Severity.WARNING


@pytest.mark.parametrize(
    ("code", "severity"),
    [
        (48, "error"),
        (64, "error"),
        (94, "error"),
        (95, "error"),
        (119, "error"),
        (63, "warning"),
        (92, "warning"),
        (44, "info"),
        (45, "warning"),
        (999, "warning"),
        (1, "warning"),
    ],
)
def test_severity_from_the_catalogue(code, severity):
    found = by_xid(from_log(f"NVRM: Xid (PCI:0000:01:00): {code}, pid=1, x"))
    assert found[code] == ("xid-error", severity)


def test_unknown_xid_says_it_is_not_in_the_catalogue():
    (f,) = findings(from_log("NVRM: Xid (PCI:0000:01:00): 999, pid=1234, name=test"))
    assert "Not in NVIDIA's Xid catalogue" in f.message and f.evidence["category"] == "unknown"


def test_xid154_changed_to_none_is_a_note_otherwise_an_error_as_the_recovery_action_of_nvml_is():
    # NVSentinel csv_test.go
    up = "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
    down = "NVRM: Xid (PCI:0008:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)"
    (f,) = findings(from_log(up))
    assert f.severity is Severity.ERROR and "0x1 (GPU Reset Required)" in f.message
    (f,) = findings(from_log(down))
    assert f.severity is Severity.INFO


NVL5_FATAL = (
    "NVRM: Xid (PCI:0018:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 "
    "0x00000000 0x00000000 0x00000000 0x00000000)"
)
NVL5_BER = (
    "NVRM: Xid (PCI:0018:01:00): 149, NETIR_BER_EVENT Nonfatal XC0 i0 Link 03 (0x00086226 0x00000001 "
    "0x00000000 0x00000000 0x00000000 0x00000000)"
)


def test_nvlink5_severity_comes_from_the_decode():
    (f,) = findings(from_log(NVL5_FATAL, driver="570.148.08"))
    assert f.severity is Severity.ERROR and "NETIR_LINK_EVT/NETIR_LINK_DOWN" in f.message
    assert f.evidence["nvlink"][0]["decode"]["action"] == "RESET_GPU"
    assert f.evidence["nvlink"][0]["sub_code"] == 37 and f.evidence["nvlink"][0]["intrinfo"] == "0x025525c6"
    (f,) = findings(from_log(NVL5_BER, driver="570.148.08"))
    assert f.severity is Severity.WARNING  # Non-fatal, investigate link signal integrity


def test_nvlink5_without_a_decode_takes_the_lines_own_severity():
    line = NVL5_FATAL.replace("0x025525c6", "0xffffffff")
    (f,) = findings(from_log(line, driver="580.105.08"))
    assert f.severity is Severity.ERROR and "not decoded" in f.message and "no row" in f.message


def gpu(**facts) -> GpuFacts:
    return GpuFacts(index=3, pci="0000:52:00.0", name="NVIDIA H100 80GB HBM3", uuid="GPU-x", host="h", facts=facts)


def test_ecc_volatile_is_an_error_aggregate_only_a_warning():
    (f,) = findings(HealthFacts(gpus=[gpu(ecc={"volatile": {"uncorrected": 2}, "aggregate": {"uncorrected": 2}})]))
    assert (f.name, f.severity) == ("ecc-uncorrectable", Severity.ERROR)
    assert f.where == {"pci": "0000:52:00.0", "host": "h", "index": 3, "uuid": "GPU-x"}
    assert "nvidia-smi -r -i 0000:52:00.0" in f.fix
    (f,) = findings(HealthFacts(gpus=[gpu(ecc={"volatile": {"uncorrected": 0}, "aggregate": {"uncorrected": 4}})]))
    assert f.severity is Severity.WARNING
    assert findings(HealthFacts(gpus=[gpu(ecc={"volatile": {"uncorrected": 0, "corrected": 9}})])) == []


def test_remap_pending_severity_follows_the_error_kind_and_failure_is_an_error():
    (f,) = findings(HealthFacts(gpus=[gpu(remapped_rows={"correctable": 1, "uncorrectable": 0, "pending": True})]))
    assert (f.name, f.severity) == ("row-remap-pending", Severity.WARNING)
    (f,) = findings(HealthFacts(gpus=[gpu(remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True})]))
    assert f.severity is Severity.ERROR
    (f,) = findings(HealthFacts(gpus=[gpu(remapped_rows={"uncorrectable": 8, "pending": False, "failure": True})]))
    assert (f.name, f.severity) == ("row-remap-failure", Severity.ERROR)
    (f,) = findings(HealthFacts(gpus=[gpu(retired_pages={"double_bit": 1, "pending": True})]))
    assert (f.name, f.severity) == ("row-remap-pending", Severity.ERROR) and "page retirement" in f.message


def test_throttling_only_for_slowdowns():
    assert findings(HealthFacts(gpus=[gpu(clock_event_reasons=["sw_power_cap", "gpu_idle"])])) == []
    (f,) = findings(
        HealthFacts(
            gpus=[
                gpu(
                    clock_event_reasons=["hw_power_brake_slowdown"],
                    temperature_c=88,
                    power_w=650.0,
                    power_limit_w=700.0,
                )
            ]
        )
    )
    assert (f.name, f.severity) == ("gpu-throttled", Severity.WARNING)
    assert "hw power brake slowdown (88 C, 650.0 W of 700.0 W)" in f.message


def test_recovery_action():
    assert findings(HealthFacts(gpus=[gpu(recovery_action="none")])) == []
    (f,) = findings(HealthFacts(gpus=[gpu(recovery_action="node_reboot")]))
    assert (f.name, f.severity, f.evidence) == (
        "gpu-recovery-required",
        Severity.ERROR,
        {"recovery_action": "node_reboot"},
    )


def test_nvml_lost_gpu():
    lost = GpuFacts(index=5, host="h", lost="NVML: GPU is lost")
    (f,) = findings(HealthFacts(gpus=[lost]))
    assert f.name == "gpu-lost" and f.where == {"host": "h", "index": 5} and "NVML: GPU is lost" in f.message


def test_the_kernel_map_names_the_gpu_of_an_xid():
    facts = from_log(
        "NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-1234-5678-9abc-def012345678",
        "NVRM: GPU Board Serial Number: 1652221012345",
        "NVRM: Xid (PCI:0000:9b:00): 48, pid=77, name=python, An uncorrectable double bit error",
    )
    (f,) = findings(facts)
    assert f.where == {"pci": "0000:9b:00.0", "uuid": "GPU-509665ad-1234-5678-9abc-def012345678"}
    assert facts.gpus[0].serial == "1652221012345"


def test_facts_round_trip_through_json():
    facts = from_log(
        XID13,
        NVL5_FATAL,
        "NVRM: The NVIDIA GPU 0000:b3:00.0 installed in this system has fallen off the "
        "bus and is not responding to commands.",
        driver="570.148.08",
    )
    facts.gpus.append(gpu(ecc={"volatile": {"uncorrected": 1}}, remapped_rows={"uncorrectable": 1, "pending": True}))
    again = HealthFacts.from_dict(json.loads(json.dumps(facts.to_dict())))
    assert [f.to_dict() for f in findings(again)] == [f.to_dict() for f in findings(facts)]
