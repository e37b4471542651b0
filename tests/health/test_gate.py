"""`fpdoctor health` as a scheduler's drain/undrain gate: exit 0 only for a node whose every source
was read and shows no error, 1 for an error, 2 for no verdict; and the verdicts a gate acts on are
those of the GPU now (earlier boots are history), one per fact whatever the source, and never drawn
from input that is not what it claims to be."""

from __future__ import annotations

import json
import warnings

import pytest

from fpdoctor.health import collect, health, kernel_sources, ranks, smi
from fpdoctor.health.findings import findings
from fpdoctor.health.model import HealthFacts
from fpdoctor.health.report import build, exit_code
from fpdoctor.report.model import Severity
from tests.conftest import FIXTURES
from tests.health.fake_nvml import FakeNVML, device

HEALTH = FIXTURES / "health"
HEALTHY_SMI = str(HEALTH / "smi_h100_580_healthy.txt")
MULTIBOOT = str(HEALTH / "multiboot_lost_before_reboot.log")
UUID = "GPU-8d3c1a52-7b0e-4f6a-9c21-5e4d3b2a1f00"
SERIAL = "1322621041234"
REBOOT = "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075) #45-Ubuntu SMP"


def _from_log(*lines: str) -> HealthFacts:
    facts = HealthFacts()
    collect.add_kernel_log(facts, list(lines), "test.log", strict=True)
    return facts


def _severities(facts: HealthFacts) -> dict[str, str]:
    return {f"{f.name} {f.evidence.get('xid', '')}".strip(): f.severity.value for f in findings(facts)}


# --- earlier boots are history ----------------------------------------------------------------


def test_a_gpu_lost_before_the_last_reboot_is_history_and_the_node_passes_the_gate(cli):
    r = cli("health", "--from", MULTIBOOT, "--from", HEALTHY_SMI, "--format", "json")
    report = json.loads(r.out)
    assert r.code == 0, r.out
    found = {(f["name"], f["severity"]) for f in report["findings"]}
    assert found == {("gpu-lost", "warning"), ("xid-error", "warning")}
    for f in report["findings"]:
        assert "in an earlier boot (before the log's last reboot)" in f["message"] and "history" in f["message"]
        assert f["fix"].startswith("Nothing now")
    lost = next(f for f in report["findings"] if f["name"] == "gpu-lost")
    assert lost["evidence"]["count"] == 1 and lost["evidence"]["boots"] == [0] and lost["evidence"]["current_boot"] == 1
    assert "2 boots, judged as of the last" in json.dumps(report["data"]["summary"])
    assert any(row[-2] == "[48,79 earlier boot]" for row in report["data"]["table"]["rows"])


def test_the_same_events_in_the_last_boot_are_errors():
    lines = (HEALTH / "multiboot_lost_before_reboot.log").read_text().splitlines()
    reboot_first = [lines[0], *lines[7:], *lines[1:7]]  # the loss now comes after the reboot
    assert _severities(_from_log(*reboot_first)) == {"gpu-lost 79": "error", "xid-error 48": "error"}


def test_a_grep_of_several_boots_without_boot_lines_is_history_too():
    # uptime going back is the reboot (kernel_log.parse); the last boot here shows no NVIDIA trouble
    facts = _from_log(
        "[ 5021.118811] NVRM: Xid (PCI:0000:0f:00): 48, pid=4411, name=pt_main_thread, DBE",
        "[   12.301200] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07  Fri May 31 09:35:42 UTC 2024",
    )
    assert _severities(facts) == {"xid-error 48": "warning"}


def test_an_application_xid_repeated_over_boots_is_an_error_only_while_it_reaches_the_last_boot():
    def xid13(uptime: str) -> str:
        return f"[ {uptime}] NVRM: Xid (PCI:0000:38:00): 13, pid=11, name=pt_main_thread, Graphics SM Warp Exception"

    three_boots = [xid13("100.0"), REBOOT, xid13("100.0"), REBOOT, xid13("100.0")]
    assert _severities(_from_log(*three_boots)) == {"xid-error 13": "error"}
    assert _severities(_from_log(*three_boots, REBOOT)) == {"xid-error 13": "warning"}


def test_history_survives_the_facts_json_and_older_files_are_judged_as_before(cli, tmp_path):
    out = tmp_path / "facts.json"
    cli("health", "--from", MULTIBOOT, "-o", str(out))
    again = cli("health", "--from", str(out), "--format", "json")
    assert {f["severity"] for f in json.loads(again.out)["findings"]} == {"warning"}
    old = json.loads(out.read_text())
    facts = old["data"]["facts"]
    for entry in (*facts["xids"], *facts["lost"]):  # as written before the last boot was kept
        entry.pop("current_boot")
    out.write_text(json.dumps(old))
    older = json.loads(cli("health", "--from", str(out), "--format", "json").out)
    assert {f["severity"] for f in older["findings"]} == {"error"}


# --- inputs that are not what they claim ------------------------------------------------------


def test_a_saved_dmesg_failure_is_not_a_kernel_log_and_gives_no_verdict(cli):
    r = cli("health", "--from", str(HEALTH / "dmesg_denied.txt"), "--from", HEALTHY_SMI, "--format", "json")
    report = json.loads(r.out)
    assert r.code == 2 and report["data"]["status"] == "incomplete" and not report["data"]["complete"]
    status = report["data"]["summary"][0][1]
    assert status.startswith("INCOMPLETE: GPU facts show no problem, the kernel log was not read")
    assert "'dmesg: read kernel buffer failed: Operation not permitted'" in status
    assert "dmesg_denied.txt holds no kernel message (1 line," in report["data"]["not_checked"]["kernel log"]
    assert report["data"]["facts"]["kernel_logs"] == []
    text = cli("health", "--from", str(HEALTH / "dmesg_denied.txt"), "--from", HEALTHY_SMI)
    status_row = text.out.split("\n\n")[1].splitlines()[0]
    assert status_row.startswith("status") and "INCOMPLETE" in status_row and "healthy" not in status_row
    assert "dmesg_denied.txt          not a kernel log: no line of it is a kernel message" in text.out


@pytest.mark.parametrize(
    "text",
    [
        "-- No entries --\n",
        "journalctl: Failed to open journal: Permission denied\n",
        "Hello, this is the node's motd.\nMaintenance window: Sundays.\n",
        "dmesg: klogctl failed: Operation not permitted\n",
    ],
)
def test_any_text_without_a_kernel_message_is_not_checked(cli, tmp_path, text):
    path = tmp_path / "kern.log"
    path.write_text(text)
    r = cli("health", "--from", str(path), "--from", HEALTHY_SMI, "--format", "json")
    assert r.code == 2 and json.loads(r.out)["data"]["status"] == "incomplete"


@pytest.mark.parametrize(
    "line",
    [
        "[    1.000000] random: crng init done",
        "[Wed Jan 27 23:04:35 2021] EXT4-fs (nvme0n1p2): mounted filesystem",
        "2025-01-21T04:41:44,283302+00:00 EXT4-fs (nvme0n1p2): mounted filesystem",
        "kern  :info  : [    1.000000] random: crng init done",
        "kern  :warn  : 2025-01-21T04:41:44,283302+00:00 EXT4-fs (nvme0n1p2): mounted filesystem",
        "6,1234,5678901,-;random: crng init done",
        "<6>[    1.000000] random: crng init done",
        "Nov 23 09:58:01 node-7 kernel: EXT4-fs (nvme0n1p2): mounted filesystem",
        "2025-11-23T09:58:01.123456+0000 node-7 kernel: EXT4-fs (nvme0n1p2): mounted filesystem",
    ],
)
def test_a_healthy_kernel_log_of_every_shape_is_read(line):
    """The other side: a log with kernel messages but no NVIDIA line is a clean kernel log."""
    facts = _from_log(line)
    assert facts.kernel_logs and "kernel log" not in facts.not_checked


def test_a_live_source_that_yields_no_kernel_message_is_not_checked():
    denied = ["dmesg: read kernel buffer failed: Operation not permitted"]
    facts = collect.collect_live(nvml_module=FakeNVML([device()]), readers=(("dmesg", lambda: denied),), host="n1")
    report = build(facts, findings(facts))
    assert report.data["status"] == "incomplete" and exit_code(report) == 2


def test_a_cut_nvidia_smi_output_is_refused_naming_what_is_missing(cli):
    r = cli("health", "--from", str(HEALTH / "smi_4gpus_cut_in_gpu2.txt"))
    assert r.code == 2 and r.out == "" and len(r.err.strip().splitlines()) == 1
    assert "is cut off: the section of GPU 0000:3a:00.0 stops after 'ECC Errors / Aggre'" in r.err
    assert "1 of the 4 GPUs 'Attached GPUs' counts are not in it at all" in r.err


def test_a_gpu_section_cut_at_a_line_end_is_refused_too():
    text = (HEALTH / "smi_4gpus_cut_in_gpu2.txt").read_text()
    cut = text[: text.rindex("\n        Aggre")]  # ends on a whole line: "DRAM Uncorrectable : 0"
    found = smi.completeness(cut)
    assert found.cut is not None and "where GPU 0000:18:00.0 goes on" in found.cut


def test_gpus_the_header_counts_but_the_output_lacks_are_not_checked(cli, tmp_path):
    text = (HEALTH / "smi_4gpus_cut_in_gpu2.txt").read_text()
    two = text[: text.index("GPU 00000000:3A:00.0")]  # ends between GPUs, as `-i 0,1` output does
    path, log = tmp_path / "smi.txt", tmp_path / "dmesg.txt"
    path.write_text(two)
    log.write_text(REBOOT + "\n")
    r = cli("health", "--from", str(path), "--from", str(log), "--format", "json")
    report = json.loads(r.out)
    assert r.code == 2 and report["data"]["status"] == "incomplete"
    (why,) = [v for k, v in report["data"]["not_checked"].items() if k.startswith("GPUs missing from")]
    assert "'Attached GPUs' counts 4 but the output holds 2 (0000:18:00.0, 0000:2a:00.0)" in why
    whole = text.replace("Attached GPUs                                      : 4", "Attached GPUs : 2")
    assert smi.completeness(whole[: whole.index("GPU 00000000:3A:00.0")]) == smi.Completeness()


# --- one fact, one verdict ---------------------------------------------------------------------

XID154_REBOOT = (
    "[ 7301.000001] NVRM: Xid (PCI:0000:0f:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
    "(Node Reboot Required)"
)


def test_a_recovery_action_is_an_error_whichever_source_says_it(tmp_path):
    from_log = findings(_from_log(XID154_REBOOT))
    smi_file = tmp_path / "smi.txt"
    action = "    GPU Recovery Action                            : Node Reboot Required\n"
    smi_file.write_text((HEALTH / "smi_h100_580_healthy.txt").read_text() + action)
    from_smi = health(from_files=[str(smi_file)]).report.findings
    nvml = collect.collect_live(
        nvml_module=FakeNVML([device(recovery_action=(0, 2))]), readers=(("dmesg", lambda: [REBOOT]),), host="n1"
    )
    from_nvml = findings(nvml)
    assert [f.severity for f in (*from_log, *from_smi, *from_nvml)] == [Severity.ERROR] * 3
    assert [f.name for f in (*from_smi, *from_nvml)] == ["gpu-recovery-required"] * 2


def test_a_gemm_that_never_returns_is_a_failing_gpu(monkeypatch):
    import sys
    import textwrap

    from fpdoctor.health import fingerprint

    identity = json.dumps({"kind": "cuda", "uuid": "GPU-1234", "pci": "00000000:1B:00.0", "index": 0})
    code = textwrap.dedent(
        f"""
        import time
        print({fingerprint.READY + identity!r}, flush=True)
        print({fingerprint.START!r} + "seeded bf16", flush=True)
        time.sleep(120)
        """
    )
    monkeypatch.setattr(fingerprint, "WORK_SLACK_S", 1.0)
    monkeypatch.setattr(fingerprint, "_devices", lambda device, dist: (["cuda:0"], []))
    result = fingerprint.run_fingerprints(0.2, child_command=lambda spec: [sys.executable, "-c", code])
    (finding,) = result.findings
    assert finding.name == "probe-timed-out" and finding.severity is Severity.ERROR
    assert "still in seeded bf16" in finding.message and "not healthy" in finding.message
    report = build(HealthFacts(), [], fingerprints=result)
    assert report.exit_code == 1 and exit_code(report) == 1


def test_a_slow_start_up_stays_a_warning():
    row = {"device": "cuda:0", "kind": None, "rank": None, "host": "n1"}
    row["failure"] = {"kind": "timeout", "step": "start-up (import torch, create the device context)", "seconds": 120}
    findings_, _ = ranks.judge([row])
    assert [f.severity for f in findings_] == [Severity.WARNING]


# --- votes of two, and known answers ------------------------------------------------------------


def _cpu_row(rank: int) -> dict:
    good = {"fp32": "cccc", "bf16": "aaaa"}
    return {
        "rank": rank,
        "host": "n1",
        "device": "cpu",
        "index": None,
        "pci": None,
        "uuid": None,
        "name": "x86_64",
        "threads": 1,
        "isa": "AVX2",
        "kind": "cpu",
        "torch": "2.11.0",
        "digests": dict(good),
        "tflops": {},
        "self_consistent": True,
        "detail": {
            "known_answer": {d: {"ok": True} for d in good},
            "seeded": {d: {"distinct": 1, "repeats": 5, "agreeing": 5} for d in good},
        },
    }


def _flip_rank(rows: list[dict], rank: int) -> None:
    rows[rank]["detail"]["known_answer"]["bf16"] = {"ok": False}
    rows[rank]["known_answer_ok"] = False
    rows[rank]["digests"]["bf16"] = "0bad"


@pytest.mark.parametrize("world", [2, 3])
def test_a_known_answer_failure_decides_and_only_its_rank_is_marked(world):
    rows = [_cpu_row(r) for r in range(world)]
    _flip_rank(rows, 1)
    from fpdoctor.health.fingerprint import FingerprintResult

    found, notes = ranks.judge(rows)
    fp = FingerprintResult(findings=found, rows=rows, notes=notes)
    assert sorted((f.name, f.where.get("rank")) for f in found) == [("gemm-mismatch", 1)]
    report = build(HealthFacts(), [], fingerprints=fp)
    states = {row[0]: row[-1] for row in report.data["table"]["rows"]}
    assert states == {f"rank {r}: x86_64": ("ERROR" if r == 1 else "ok") for r in range(world)}
    assert [r["verdict"] for r in rows] == ["mismatch" if r == 1 else "ok" for r in range(world)]


def test_two_ranks_that_disagree_without_a_known_answer_failure_name_no_outlier_as_an_error():
    rows = [_cpu_row(r) for r in range(2)]
    rows[1]["digests"]["bf16"] = "ffff"
    found, _ = ranks.judge(rows)
    assert {f.severity for f in found} == {Severity.WARNING}
    assert all("no majority says which is right" in f.message for f in found)


@pytest.mark.parametrize("hosts", [1, 2])
def test_two_ranks_make_an_html_report_without_a_layout_warning(hosts):
    from fpdoctor.health.fingerprint import FingerprintResult
    from fpdoctor.report import html

    rows = [_cpu_row(r) for r in range(2)]
    for r, row in enumerate(rows):  # the processor's name as the fingerprint child reads it
        row.update(name="AMD EPYC 7763 64-Core Processor", host=f"gpu-node-011{r % hosts}.cluster.example.org")
    found, notes = ranks.judge(rows)
    report = build(HealthFacts(), [], fingerprints=FingerprintResult(findings=found, rows=rows, notes=notes))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        page = html.page(report.to_dict())
    assert 'aria-label="fingerprints"' in page


# --- one event counted once; the GPU named so it can be found -----------------------------------


def test_one_fall_off_the_bus_is_counted_once_and_two_are_two():
    lines = (HEALTH / "lost_two_lines_per_event.log").read_text().splitlines()
    (lost,) = _from_log(*lines).lost
    assert lost.count == 1 and lost.via == "Xid 79"
    later = [line.replace("[  412.", "[  912.") for line in lines[2:]]  # the same again 500 s on
    assert _from_log(*lines, *later).lost[0].count == 2
    pasted = [line.split("] ", 1)[1] for line in lines]  # no stamps: lines of one report stay one
    assert _from_log(*pasted).lost[0].count == 1


@pytest.mark.parametrize("fmt", ["text", "markdown"])
def test_the_gpu_is_named_by_uuid_and_board_serial_where_it_is_named(cli, fmt):
    r = cli("health", "--from", str(HEALTH / "lost_two_lines_per_event.log"), "--format", fmt)
    assert r.code == 1
    assert f"GPU (0000:0f:00.0, {UUID}, serial {SERIAL}) has fallen off the bus" in " ".join(r.out.split())
    assert "2 times" not in r.out


# --- the exit status ---------------------------------------------------------------------------


def test_the_gate_exit_status_over_what_was_read():
    clean = (("dmesg", lambda: [REBOOT]),)

    def live(nvml, readers=clean) -> int:
        facts = collect.collect_live(nvml_module=nvml, readers=readers, host="n1")
        return exit_code(build(facts, findings(facts)))

    import pynvml

    assert live(FakeNVML([device()])) == 0  # every source read, nothing wrong
    assert live(FakeNVML([device(clock_reasons=0x8)])) == 0  # a warning: still fit for jobs
    ecc = {**device()["ecc"], ("uncorrected", "volatile"): 2}
    assert live(FakeNVML([device(ecc=ecc)])) == 1
    no_nvml = FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert live(no_nvml) == 2  # NOT CHECKED: no verdict

    def unreadable() -> list[str]:
        raise kernel_sources.NotReadable("not readable: kernel.dmesg_restrict=1")

    assert live(FakeNVML([device()]), readers=(("dmesg", unreadable),)) == 2  # INCOMPLETE: no kernel log
    xid48 = "[ 100.0] NVRM: Xid (PCI:0000:52:00): 48, pid=1, name=x, DBE"
    assert live(no_nvml, readers=(("dmesg", lambda: [REBOOT, xid48]),)) == 1  # an error decides anyway
