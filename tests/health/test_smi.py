"""`nvidia-smi -q` text: the real excerpts of research notes A.6 and the layouts of older drivers."""

from __future__ import annotations

from fpdoctor.health import smi
from tests.conftest import FIXTURES

HEALTH = FIXTURES / "health"


def parse(name: str):
    return smi.parse((HEALTH / name).read_text())


def test_a100_after_xid63_remap_pending_with_correctable_rows():
    (gpu,), driver = parse("smi_a100_after_xid63.txt")
    assert driver is None and gpu.pci is None
    assert gpu.facts["ecc"]["volatile"] == {
        "uncorrected": 0,
        "corrected": 177,
        "sram_corrected": 0,
        "dram_corrected": 177,
        "sram_uncorrected": 0,
        "dram_uncorrected": 0,
    }
    assert gpu.facts["remapped_rows"] == {"correctable": 1, "uncorrectable": 0, "pending": True, "failure": False}
    assert gpu.unavailable["retired_pages"] == "not supported (N/A in nvidia-smi -q)"
    assert gpu.unavailable["clock_event_reasons"] == "not in this nvidia-smi -q output"


def test_sram_uncorrectable_volatile_and_aggregate():
    (gpu,), _ = parse("smi_sram_uncorrectable.txt")
    assert gpu.facts["ecc"]["volatile"]["uncorrected"] == 1 and gpu.facts["ecc"]["aggregate"]["uncorrected"] == 5
    assert gpu.facts["ecc"]["aggregate"]["sram_uncorrected"] == 5


def test_after_an_uncorrectable_error_ecc_reads_unknown_error():
    (gpu,), _ = parse("smi_550_after_xid48_63_94.txt")
    assert gpu.pci == "0000:52:00.0"
    assert gpu.unavailable["ecc_mode"] == "not read: nvidia-smi -q shows 'Unknown Error'"
    assert gpu.unavailable["ecc"].startswith("not read: nvidia-smi -q shows N/A while ECC mode reads")
    # the "Aggregate Uncorrectable SRAM Sources" section is not counted as errors
    assert "ecc" not in gpu.facts
    assert gpu.facts["remapped_rows"] == {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}


def test_gpud_pr80_excerpt():
    (gpu,), _ = parse("smi_gpud_pr80_remap_pending.txt")
    assert gpu.facts["remapped_rows"] == {"correctable": 0, "uncorrectable": 4, "pending": True}


def test_healthy_h100_with_the_580_driver_fields():
    (gpu,), _ = parse("smi_h100_580_healthy.txt")
    assert gpu.facts["clock_event_reasons"] == ["gpu_idle"]
    assert gpu.facts["ecc_mode"] == {"current": "enabled", "pending": "enabled"}
    assert gpu.facts["ecc"]["aggregate"]["sram_threshold_exceeded"] is False
    assert gpu.facts["memory_repair"] == {
        "channel_repair_pending": False,
        "tpc_repair_pending": False,
        "unrepairable_memory": False,
    }
    assert gpu.facts["remapped_rows"]["pending"] is False
    assert gpu.unavailable == {}


FULL = """==============NVSMI LOG==============

Timestamp                                 : Mon Nov 25 10:00:00 2024
Driver Version                            : 470.82.01
CUDA Version                              : 11.4

Attached GPUs                             : 2
GPU 00000000:3B:00.0
    Product Name                          : Tesla V100-SXM2-32GB
    Serial Number                         : 0323218012345
    GPU UUID                              : GPU-11111111-2222-3333-4444-555555555555
    PCI
        Bus                               : 0x3B
        Bus Id                            : 00000000:3B:00.0
        Replays Since Reset               : 3
    Clocks Throttle Reasons
        Idle                              : Not Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Not Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Not Active
        Sync Boost                        : Not Active
        SW Thermal Slowdown               : Not Active
        Display Clock Setting             : Not Active
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 2
                Register File             : 0
                Total                     : 2
            Double Bit
                Device Memory             : 1
                Register File             : 0
                Total                     : 1
        Aggregate
            Single Bit
                Total                     : 7
            Double Bit
                Total                     : 1
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 1
        Pending Page Blacklist            : Yes
    Remapped Rows                         : N/A
    Temperature
        GPU Current Temp                  : 41 C
    Power Readings
        Power Draw                        : 55.12 W
        Power Limit                       : 300.00 W
GPU 00000000:86:00.0
    Product Name                          : NVIDIA GeForce RTX 4090
    Serial Number                         : N/A
    GPU UUID                              : GPU-66666666-7777-8888-9999-000000000000
    GPU Reset Status
        Reset Required                    : Yes
        Drain and Reset Recommended       : No
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
"""


def test_full_output_with_header_older_layouts_and_indices():
    assert smi.looks_like_smi(FULL)
    (v100, rtx), driver = smi.parse(FULL)
    assert driver == "470.82.01"
    assert (v100.index, v100.pci, v100.name, v100.serial) == (
        0,
        "0000:3b:00.0",
        "Tesla V100-SXM2-32GB",
        "0323218012345",
    )
    assert v100.facts["ecc"] == {
        "volatile": {"corrected": 2, "uncorrected": 1},
        "aggregate": {"corrected": 7, "uncorrected": 1},
    }
    assert v100.facts["retired_pages"] == {"single_bit": 0, "double_bit": 1, "pending": True}
    assert v100.unavailable["remapped_rows"] == "not supported (N/A in nvidia-smi -q)"
    assert v100.facts["clock_event_reasons"] == ["sw_power_cap"]
    assert (v100.facts["temperature_c"], v100.facts["power_w"], v100.facts["power_limit_w"]) == (41, 55.12, 300.0)
    assert v100.facts["pcie_replays"] == 3
    assert (rtx.index, rtx.pci, rtx.serial) == (1, "0000:86:00.0", None)
    assert rtx.facts["recovery_action"] == "gpu_reset"
    assert rtx.unavailable["remapped_rows"].startswith("not trusted")


def test_a_bug_report_section_after_the_gpus_is_not_read_as_a_gpu():
    text = (
        FULL + "____________________________________________\n\n*** /proc/driver/nvidia/version\n    NVRM version: x\n"
    )
    gpus, _ = smi.parse(text)
    assert len(gpus) == 2 and gpus[1].name == "NVIDIA GeForce RTX 4090"


def test_kernel_logs_are_not_smi():
    assert not smi.looks_like_smi("[ 1.0] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, x\n")
    assert not smi.looks_like_smi("hello\nworld\n")
