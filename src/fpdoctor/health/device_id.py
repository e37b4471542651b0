"""Who a fingerprint came from, and what must match for two fingerprints to be bitwise comparable.

Runs in the fingerprint child next to the GEMMs. For a GPU: torch's device properties (name, SM
count, UUID, PCI bus id), NVML for what torch does not say (driver, MIG profile, the index
nvidia-smi shows), and the cuBLAS that is actually loaded in this process. For a CPU: the model,
the ISA torch dispatches to and the thread count, which decide the CPU kernels' blocking.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import socket
from typing import Any

import torch

from fpdoctor.health.nvml import as_text


def describe(device: torch.device) -> dict[str, Any]:
    """Identity facts of `device`; unknown ones are None."""
    base: dict[str, Any] = {"host": socket.gethostname(), "device": str(device), "torch": torch.__version__}
    if device.type != "cuda":
        return {**base, "kind": "cpu", "name": cpu_model(), "threads": torch.get_num_threads(), "isa": _cpu_isa()}
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", "") or "") or None
    if uuid and not uuid.startswith(("GPU-", "MIG-")):
        uuid = f"GPU-{uuid}"
    pci = None
    bus: list[Any] = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if None not in bus:  # torch >= 2.5; NVML fills it in otherwise
        pci = "{:08X}:{:02X}:{:02X}.0".format(*bus)  # NVML's busId format
    info = {
        **base,
        "kind": "cuda",
        "cuda_index": index,
        "index": index,
        "name": props.name,
        "sm_count": props.multi_processor_count,
        "capability": f"{props.major}.{props.minor}",
        "uuid": uuid,
        "pci": pci,
        "mig": None,
        "driver": None,
        "cuda": torch.version.cuda,
    }
    info.update({k: v for k, v in _nvml(uuid).items() if v is not None})
    return info


def _nvml(uuid: str | None) -> dict[str, Any]:
    """NVML facts for the GPU with `uuid` (NVML never creates a CUDA context); {} when unavailable."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver: torch's facts stand alone
        return {}
    facts: dict[str, Any] = {}
    try:
        with contextlib.suppress(pynvml.NVMLError):
            facts["driver"] = as_text(pynvml.nvmlSystemGetDriverVersion())
        if not uuid:
            return facts
        handle = None
        for candidate in (uuid, uuid.replace("GPU-", "MIG-", 1)):
            with contextlib.suppress(pynvml.NVMLError):
                handle = pynvml.nvmlDeviceGetHandleByUUID(candidate.encode())
                facts["uuid"] = candidate
                break
        if handle is None:
            return facts
        with contextlib.suppress(pynvml.NVMLError):
            if pynvml.nvmlDeviceIsMigDeviceHandle(handle):
                facts["mig"] = as_text(pynvml.nvmlDeviceGetName(handle))  # e.g. "... MIG 1g.10gb"
                handle = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
        with contextlib.suppress(pynvml.NVMLError):
            facts["index"] = int(pynvml.nvmlDeviceGetIndex(handle))  # the index nvidia-smi shows
        with contextlib.suppress(pynvml.NVMLError):
            facts["pci"] = as_text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        return facts
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def cublas_version() -> str | None:
    """Version of the libcublas mapped into this process (after a GEMM loaded it), e.g. "12.8.4"."""
    path = _mapped("libcublas.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: dlopen returns the same handle
        parts = []
        for prop in (0, 1, 2):  # libraryPropertyType: MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
    except (OSError, AttributeError):
        return None
    return ".".join(parts)


def _mapped(stem: str) -> str | None:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(None, 5)[-1]
                if path.rsplit("/", 1)[-1].startswith(stem):
                    return path
    except OSError:
        return None
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_isa() -> str | None:
    with contextlib.suppress(AttributeError, RuntimeError):
        return str(torch.backends.cpu.get_cpu_capability())
    return None
