"""A stand-in for the pynvml module: real constants and error classes, devices from a dict.

The healthy H100 below holds the values measured on a lent H100 80GB HBM3, driver 580.159.04
(research notes A.6): TotalEccErrors 0, RemappedRows (0, 0, 0, 0), RetiredPages and
RetiredPagesPendingStatus NotSupported, CurrentClocksEventReasons 1 (GpuIdle), EccMode [1, 1],
PcieReplayCounter 0, field 230 (recovery action) 0.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pynvml


def not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


H100_HEALTHY: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3",
    "uuid": "GPU-509665ad-0000-4000-8000-000000000001",
    "serial": "1654922001234",
    "bus_id": "00000000:52:00.0",
    "ecc_mode": [1, 1],
    "ecc": {
        ("uncorrected", "volatile"): 0,
        ("uncorrected", "aggregate"): 0,
        ("corrected", "volatile"): 0,
        ("corrected", "aggregate"): 0,
    },
    "retired_pages": not_supported(),
    "retired_pending": not_supported(),
    "remapped_rows": (0, 0, 0, 0),
    "clock_reasons": 0x1,
    "temperature": 34,
    "power_mw": 70123,
    "power_limit_mw": 700000,
    "pcie_replays": 0,
    "recovery_action": (pynvml.NVML_SUCCESS, 0),
}


def device(**changes: Any) -> dict[str, Any]:
    d = copy.deepcopy(H100_HEALTHY)
    d.update(changes)
    return d


class FakeNVML:
    """`FakeNVML([device(...), ...])` behaves like `pynvml` for the calls fpdoctor.health.nvml makes."""

    def __init__(self, devices: list[dict[str, Any]], *, init_error: int | None = None, driver: str = "580.159.04"):
        self.devices, self.init_error, self.driver = devices, init_error, driver
        self.calls: list[str] = []
        self.initialised = False

    def __getattr__(self, name: str) -> Any:
        return getattr(pynvml, name)  # constants, NVMLError and its subclasses

    @staticmethod
    def _value(value: Any) -> Any:
        if isinstance(value, BaseException):
            raise value
        return value

    def _dev(self, handle: Any, key: str) -> Any:
        self.calls.append(key)
        return self._value(self.devices[handle][key])

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return self._value(self.devices[index].get("handle_error", index))

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._dev(h, "name")

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._dev(h, "uuid")

    def nvmlDeviceGetSerial(self, h: int) -> str:
        return self._dev(h, "serial")

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self._dev(h, "bus_id").encode())

    def nvmlDeviceGetEccMode(self, h: int) -> list[int]:
        return self._dev(h, "ecc_mode")

    def nvmlDeviceGetTotalEccErrors(self, h: int, etype: int, counter: int) -> int:
        ecc = self._dev(h, "ecc")
        if isinstance(ecc, BaseException):
            raise ecc
        key = (
            "uncorrected" if etype == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else "corrected",
            "volatile" if counter == pynvml.NVML_VOLATILE_ECC else "aggregate",
        )
        return self._value(ecc[key])

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        pages = self._dev(h, "retired_pages")
        return pages[cause] if isinstance(pages, dict) else pages

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return self._dev(h, "retired_pending")

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._dev(h, "remapped_rows")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._dev(h, "clock_reasons")

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return self._dev(h, "clock_reasons")

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._dev(h, "temperature")

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._dev(h, "power_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._dev(h, "power_limit_mw")

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._dev(h, "pcie_replays")

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        assert ids == [230]
        ret, value = self._dev(h, "recovery_action")
        return [
            SimpleNamespace(
                nvmlReturn=ret, valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, value=SimpleNamespace(uiVal=value)
            )
        ]
