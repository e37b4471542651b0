"""A GPU that nvidia-smi or NVML says is unusable is an error naming it, never "not checked": the line
nvidia-smi prints instead of a GPU it cannot open, NVML failing to open a GPU, and a driver that sees
no GPU where the node has some. Saved (`--from`) and live alike."""

from __future__ import annotations

import json

import pynvml
import pytest

from fpdoctor.health import collect, inputs, nvml, smi
from fpdoctor.health.findings import findings
from fpdoctor.health.report import build, exit_code
from tests.conftest import FIXTURES
from tests.health.fake_nvml import FakeNVML, device

HEALTH = FIXTURES / "health"
UNREACHABLE = str(HEALTH / "rules" / "HWR010-gpu-unreachable.txt")
LINE = "Unable to determine the device handle for GPU 00000000:47:00.0: Unknown Error"
LOST_LINE = (
    "Unable to determine the device handle for GPU0000:48:00.0: GPU is lost.  Reboot the system to recover this GPU"
)
DENIED_LINE = "Unable to determine the device handle for GPU 00000000:49:00.0: Insufficient Permissions"
HEADER = (
    "==============NVSMI LOG==============\n\n"
    "Timestamp                                          : Thu Nov 26 09:12:44 2026\n"
    "Driver Version                                     : 580.159.04\n"
    "CUDA Version                                       : 13.0\n\n"
)
REBOOT = "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-075) #45-Ubuntu SMP"
CLEAN = (("dmesg", lambda: [REBOOT]),)


@pytest.fixture(autouse=True)
def _no_driver_gpu_list(monkeypatch, tmp_path):
    """The driver's own GPU list and the PCI bus are the test's, not this machine's."""
    monkeypatch.setattr(nvml, "DRIVER_GPUS", tmp_path / "proc-driver-nvidia-gpus")
    monkeypatch.setattr(nvml, "PCI_DEVICES", tmp_path / "sys-bus-pci-devices")


def _driver_lists(*bus_ids: str) -> None:
    for bus in bus_ids:
        (nvml.DRIVER_GPUS / bus).mkdir(parents=True)


def _report(cli, *paths: str) -> tuple[int, dict]:
    args = [a for p in paths for a in ("--from", p)]
    r = cli("health", *args, "--format", "json")
    return r.code, json.loads(r.out)


# --- saved nvidia-smi output ------------------------------------------------------------------


def test_a_gpu_nvidia_smi_cannot_open_is_an_error_naming_it(cli):
    code, report = _report(cli, UNREACHABLE)
    assert code == 1 and report["data"]["status"] == "problems"
    (finding,) = report["findings"]
    assert (finding["name"], finding["severity"]) == ("gpu-unreachable", "error")
    assert finding["where"]["pci"] == "0000:47:00.0" and finding["evidence"]["line"] == LINE
    assert LINE in finding["message"] and "Xid 79" in finding["message"]
    assert finding["evidence"]["xid_catalog"].startswith("79: GPU fell off the PCIe bus")
    for step in ("Drain the node", "nvidia-smi -r -i 0000:47:00.0", "reseat", "RMA"):
        assert step in finding["fix"]
    # the GPU is in the output, not missing from it
    assert not any(k.startswith("GPUs missing") for k in report["data"].get("not_checked", {}))
    assert [(row[1], row[-1]) for row in report["data"]["table"]["rows"]] == [
        ("18:00.0", "ok"),
        ("2a:00.0", "ok"),
        ("47:00.0", "ERROR"),
    ]


def test_the_text_report_quotes_the_line(cli):
    r = cli("health", "--from", UNREACHABLE)
    assert r.code == 1 and r.out.lstrip().startswith("ERROR") and LINE in r.out
    assert "NOT CHECKED: GPUs missing" not in r.out


@pytest.mark.parametrize("header", [HEADER + "Attached GPUs : 1\n", ""], ids=["with the header", "the line alone"])
def test_every_gpu_unopened_is_judged_not_refused(cli, tmp_path, header):
    path = tmp_path / "smi.txt"
    path.write_text(f"{header}{LINE}\n")
    assert inputs.kind(path.read_text()) == "smi"
    code, report = _report(cli, str(path))
    assert code == 1
    assert [(f["name"], f["where"]["pci"]) for f in report["findings"]] == [("gpu-unreachable", "0000:47:00.0")]


def test_gpu_is_lost_is_gpu_lost_and_a_permission_leaves_the_gpu_not_checked(cli, tmp_path):
    path = tmp_path / "smi.txt"
    path.write_text(f"{HEADER}Attached GPUs : 3\n{LINE}\n{LOST_LINE}\n{DENIED_LINE}\n")
    gpus, _ = smi.parse(path.read_text())
    assert [g.index for g in gpus] == [0, 1, 2]
    assert gpus[0].unreachable == LINE and gpus[1].lost == f"nvidia-smi -q: {LOST_LINE}"
    assert gpus[2].unavailable == {"device_handle": f"not read: nvidia-smi -q shows {DENIED_LINE!r}"}
    assert smi.completeness(path.read_text()) == smi.Completeness()
    code, report = _report(cli, str(path))
    assert code == 1
    assert sorted((f["name"], f["where"]["pci"]) for f in report["findings"]) == [
        ("gpu-lost", "0000:48:00.0"),
        ("gpu-unreachable", "0000:47:00.0"),
    ]
    assert "device handle (GPU 2)" in report["data"]["not_checked"]


def test_a_permission_alone_gives_no_verdict(cli, tmp_path):
    path, log = tmp_path / "smi.txt", tmp_path / "dmesg.txt"
    path.write_text(f"{HEADER}Attached GPUs : 1\n{DENIED_LINE}\n")
    log.write_text(REBOOT + "\n")
    code, report = _report(cli, str(path), str(log))
    assert code == 2 and report["findings"] == [] and report["data"]["status"] != "healthy"


def test_a_kernel_log_with_the_gpu_off_the_bus_makes_one_finding_with_both_lines(cli, tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text(f"{REBOOT}\n[ 1843.308145] NVRM: Xid (PCI:0000:47:00): 79, pid='<unknown>', name=<unknown>, "
                   "GPU has fallen off the bus.\n")  # fmt: skip
    code, report = _report(cli, UNREACHABLE, str(log))
    assert code == 1
    (lost,) = report["findings"]
    assert lost["name"] == "gpu-lost" and lost["evidence"]["unreachable"] == LINE and LINE in lost["message"]


@pytest.mark.parametrize("text", ["No devices were found\n", HEADER + "Attached GPUs                 : 0\n"])
def test_nvidia_smi_that_sees_no_gpu_is_an_error_not_a_kernel_log(cli, tmp_path, text):
    path = tmp_path / "smi.txt"
    path.write_text(text)
    assert inputs.kind(text) == "smi"
    code, report = _report(cli, str(path))
    assert code == 1
    (finding,) = report["findings"]
    assert (finding["name"], finding["severity"]) == ("no-gpu-visible", "error")
    assert "No GPU is visible to the NVIDIA driver" in finding["message"]
    assert "not a kernel log" not in json.dumps(report["data"]["summary"])
    assert report["data"]["summary"][0][1].startswith("problems found: see the findings")


def test_the_facts_json_keeps_both(cli, tmp_path):
    for path in (UNREACHABLE, str(HEALTH / "rules" / "HWR011-no-gpu-visible.txt")):
        saved = tmp_path / "facts.json"
        assert cli("health", "--from", path, "-o", str(saved)).code == 1
        code, report = _report(cli, str(saved))
        assert code == 1 and {f["name"] for f in report["findings"]} <= {"gpu-unreachable", "no-gpu-visible"}
        assert report["findings"]


# --- live: NVML --------------------------------------------------------------------------------


def _live(fake: FakeNVML, readers=CLEAN):
    facts = collect.collect_live(nvml_module=fake, readers=readers, host="n1")
    report = build(facts, findings(facts))
    return facts, report, exit_code(report)


def _handle_error(code: int) -> dict:
    return device(bus_id="00000000:47:00.0", handle_error=pynvml.NVMLError(code))


@pytest.mark.parametrize(
    "code", [pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_INSUFFICIENT_POWER, pynvml.NVML_ERROR_IRQ_ISSUE]
)
def test_nvml_that_cannot_open_a_gpu_makes_it_an_error(code):
    _, report, status = _live(FakeNVML([device(), _handle_error(code)]))
    assert status == 1
    (finding,) = report.findings
    assert finding.name == "gpu-unreachable" and finding.where["index"] == 1
    assert finding.evidence["line"] == f"nvmlDeviceGetHandleByIndex(1): {pynvml.NVMLError(code)}"
    assert finding.evidence["source"] == "NVML"


def test_the_driver_gpu_list_names_the_unopened_gpu_by_bus_id():
    _driver_lists("0000:52:00.0", "0000:53:00.0")
    gpus, _ = nvml.collect(nvml=FakeNVML([device(), _handle_error(pynvml.NVML_ERROR_UNKNOWN)]))
    assert [g.pci for g in gpus] == ["0000:52:00.0", "0000:53:00.0"]


def test_a_driver_list_the_opened_gpus_contradict_names_nothing():
    _driver_lists("0000:47:00.0", "0000:52:00.0")  # 52:00.0 is GPU 0, so the list is not NVML's order
    gpus, _ = nvml.collect(nvml=FakeNVML([device(), _handle_error(pynvml.NVML_ERROR_UNKNOWN)]))
    assert gpus[1].pci is None and gpus[1].unreachable


def test_nvml_gpu_is_lost_on_open_is_gpu_lost():
    _, report, status = _live(FakeNVML([device(), _handle_error(pynvml.NVML_ERROR_GPU_IS_LOST)]))
    assert status == 1 and [f.name for f in report.findings] == ["gpu-lost"]


def test_nvml_not_allowed_to_open_a_gpu_leaves_it_not_checked():
    _, report, status = _live(FakeNVML([device(), _handle_error(pynvml.NVML_ERROR_NO_PERMISSION)]))
    assert status == 2 and report.findings == [] and report.data["status"] == "incomplete"
    assert report.data["not_checked"] == {
        "device handle (GPU 1)": "not read: nvmlDeviceGetHandleByIndex(1): Insufficient Permissions"
    }


def test_nvml_that_sees_no_gpu_the_driver_lists_is_an_error():
    _driver_lists("0000:47:00.0")
    facts, report, status = _live(FakeNVML([]))
    assert status == 1 and [f.name for f in report.findings] == ["no-gpu-visible"]
    assert "/proc/driver/nvidia/gpus names 0000:47:00.0" in report.findings[0].message
    assert "NVML" not in facts.not_checked


def test_nvml_that_sees_no_gpu_the_kernel_log_names_is_an_error():
    log = [REBOOT, "[    8.1] NVRM: GPU at PCI:0000:47:00: GPU-509665ad-0000-4000-8000-000000000002"]
    _, report, status = _live(FakeNVML([]), readers=(("dmesg", lambda: log),))
    assert status == 1 and "this boot's kernel log names 0000:47:00.0" in report.findings[0].message


def test_nvml_that_sees_no_gpu_on_a_node_without_any_gives_no_verdict():
    facts, report, status = _live(FakeNVML([]))
    assert status == 2 and report.findings == [] and facts.not_checked["NVML"] == "NVML runs but sees no NVIDIA GPU"


# --- the driver's own words: nvidia-smi that cannot talk to it, a GPU it could not initialise -----

SMI_FAILED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest "
    "NVIDIA driver is installed and running."
)
MISMATCH = "Failed to initialize NVML: Driver/library version mismatch"


@pytest.mark.parametrize("line", [SMI_FAILED, MISMATCH, f"{MISMATCH}\nNVML library version: 550.54"])
def test_nvidia_smi_that_cannot_talk_to_the_driver_is_a_drain(cli, tmp_path, line):
    path = tmp_path / "smi.txt"
    path.write_text(line + "\n")
    code, report = _report(cli, str(path))
    assert code == 1, report["data"]["summary"]
    (finding,) = report["findings"]
    assert (finding["name"], finding["severity"]) == ("no-gpu-visible", "error")
    assert line.splitlines()[0] in finding["message"]  # quoted
    assert "not a kernel log" not in json.dumps(report["data"])


def test_nvml_refused_for_permissions_in_nvidia_smi_output_is_no_verdict(cli, tmp_path):
    path = tmp_path / "smi.txt"
    path.write_text("Failed to initialize NVML: Insufficient Permissions\n")
    assert smi.driver_failed(path.read_text()) is None


def test_the_lowercase_form_of_an_unopened_gpu_is_an_error_naming_it(cli, tmp_path):
    """`nvidia-smi` without -q says 'for gpu'."""
    path = tmp_path / "smi.txt"
    line = "Unable to determine the device handle for gpu 0000:47:00.0: Unknown Error"
    path.write_text(line + "\n")
    code, report = _report(cli, str(path))
    assert code == 1
    (finding,) = report["findings"]
    assert finding["name"] == "gpu-unreachable" and finding["where"]["pci"] == "0000:47:00.0"
    assert finding["evidence"]["line"] == line


@pytest.mark.parametrize(
    ("line", "pci"),
    [
        ("NVRM: GPU 0000:47:00.0: RmInitAdapter failed! (0x25:0xffff:1601)", "0000:47:00.0"),
        ("NVRM: RmInitAdapter failed! (0x26:0x56:1474)", None),
    ],
)
def test_a_gpu_the_driver_could_not_initialise_this_boot_is_an_error(cli, tmp_path, line, pci):
    path = tmp_path / "dmesg.txt"
    path.write_text(f"{REBOOT}\n[    5.123456] {line}\n[    5.2] NVRM: rm_init_adapter failed, device minor number 3\n")
    code, report = _report(cli, str(path))
    assert code == 1
    (finding,) = report["findings"]
    assert finding["name"] == "gpu-unreachable" and finding["evidence"]["line"] == line
    assert finding["where"].get("pci") == pci and line in finding["message"]


def test_an_earlier_boots_init_failure_or_a_gpu_opened_since_is_not_an_error(tmp_path):
    earlier = [REBOOT, "[    5.1] NVRM: GPU 0000:47:00.0: RmInitAdapter failed! (0x25:0xffff:1601)", REBOOT]
    facts = collect.collect_live(nvml_module=FakeNVML([device()]), readers=(("dmesg", lambda: earlier),), host="n1")
    assert not [f for f in findings(facts) if f.name == "gpu-unreachable"]
    opened = [REBOOT, "[    5.1] NVRM: GPU 0000:52:00.0: RmInitAdapter failed! (0x25:0xffff:1601)"]
    facts = collect.collect_live(nvml_module=FakeNVML([device()]), readers=(("dmesg", lambda: opened),), host="n1")
    assert facts.gpus[0].pci == "0000:52:00.0" and not facts.gpus[0].unreachable
    assert any("RmInitAdapter failed" in note for note in facts.notes)


def test_nvml_with_a_driver_library_version_mismatch_is_a_drain():
    facts, report, status = _live(FakeNVML([], init_error=pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH))
    assert status == 1 and [f.name for f in report.findings] == ["no-gpu-visible"]
    assert "version mismatch" in report.findings[0].message and "NVML" not in facts.not_checked


def test_a_driver_not_loaded_while_the_pci_bus_holds_nvidia_gpus_is_a_drain():
    for bus, vendor, cls in (("0000:47:00.0", "0x10de", "0x030200"), ("0000:05:00.0", "0x10de", "0x068000")):
        dev = nvml.PCI_DEVICES / bus
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "class").write_text(cls + "\n")  # an NVSwitch (a bridge) is no GPU
    facts, report, status = _live(FakeNVML([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED))
    assert status == 1 and [f.name for f in report.findings] == ["no-gpu-visible"]
    assert "the PCI bus holds 1 NVIDIA GPU(s) (0000:47:00.0)" in report.findings[0].message
    assert facts.no_driver is None
