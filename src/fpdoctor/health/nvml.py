"""Per-GPU health facts from NVML (nvidia-ml-py), read once; NVML never creates a CUDA context.

Each fact is one NVML call (research notes A.1: 2-230 us each, ~20 ms for an 8-GPU node). A call
that raises NotSupported records "not supported" (trusted: retired pages are NotSupported on
H100, which uses row remapping instead); any other NVML error records "not read: <error>". An
NVML *success* is not trusted alone where products are known to answer for hardware they lack:
consumer GPUs return zeros for remapped rows (gpud PR #351), so a row-remapper answer counts only
on products that have one, unless it reports a problem.

The collection runs in a daemon thread with a time limit: a GPU that has fallen off the bus can
make NVML calls hang, and a one-shot health check must still report.
"""

from __future__ import annotations

import contextlib
import re
import threading
from pathlib import Path
from typing import Any

from fpdoctor.health.kernel_log import normalize_pci
from fpdoctor.health.model import NOT_SUPPORTED, RECOVERY_ACTIONS, GpuFacts, reason_names

# Products with a row remapper: gpud pkg/nvidia/product/capabilities.go lists A100, A10, B100, B200,
# GB200, H100 and H200; A10G, A30, A800, H800, H20, GH200, B300 and GB300 share their memory
# subsystem (inferred).
ROW_REMAP_PRODUCTS = re.compile(r"\b(A100|A10G?|A30|A800|H100|H200|H800|H20|GH200|B100|B200|B300|GB200|GB300)\b", re.I)

# NVML's errors (error strings, as nvidia-smi prints them) that say nothing of the GPU itself when
# opening it fails: this process may not open it, or NVML was misused. Any other error opening a
# GPU (Unknown Error, Insufficient Power, IRQ issue, ...) means the GPU is there and unusable.
NOT_ABOUT_THE_GPU = ("Insufficient Permissions", "Uninitialized", "Invalid Argument")
_NOT_ABOUT_THE_GPU_CODES = ("NVML_ERROR_NO_PERMISSION", "NVML_ERROR_UNINITIALIZED", "NVML_ERROR_INVALID_ARGUMENT")

# one directory per GPU the driver registered, named by its bus id, whether NVML can open it or not
DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")

_FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, driver r570+
_VALUE_MEMBER = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}


class _Lost(Exception):
    pass


# where the PCI bus lists its devices: an NVIDIA (vendor 0x10de) VGA or 3D controller is a GPU,
# whether a driver runs it or not (an NVSwitch is a bridge, class 0x0680)
PCI_DEVICES = Path("/sys/bus/pci/devices")
_NVIDIA_VENDOR = "0x10de"
_GPU_CLASSES = ("0x0300", "0x0302")


class NvmlUnavailable(Exception):
    """NVML could not be used at all; the message says why. `no_driver`: there is no NVIDIA driver
    (library absent or kernel module not loaded), so there is no GPU to check either. `unusable`:
    there are GPUs and none can be used (a driver/library version mismatch, a driver not loaded
    while the PCI bus holds NVIDIA GPUs): an error, never 'not checked'."""

    def __init__(self, message: str, *, no_driver: bool = False, unusable: bool = False) -> None:
        super().__init__(message)
        self.no_driver = no_driver
        self.unusable = unusable


def as_text(value: Any) -> str:
    """An NVML string: pynvml returns bytes or str depending on its version."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _Reader:
    """Reads one GPU's facts, classifying each NVML error the same way."""

    def __init__(self, nvml: Any, gpu: GpuFacts) -> None:
        self.nvml, self.gpu = nvml, gpu

    def call(self, key: str, fn: Any, *args: Any) -> Any:
        """fn(*args), or None with the reason recorded under `key` (raises _Lost for a lost GPU)."""
        nvml = self.nvml
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == nvml.NVML_ERROR_GPU_IS_LOST:
                raise _Lost(str(exc)) from exc
            self.gpu.unavailable[key] = NOT_SUPPORTED if code == nvml.NVML_ERROR_NOT_SUPPORTED else f"not read: {exc}"
            return None

    def fact(self, key: str, fn: Any, *args: Any, convert: Any = None) -> None:
        value = self.call(key, fn, *args)
        if value is not None:
            self.gpu.facts[key] = convert(value) if convert else value


def _ecc(r: _Reader, handle: Any) -> None:
    n = r.nvml
    mode = r.call("ecc_mode", n.nvmlDeviceGetEccMode, handle)
    if mode is not None:
        state = {n.NVML_FEATURE_ENABLED: "enabled", n.NVML_FEATURE_DISABLED: "disabled"}
        current, pending = (state.get(m, str(m)) for m in mode[:2])
        r.gpu.facts["ecc_mode"] = {"current": current, "pending": pending}
    counts: dict[str, dict[str, int]] = {}
    for counter, counter_name in ((n.NVML_VOLATILE_ECC, "volatile"), (n.NVML_AGGREGATE_ECC, "aggregate")):
        for etype, etype_name in (
            (n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrected"),
            (n.NVML_MEMORY_ERROR_TYPE_CORRECTED, "corrected"),
        ):
            key = f"ecc.{counter_name}.{etype_name}"
            value = r.call(key, n.nvmlDeviceGetTotalEccErrors, handle, etype, counter)
            if value is not None:
                counts.setdefault(counter_name, {})[etype_name] = int(value)
    if counts:
        r.gpu.facts["ecc"] = counts
    _collapse(
        r.gpu,
        "ecc",
        ("ecc.volatile.uncorrected", "ecc.volatile.corrected", "ecc.aggregate.uncorrected", "ecc.aggregate.corrected"),
    )


def _collapse(gpu: GpuFacts, key: str, parts: tuple[str, ...]) -> None:
    """Parts that all failed the same way are one entry ('ecc: not supported'), not four."""
    reasons = {gpu.unavailable.get(p) for p in parts}
    if len(reasons) == 1 and None not in reasons:
        for p in parts:
            del gpu.unavailable[p]
        gpu.unavailable[key] = reasons.pop()  # type: ignore[assignment]


def _memory_repair(r: _Reader, handle: Any) -> None:
    n, gpu = r.nvml, r.gpu
    dbe = r.call(
        "retired_pages.double_bit",
        n.nvmlDeviceGetRetiredPages,
        handle,
        n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
    )
    sbe = r.call(
        "retired_pages.single_bit",
        n.nvmlDeviceGetRetiredPages,
        handle,
        n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
    )
    pending = r.call("retired_pages.pending", n.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    pages = {
        k: v
        for k, v in (
            ("double_bit", None if dbe is None else len(dbe)),
            ("single_bit", None if sbe is None else len(sbe)),
            ("pending", None if pending is None else bool(pending)),
        )
        if v is not None
    }
    if pages:
        gpu.facts["retired_pages"] = pages
    _collapse(gpu, "retired_pages", ("retired_pages.double_bit", "retired_pages.single_bit", "retired_pages.pending"))

    rows = r.call("remapped_rows", n.nvmlDeviceGetRemappedRows, handle)
    if rows is None:
        return
    corr, unc, is_pending, failure = (int(v) for v in rows)
    facts = {"correctable": corr, "uncorrectable": unc, "pending": bool(is_pending), "failure": bool(failure)}
    if ROW_REMAP_PRODUCTS.search(gpu.name or "") or is_pending or failure or unc:
        gpu.facts["remapped_rows"] = facts
    else:
        gpu.unavailable["remapped_rows"] = (
            f"not trusted: NVML answered, but {gpu.name or 'this GPU'} is not known to have a row remapper "
            "(consumer GPUs answer with zeros)"
        )


def _clock_reasons(r: _Reader, handle: Any) -> None:
    n = r.nvml
    new_name = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
    mask = r.call("clock_event_reasons", new_name or n.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    if mask is None and new_name and "Function Not Found" in r.gpu.unavailable.get("clock_event_reasons", ""):
        del r.gpu.unavailable["clock_event_reasons"]  # a driver from before the rename
        mask = r.call("clock_event_reasons", n.nvmlDeviceGetCurrentClocksThrottleReasons, handle)
    if mask is not None:
        r.gpu.facts["clock_event_reasons"] = reason_names(int(mask))


def _recovery_action(r: _Reader, handle: Any) -> None:
    n = r.nvml
    values = r.call("recovery_action", n.nvmlDeviceGetFieldValues, handle, [_FIELD_RECOVERY_ACTION])
    if values is None:
        return
    v = values[0]
    if v.nvmlReturn != n.NVML_SUCCESS:
        r.gpu.unavailable["recovery_action"] = (
            NOT_SUPPORTED
            if v.nvmlReturn == n.NVML_ERROR_NOT_SUPPORTED
            else f"not read: {n.NVMLError(v.nvmlReturn)} (the field needs driver r570 or later)"
        )
        return
    raw = int(getattr(v.value, _VALUE_MEMBER.get(int(v.valueType), "uiVal")))
    r.gpu.facts["recovery_action"] = RECOVERY_ACTIONS.get(raw, f"unknown ({raw})")


def read_gpu(nvml: Any, index: int, host: str | None, driver: str | None) -> GpuFacts:
    gpu = GpuFacts(index=index, host=host, driver=driver, source="nvml")
    r = _Reader(nvml, gpu)
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as exc:
        _unopened(nvml, gpu, exc)
        return gpu
    try:
        for key, fn in (
            ("name", nvml.nvmlDeviceGetName),
            ("uuid", nvml.nvmlDeviceGetUUID),
            ("serial", nvml.nvmlDeviceGetSerial),
            ("pci", nvml.nvmlDeviceGetPciInfo),
        ):
            value = r.call(key, fn, handle)
            gpu.unavailable.pop(key, None)  # identity is optional, not a health fact
            if value is not None:
                setattr(gpu, key, (normalize_pci(as_text(value.busId)) if key == "pci" else as_text(value)) or None)
        _ecc(r, handle)
        _memory_repair(r, handle)
        _clock_reasons(r, handle)
        r.fact("temperature_c", nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU, convert=int)
        r.fact("power_w", nvml.nvmlDeviceGetPowerUsage, handle, convert=lambda mw: round(mw / 1000, 1))
        r.fact("power_limit_w", nvml.nvmlDeviceGetEnforcedPowerLimit, handle, convert=lambda mw: round(mw / 1000, 1))
        r.fact("pcie_replays", nvml.nvmlDeviceGetPcieReplayCounter, handle, convert=int)
        _recovery_action(r, handle)
    except _Lost as exc:
        gpu.lost = f"NVML: {exc}"
    return gpu


def _unopened(nvml: Any, gpu: GpuFacts, exc: Exception) -> None:
    """Record why NVML could not open the GPU: lost, unreachable, or (this process may not open
    it) its facts not read. nvidia-smi says the same of it: "Unable to determine the device handle"."""
    code = getattr(exc, "value", None)
    said = f"nvmlDeviceGetHandleByIndex({gpu.index}): {exc}"
    if code == nvml.NVML_ERROR_GPU_IS_LOST:
        gpu.lost = f"NVML: {exc}"
    elif code in {getattr(nvml, name, None) for name in _NOT_ABOUT_THE_GPU_CODES}:
        gpu.unavailable["device_handle"] = f"not read: {said}"
    else:
        gpu.unreachable = said


def pci_gpus() -> list[str]:
    """The bus ids of the NVIDIA GPUs on the PCI bus (sysfs), sorted; [] where it cannot be read."""
    found = []
    try:
        for device in PCI_DEVICES.iterdir():
            try:
                vendor = (device / "vendor").read_text().strip().lower()
                if vendor == _NVIDIA_VENDOR and (device / "class").read_text().strip().lower().startswith(_GPU_CLASSES):
                    found.append(normalize_pci(device.name))
            except OSError:
                continue
    except OSError:
        return []
    return sorted(found)


def driver_bus_ids() -> list[str]:
    """The bus ids of the GPUs the driver registered (/proc/driver/nvidia/gpus), sorted; [] when
    there is no such directory."""
    try:
        return sorted(normalize_pci(p.name) for p in DRIVER_GPUS.iterdir())
    except OSError:
        return []


def _bus_ids_of_unopened(gpus: list[GpuFacts]) -> None:
    """Name the GPUs NVML could not open by bus id, from the driver's list: NVML numbers GPUs in the
    order of their bus ids, which the GPUs it did open confirm; without that, none is guessed."""
    if all(g.pci for g in gpus):
        return
    bus_ids = driver_bus_ids()
    if len(bus_ids) != len(gpus) or any(g.pci and g.pci != bus for g, bus in zip(gpus, bus_ids, strict=True)):
        return
    for gpu, bus in zip(gpus, bus_ids, strict=True):
        gpu.pci = gpu.pci or bus


def _collect(nvml: Any, host: str | None) -> tuple[list[GpuFacts], str | None]:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        code = getattr(exc, "value", None)
        if code == nvml.NVML_ERROR_LIBRARY_NOT_FOUND:
            raise NvmlUnavailable(
                "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver here)", no_driver=True
            ) from exc
        if code == nvml.NVML_ERROR_DRIVER_NOT_LOADED:
            on_the_bus = pci_gpus()
            if on_the_bus:
                raise NvmlUnavailable(
                    f"the NVIDIA kernel driver is not loaded, while the PCI bus holds {len(on_the_bus)} NVIDIA "
                    f"GPU(s) ({', '.join(on_the_bus[:8])}{', ...' if len(on_the_bus) > 8 else ''})",
                    unusable=True,
                ) from exc
            raise NvmlUnavailable("NVML not available: the NVIDIA kernel driver is not loaded", no_driver=True) from exc
        if code == getattr(nvml, "NVML_ERROR_LIB_RM_VERSION_MISMATCH", 18):
            raise NvmlUnavailable(
                f"NVML cannot start: {exc} (a driver upgraded without a reboot)", unusable=True
            ) from exc
        raise NvmlUnavailable(f"NVML not available: {exc}") from exc
    try:
        try:
            driver = as_text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            driver = None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML started but could not count the GPUs: {exc}") from exc
        gpus = [read_gpu(nvml, i, host, driver) for i in range(count)]
        _bus_ids_of_unopened(gpus)
        return gpus, driver
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def collect(*, host: str | None = None, nvml: Any = None, timeout_s: float = 20.0) -> tuple[list[GpuFacts], str | None]:
    """(GPUs, driver version) from NVML; raises NvmlUnavailable with the reason when it cannot run.
    `nvml` replaces the pynvml module (tests pass a fake one)."""
    if nvml is None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"NVML not available: nvidia-ml-py is not installed ({exc})") from exc
        nvml = pynvml
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = _collect(nvml, host)
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    worker = threading.Thread(target=run, name="fpdoctor-nvml", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise NvmlUnavailable(f"NVML did not answer within {timeout_s:g} s (a GPU that hangs the driver?)")
    error = result.get("error")
    if isinstance(error, NvmlUnavailable) or (error is not None and not isinstance(error, Exception)):
        raise error
    if error is not None:  # whatever else NVML or an odd answer of it raised: a report, not a traceback
        raise NvmlUnavailable(f"NVML not read: {error} ({type(error).__name__})") from error
    gpus, driver = result["value"]
    return gpus, driver
