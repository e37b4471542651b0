"""The health facts: per GPU what NVML or `nvidia-smi -q` said, and what the kernel log said.

Plain data that round-trips through JSON (`fpdoctor health -o facts.json`, then `--from` it on
another machine). A fact that could not be read is never a default: it is absent from `facts` and
its reason is in `unavailable` ("not supported", "not read: <why>"), so nothing unread is
mistaken for healthy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fpdoctor.health import schema
from fpdoctor.health.kernel_log import XidGroup

NOT_SUPPORTED = "not supported"

# NVML clocks-event (throttle) reason bits, nvmlClocksEventReason* in nvidia-ml-py, and the labels
# `nvidia-smi -q` prints for them.
CLOCK_REASONS = {
    0x1: ("gpu_idle", "Idle"),
    0x2: ("applications_clocks_setting", "Applications Clocks Setting"),
    0x4: ("sw_power_cap", "SW Power Cap"),
    0x8: ("hw_slowdown", "HW Slowdown"),
    0x10: ("sync_boost", "Sync Boost"),
    0x20: ("sw_thermal_slowdown", "SW Thermal Slowdown"),
    0x40: ("hw_thermal_slowdown", "HW Thermal Slowdown"),
    0x80: ("hw_power_brake_slowdown", "HW Power Brake Slowdown"),
    0x100: ("display_clock_setting", "Display Clock Setting"),
}
# what slows a busy GPU down against its will; a power cap under load and an idle GPU are normal
SLOWDOWN_REASONS = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")

# NVML_GPU_RECOVERY_ACTION_* (driver r570+), in words
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}


def reason_names(mask: int) -> list[str]:
    return [name for bit, (name, _) in CLOCK_REASONS.items() if mask & bit]


@dataclass
class GpuFacts:
    """One GPU. `facts` keys: ecc_mode, ecc, retired_pages, remapped_rows, clock_event_reasons,
    temperature_c, power_w, power_limit_w, pcie_replays, recovery_action (see health/nvml.py)."""

    index: int | None = None
    pci: str | None = None
    uuid: str | None = None
    serial: str | None = None
    name: str | None = None
    host: str | None = None
    driver: str | None = None
    source: str = ""
    lost: str | None = None  # why NVML considers the GPU lost
    # the line in which nvidia-smi or NVML says it cannot open the GPU ("Unable to determine the
    # device handle for GPU ...: Unknown Error"): the GPU is there but nothing can use it
    unreachable: str | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)

    def label(self) -> str:
        """'GPU 3 (0000:52:00.0, NVIDIA H100 80GB HBM3, GPU-509665ad-..., serial 1654922001234)': what
        a person needs to find it. Bus ids repeat across nodes; the UUID names the GPU anywhere and
        the board serial is what a replacement (RMA) asks for."""
        head = f"GPU {self.index}" if self.index is not None else "GPU"
        serial = f"serial {self.serial}" if self.serial else None
        inner = ", ".join(x for x in (self.pci, self.name, self.uuid, serial) if x)
        return f"{head} ({inner})" if inner else head

    def where(self) -> dict[str, Any]:
        """The hardware `where` (ARCHITECTURE.md): pci, host, and the GPU's NVML index and UUID (the keys the
        fingerprint findings use too); unknown keys left out."""
        where = {"pci": self.pci, "host": self.host, "index": self.index, "uuid": self.uuid}
        return {k: v for k, v in where.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "", {}) or k == "facts"}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuFacts:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class LostGpu:
    """A GPU the kernel log or NVML reports gone from the bus."""

    pci: str
    via: str  # "kernel log message", "Xid 79", "NVML"
    first_seen: str | None = None
    line: str = ""
    count: int = 1  # separate times: the driver's two or three lines of one loss are one
    boots: list[int] = field(default_factory=list)  # the kernel log's boots it was seen in
    current_boot: int | None = None  # the log's last boot (see XidGroup.current_boot)

    def history(self) -> bool:
        """Whether the GPU fell off the bus only in boots before the log's last one."""
        return self.current_boot is not None and bool(self.boots) and max(self.boots) < self.current_boot

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "", [])}


@dataclass
class HealthFacts:
    host: str | None = None
    driver: str | None = None
    gpus: list[GpuFacts] = field(default_factory=list)
    xids: list[XidGroup] = field(default_factory=list)
    lost: list[LostGpu] = field(default_factory=list)
    kernel_logs: list[dict[str, Any]] = field(default_factory=list)  # each log read: source, lines, window
    sources: dict[str, str] = field(default_factory=dict)  # what was read, in words
    not_checked: dict[str, str] = field(default_factory=dict)  # what could not be, and why
    notes: list[str] = field(default_factory=list)
    # what says the driver sees no GPU where there should be some (nvidia-smi's "No devices were
    # found"), in words; None when nothing says so
    no_gpu: str | None = None
    # why this machine has no NVIDIA driver (no libnvidia-ml, no kernel module), when it has none
    no_driver: str | None = None

    def gpu_for(self, pci: str | None) -> GpuFacts | None:
        return next((g for g in self.gpus if pci and g.pci == pci), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "driver": self.driver,
            "gpus": [g.to_dict() for g in self.gpus],
            "xids": [x.to_dict() for x in self.xids],
            "lost": [x.to_dict() for x in self.lost],
            "kernel_logs": self.kernel_logs,
            "sources": self.sources,
            "not_checked": self.not_checked,
            "notes": self.notes,
            **({"no_gpu": self.no_gpu} if self.no_gpu else {}),
            **({"no_driver": self.no_driver} if self.no_driver else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HealthFacts:
        """Read back `to_dict`; ValueError naming the field when a value has the wrong kind (health/schema.py)."""
        schema.check(d)
        lost_fields = set(LostGpu.__dataclass_fields__)
        return cls(
            host=d.get("host"),
            driver=d.get("driver"),
            gpus=[GpuFacts.from_dict(g) for g in d.get("gpus", [])],
            xids=[XidGroup.from_dict(x) for x in d.get("xids", [])],
            lost=[LostGpu(**{k: v for k, v in x.items() if k in lost_fields}) for x in d.get("lost", [])],
            kernel_logs=[dict(k) for k in d.get("kernel_logs") or []],
            sources=dict(d.get("sources") or {}),
            not_checked=dict(d.get("not_checked") or {}),
            notes=list(d.get("notes") or []),
            no_gpu=d.get("no_gpu"),
            no_driver=d.get("no_driver"),
        )
