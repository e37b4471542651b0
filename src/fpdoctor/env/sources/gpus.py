"""GPUs and the driver, through NVML (nvidia-ml-py), with nvidia-smi as the fallback.

NVML talks to the kernel driver directly and never creates a CUDA context, so it is safe in the
caller's process (ARCHITECTURE.md, contract 3); nvidia-smi is the same library behind a command line.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from typing import Any

from fpdoctor.env.sources import NotChecked


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def from_nvml() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError as exc:
        raise NotChecked(f"nvidia-ml-py is not installed ({exc})") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise NotChecked(f"NVML could not start: {exc}") from exc
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = None
        try:
            raw = int(pynvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12020 -> "12.2"
            cuda = f"{raw // 1000}.{raw % 1000 // 10}"
        except pynvml.NVMLError:
            pass
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)), "source": "nvml"}
            for key, fn in (
                ("uuid", lambda h=handle: _text(pynvml.nvmlDeviceGetUUID(h))),
                ("pci_bus_id", lambda h=handle: _text(pynvml.nvmlDeviceGetPciInfo(h).busId)),
                ("memory_mib", lambda h=handle: int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // 2**20),
                ("compute_capability", lambda h=handle: "{}.{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(h))),
            ):
                try:
                    gpu[key] = fn()
                except pynvml.NVMLError:
                    gpu[key] = None
            gpus.append(gpu)
        return {"driver": {"version": driver, "cuda": cuda, "source": "nvml"}, "gpus": gpus}
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


_QUERY = "index,name,compute_cap,memory.total,uuid,pci.bus_id,driver_version"


def from_nvidia_smi() -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise NotChecked("nvidia-smi not found on PATH")

    def query(fields: list[str]) -> subprocess.CompletedProcess[str]:
        argv = [exe, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)

    fields = _QUERY.split(",")
    proc = query(fields)
    if proc.returncode != 0:
        # Drivers before ~510 do not know compute_cap; ask again without it.
        fields = [f for f in fields if f != "compute_cap"]
        proc = query(fields)
    if proc.returncode != 0:
        raise NotChecked(f"nvidia-smi failed: {(proc.stderr or proc.stdout).strip()[:200]}")
    return parse_nvidia_smi_csv(proc.stdout, fields)


def parse_nvidia_smi_csv(text: str, fields: list[str]) -> dict[str, Any]:
    gpus, driver = [], None
    for line in text.strip().splitlines():
        values = dict(zip(fields, (v.strip() for v in line.split(",")), strict=False))
        driver = values.get("driver_version") or driver
        memory = values.get("memory.total", "")
        gpus.append(
            {
                "index": int(values["index"]),
                "name": values["name"],
                "compute_capability": values.get("compute_cap") or None,
                "memory_mib": int(memory) if memory.isdigit() else None,
                "uuid": values.get("uuid"),
                "pci_bus_id": values.get("pci.bus_id"),
                "source": "nvidia-smi",
            }
        )
    return {"driver": {"version": driver, "cuda": None, "source": "nvidia-smi"}, "gpus": gpus}


def collect() -> tuple[dict[str, Any], dict[str, str]]:
    """GPUs and driver from the first source that works; reasons for the ones that did not."""
    not_checked: dict[str, str] = {}
    for name, fn in (("nvml", from_nvml), ("nvidia-smi", from_nvidia_smi)):
        try:
            return fn(), not_checked
        except NotChecked as exc:
            not_checked[name] = str(exc)
        except (OSError, subprocess.SubprocessError) as exc:
            not_checked[name] = f"{type(exc).__name__}: {exc}"
    return {"driver": None, "gpus": []}, not_checked
