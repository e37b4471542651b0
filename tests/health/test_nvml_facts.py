"""NVML facts through a fake pynvml (CPU twin), and the real NVML where there is one."""

from __future__ import annotations

import time

import pynvml
import pytest

from fpdoctor.health import nvml
from tests.health.fake_nvml import FakeNVML, device, not_supported


def collect(*devices, **kw):
    gpus, driver = nvml.collect(host="node-1", nvml=FakeNVML(list(devices), **kw))
    return gpus, driver


def test_healthy_h100_measured_values():
    (gpu,), driver = collect(device())
    assert driver == "580.159.04"
    assert (gpu.index, gpu.pci, gpu.name, gpu.host, gpu.source) == (
        0,
        "0000:52:00.0",
        "NVIDIA H100 80GB HBM3",
        "node-1",
        "nvml",
    )
    assert gpu.uuid.startswith("GPU-") and gpu.serial == "1654922001234"
    assert gpu.facts == {
        "ecc_mode": {"current": "enabled", "pending": "enabled"},
        "ecc": {"volatile": {"uncorrected": 0, "corrected": 0}, "aggregate": {"uncorrected": 0, "corrected": 0}},
        "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
        "clock_event_reasons": ["gpu_idle"],
        "temperature_c": 34,
        "power_w": 70.1,
        "power_limit_w": 700.0,
        "pcie_replays": 0,
        "recovery_action": "none",
    }
    # retired pages are NotSupported on H100 (row remapping replaced them): trusted, and said
    assert gpu.unavailable == {"retired_pages": "not supported"}


def test_other_nvml_errors_are_not_read_with_the_reason():
    err = pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
    (gpu,), _ = collect(device(ecc_mode=err, temperature=pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)))
    assert gpu.unavailable["ecc_mode"] == "not read: Insufficient Permissions"
    assert gpu.unavailable["temperature_c"] == "not read: Unknown Error"
    assert "ecc_mode" not in gpu.facts and "temperature_c" not in gpu.facts


def test_partial_ecc_counts_keep_what_was_read():
    ecc = {
        ("uncorrected", "volatile"): 2,
        ("uncorrected", "aggregate"): pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN),
        ("corrected", "volatile"): 5,
        ("corrected", "aggregate"): 9,
    }
    (gpu,), _ = collect(device(ecc=ecc))
    assert gpu.facts["ecc"] == {"volatile": {"uncorrected": 2, "corrected": 5}, "aggregate": {"corrected": 9}}
    assert gpu.unavailable == {"retired_pages": "not supported", "ecc.aggregate.uncorrected": "not read: Unknown Error"}


def test_consumer_gpu_row_remapper_zeros_are_not_trusted():
    # gpud PR #351: an RTX 4090 answers the remapped-rows call with success and zeros
    (gpu,), _ = collect(device(name="NVIDIA GeForce RTX 4090", ecc_mode=not_supported(), ecc=not_supported()))
    assert "remapped_rows" not in gpu.facts
    assert gpu.unavailable["remapped_rows"].startswith("not trusted")
    assert gpu.unavailable["ecc"] == "not supported" and gpu.unavailable["ecc_mode"] == "not supported"


def test_a_reported_problem_is_kept_even_on_an_unlisted_product():
    (gpu,), _ = collect(device(name="NVIDIA L40S", remapped_rows=(0, 2, 1, 0)))
    assert gpu.facts["remapped_rows"] == {"correctable": 0, "uncorrectable": 2, "pending": True, "failure": False}


def test_retired_pages_on_an_older_gpu():
    pages = {
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR: [0x1000, 0x2000],
        pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS: [0x3000],
    }
    (gpu,), _ = collect(
        device(name="Tesla V100-SXM2-32GB", retired_pages=pages, retired_pending=1, remapped_rows=not_supported())
    )
    assert gpu.facts["retired_pages"] == {"double_bit": 2, "single_bit": 1, "pending": True}
    assert gpu.unavailable["remapped_rows"] == "not supported"


@pytest.mark.parametrize(
    ("mask", "names"),
    [
        (0x1, ["gpu_idle"]),
        (0x4, ["sw_power_cap"]),
        (0x8 | 0x40, ["hw_slowdown", "hw_thermal_slowdown"]),
        (0x80 | 0x20, ["sw_thermal_slowdown", "hw_power_brake_slowdown"]),
        (0, []),
    ],
)
def test_clock_event_reason_bits(mask, names):
    (gpu,), _ = collect(device(clock_reasons=mask))
    assert gpu.facts["clock_event_reasons"] == names


def test_old_driver_without_the_clocks_event_call_uses_the_throttle_name():
    class OldDriver(FakeNVML):
        def nvmlDeviceGetCurrentClocksEventReasons(self, h):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    gpus, _ = nvml.collect(nvml=OldDriver([device(clock_reasons=0x40)]))
    assert gpus[0].facts["clock_event_reasons"] == ["hw_thermal_slowdown"]
    assert "clock_event_reasons" not in gpus[0].unavailable


def test_recovery_action_field():
    (gpu,), _ = collect(device(recovery_action=(pynvml.NVML_SUCCESS, 4)))
    assert gpu.facts["recovery_action"] == "drain_and_reset"
    (gpu,), _ = collect(device(recovery_action=(pynvml.NVML_ERROR_NOT_SUPPORTED, 0)))
    assert gpu.unavailable["recovery_action"] == "not supported"
    (gpu,), _ = collect(device(recovery_action=(pynvml.NVML_ERROR_INVALID_ARGUMENT, 0)))
    assert (
        gpu.unavailable["recovery_action"].startswith("not read: Invalid Argument")
        and "r570" in (gpu.unavailable["recovery_action"])
    )


def test_a_lost_gpu_stops_its_reads_and_says_so():
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    gpus, _ = collect(device(), device(bus_id="00000000:53:00.0", ecc_mode=lost), device(handle_error=lost))
    assert [g.lost for g in gpus] == [None, "NVML: GPU is lost", "NVML: GPU is lost"]
    assert gpus[1].pci == "0000:53:00.0" and "ecc" not in gpus[1].facts
    assert gpus[2].index == 2 and gpus[2].pci is None


@pytest.mark.parametrize(
    ("code", "no_driver", "text"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, True, "NVML not available: libnvidia-ml.so.1 not found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, True, "NVML not available: the NVIDIA kernel driver is not loaded"),
        (pynvml.NVML_ERROR_UNKNOWN, False, "NVML not available: Unknown Error"),
    ],
)
def test_nvml_that_cannot_start_says_why(code, no_driver, text, monkeypatch, tmp_path):
    monkeypatch.setattr(nvml, "PCI_DEVICES", tmp_path / "no-pci-bus")  # a machine without NVIDIA GPUs
    with pytest.raises(nvml.NvmlUnavailable) as info:
        collect(init_error=code)
    assert str(info.value).startswith(text)
    assert info.value.no_driver is no_driver and not info.value.unusable


def test_a_hanging_nvml_is_reported_not_waited_for():
    class Hangs(FakeNVML):
        def nvmlDeviceGetCount(self):
            time.sleep(30)
            return 0

    start = time.monotonic()
    with pytest.raises(nvml.NvmlUnavailable, match=r"did not answer within 0\.3 s"):
        nvml.collect(nvml=Hangs([]), timeout_s=0.3)
    assert time.monotonic() - start < 5


def test_an_nvml_error_after_init_is_unavailable_with_the_reason():
    class CountFails(FakeNVML):
        def nvmlDeviceGetCount(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    fake = CountFails([device()])
    with pytest.raises(nvml.NvmlUnavailable, match="could not count the GPUs: Unknown Error") as info:
        nvml.collect(nvml=fake)
    assert info.value.no_driver is False and fake.initialised is False


def test_any_other_exception_while_reading_is_unavailable_with_the_reason():
    class OddAnswer(FakeNVML):
        def nvmlDeviceGetRemappedRows(self, h):
            return (0, 0)  # a short tuple from a mismatched pynvml

    with pytest.raises(nvml.NvmlUnavailable, match=r"NVML not read: .*\(ValueError\)"):
        nvml.collect(nvml=OddAnswer([device()]))


@pytest.mark.parametrize(("bus_id", "pci"), [("", None), ("N/A", "N/A"), ("0000:zz:00.0", "0000:zz:00.0")])
def test_an_odd_bus_id_is_kept_as_text(bus_id, pci):
    (gpu,), _ = collect(device(bus_id=bus_id))
    assert gpu.pci == pci and gpu.facts["ecc"]["volatile"]["uncorrected"] == 0


def test_nvml_failing_after_init_makes_the_report_not_checked():
    """`fpdoctor health` on such a machine: a report that says NVML was not read, never a traceback."""
    import fpdoctor

    class CountFails(FakeNVML):
        def nvmlDeviceGetCount(self):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    report = fpdoctor.health(nvml=CountFails([device()])).report
    assert report.data["status"] in ("not checked", "incomplete")
    assert "Unknown Error" in report.data["not_checked"]["NVML"]


def test_nvml_is_shut_down_after_reading():
    fake = FakeNVML([device()])
    nvml.collect(nvml=fake)
    assert fake.initialised is False


def _real_nvml_gpus() -> int:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@pytest.mark.skipif(_real_nvml_gpus() == 0, reason="needs NVML and an NVIDIA GPU")
def test_real_nvml_reads_every_gpu():
    gpus, driver = nvml.collect()
    assert driver and gpus
    for g in gpus:
        assert g.pci and g.uuid and g.uuid.startswith("GPU-") and g.name
        # every health fact is read or says why not
        for key in ("ecc", "clock_event_reasons", "temperature_c", "pcie_replays"):
            assert key in g.facts or any(k.split(".")[0] == key for k in g.unavailable), key
