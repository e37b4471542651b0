"""The NVIDIA driver's lines in a kernel log: Xids, GPUs fallen off the bus or never initialised
(RmInitAdapter failed), the bus id -> GPU map.

Every shape seen in real logs parses: dmesg (`[ 1234.5678]`), `dmesg -T`, `dmesg --decode
--time-format iso`, `/dev/kmsg` records, syslog / `journalctl -k` (short, short-iso, with or without
the bracketed uptime), pasted lines with no prefix; the MIG form `Xid (PCI:0000:01:00 GPU-I:05)`,
lines with no comma after the code (`...): 46`), the NVLink5 extended form (`149, NETIR_LINK_EVT
Fatal XC0 i0 Link 08 (0x004505c6 0x00000000 ...)`), and "fallen off the bus" with or without an
Xid, on one line or spread over three. `NVRM: GPU at PCI:...: GPU-<uuid>` lines (and the serial
number the driver prints after them) map bus ids to GPUs.

Parsing returns events; `group` folds them per (bus id, Xid) with count and first/last time, which
is what the report keeps and what `--from` a saved health JSON reads back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from fpdoctor.health import nvlink5

_PCI = r"[0-9a-fA-F]{1,8}:[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?"
_XID = re.compile(
    rf"NVRM: Xid \((?:PCI:)?(?P<pci>{_PCI})(?P<mig>(?:\s+GPU-C?I:\d+)*)\)[^:\n]*:\s*(?P<xid>\d+)\b(?P<rest>.*)"
)
_XID_ANY = re.compile(r"NVRM: Xid\b")
_PID = re.compile(r",?\s*pid=(?:'?<unknown>'?|(?P<pid>\d+))")
_NAME = re.compile(r",?\s*name=(?P<name>[^,]*)")
_MIG = re.compile(r"GPU-(?P<kind>C?I):(?P<id>\d+)")
_NVL5 = re.compile(
    r"(?P<unit>[A-Z][A-Z0-9_]*(?:/[A-Z0-9_]+)?)\s+(?P<sev>Nonfatal|Non-fatal|Fatal)\s+XC(?P<xc>[01])\s+"
    r"i(?P<inst>\d+)\s+Link\s+(?P<link>-?\d+)\s+\((?P<intr>0x[0-9a-fA-F]+)\s+(?P<status>0x[0-9a-fA-F]+)"
)
_RECOVERY = re.compile(r"recovery action changed from (0x[0-9a-fA-F]+)\s*\(([^)]*)\) to (0x[0-9a-fA-F]+)\s*\(([^)]*)\)")
_GPU_AT = re.compile(rf"NVRM: GPU at PCI:(?P<pci>{_PCI}): (?P<uuid>GPU-[0-9a-fA-F-]+)")
_SERIAL = re.compile(r"NVRM: GPU Board Serial Number: (?P<serial>\S+)")
_THE_GPU = re.compile(rf"NVRM: The NVIDIA GPU (?P<pci>{_PCI})")
_GPU_FALLEN = re.compile(rf"NVRM: GPU (?:PCI:)?(?P<pci>{_PCI}): GPU has fallen off the bus")
# the driver could not initialise a GPU (it repeats at every open of the device); old drivers name no bus id
_INIT_FAILED = re.compile(rf"NVRM: (?:GPU (?:PCI:)?(?P<pci>{_PCI}): )?RmInitAdapter failed!")
_DRIVER = re.compile(r"NVRM: loading NVIDIA UNIX .*?Kernel Module(?: for \S+)?\s+(?P<ver>\d+\.\d+(?:\.\d+)?)")
_BOOT = re.compile(r"\bLinux version \d")
_HEADER_ONLY = re.compile(rf"NVRM: The NVIDIA GPU {_PCI}(?: \(PCI ID: [0-9a-fA-F:]+\))?")
_FALLEN = "fallen off the bus"
# What makes a line a kernel message, whatever saved it: a dmesg stamp (`[ 12.3]`, `-T`'s
# `[Wed Jan 27 23:04:35 2021]`, `--decode`'s `kern  :warn  :`, raw `<6>`), a /dev/kmsg record, an
# ISO stamp at the start (`--time-format iso`), or syslog's and the journal's `kernel:`. A text
# with none of them ("dmesg: read kernel buffer failed: Operation not permitted") is no kernel log.
_KERNEL_LINE = re.compile(
    r"^\s*(?:<\d+>)?(?:\[\s*\d+\.\d+\]|\[[A-Z][a-z]{2} [A-Z][a-z]{2}\s+\d{1,2} \d{2}:\d{2}:\d{2} \d{4}\]"
    r"|\d+,\d+,\d+,[^;]*;|\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}"
    r"|(?:kern|user|mail|daemon|auth|syslog|lpr|news|uucp|cron|authpriv|ftp|local[0-7])\s*:\s*[a-z]+\s*:)"
    r"|\skernel:"
)

# timestamp prefixes, searched in the text before "NVRM:"
_KMSG = re.compile(r"^\s*\d+,\d+,(?P<usec>\d+),[^;]*;")
_UPTIME = re.compile(r"\[\s*(?P<s>\d+\.\d+)\]")
_CTIME = re.compile(r"\[(?P<t>[A-Z][a-z]{2} [A-Z][a-z]{2}\s+\d{1,2} \d{2}:\d{2}:\d{2} \d{4})\]")
_ISO = re.compile(r"(?P<t>\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?)")
_SYSLOG = re.compile(r"^\s*(?P<t>[A-Z][a-z]{2}\s+\d{1,2} \d{2}:\d{2}:\d{2})\s+(?P<host>\S+)\s+kernel:")
_HOST = re.compile(r"^\s*(?:\S+|\[\s*\d+\.\d+\])\s+(?P<host>[^\s\[]+)\s+kernel:")


_BUS_ID = re.compile(
    r"(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<device>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?"
)


def normalize_pci(text: str) -> str:
    """Any bus id spelling ('PCI:0000:3b:00', '00000000:3B:00.0', '3b:00.0') -> '0000:3b:00.0'.
    Text that is no bus id comes back as given (stripped): a driver or a saved file with an odd
    spelling still names its GPU, and never stops the report."""
    raw = text.strip()
    m = _BUS_ID.fullmatch(raw.removeprefix("PCI:"))
    if m is None:
        return raw
    domain, bus, device = (int(m[k] or "0", 16) for k in ("domain", "bus", "device"))
    return f"{domain:04x}:{bus:02x}:{device:02x}.{int(m['fn'] or '0')}"


@dataclass(frozen=True)
class Stamp:
    """When a line was logged: seconds since boot and/or a wall-clock text, as the log gave them."""

    uptime: float | None = None
    wall: str | None = None
    boot: int = 0

    def text(self) -> str | None:
        if self.wall:
            return self.wall
        return f"{self.uptime:.6f} s after boot" if self.uptime is not None else None

    def clock(self) -> tuple[str, float] | None:
        """('uptime' | 'wall', seconds) to measure the time between two lines of one log, or None."""
        if self.uptime is not None:
            return "uptime", self.uptime
        if not self.wall:
            return None
        try:
            return "wall", datetime.fromisoformat(self.wall).timestamp()
        except ValueError:
            pass
        try:  # syslog's "Nov 23 09:58:01" has no year: a leap year lets Feb 29 parse
            return "wall", datetime.strptime(f"2000 {self.wall}", "%Y %b %d %H:%M:%S").timestamp()
        except ValueError:
            return None


def _iso(text: str) -> str:
    text = text.replace(",", ".", 1).replace(" ", "T", 1)
    return re.sub(r"([+-]\d{2})(\d{2})$", r"\1:\2", text)


def _prefix_stamp(prefix: str) -> tuple[float | None, str | None, str | None]:
    """(uptime seconds, wall-clock text, host) from the text in front of 'NVRM:'."""
    uptime = wall = host = None
    if m := _KMSG.search(prefix):
        uptime = int(m["usec"]) / 1e6
    if m := _UPTIME.search(prefix):
        uptime = float(m["s"])
    if m := _CTIME.search(prefix):
        try:
            wall = datetime.strptime(m["t"], "%a %b %d %H:%M:%S %Y").isoformat()
        except ValueError:
            wall = m["t"]
    elif m := _ISO.search(prefix):
        wall = _iso(m["t"])
    if m := _SYSLOG.search(prefix):
        wall = wall or " ".join(m["t"].split())  # syslog has no year: kept as printed
        host = m["host"]
    elif m := _HOST.search(prefix):
        host = m["host"]
    return uptime, wall, host


@dataclass
class XidEvent:
    pci: str
    xid: int
    stamp: Stamp
    line_no: int
    message: str  # from "NVRM:" on
    pid: int | None = None
    process: str | None = None
    detail: str = ""
    gpu_instance: int | None = None
    compute_instance: int | None = None
    host: str | None = None
    driver: str | None = None  # from the last 'loading NVIDIA ... Kernel Module' line before it
    nvlink: dict[str, Any] | None = None  # unit, severity, link, intrinfo, status of an extended line
    recovery_to: str | None = None  # Xid 154: the action the driver changed to


@dataclass
class LostEvent:
    pci: str
    stamp: Stamp
    line_no: int
    message: str
    xid: int | None = None
    host: str | None = None


@dataclass
class ParsedLog:
    lines: int = 0
    kernel_lines: int = 0  # lines that are kernel messages (see _KERNEL_LINE), NVIDIA's included
    nvidia_lines: int = 0
    boots: int = 1
    first: Stamp | None = None
    last: Stamp | None = None
    starts_at_boot: bool = False
    xids: list[XidEvent] = field(default_factory=list)
    lost: list[LostEvent] = field(default_factory=list)
    gpu_map: dict[str, dict[str, str]] = field(default_factory=dict)
    drivers: list[str] = field(default_factory=list)
    # (bus id or None, boot, the line from "NVRM:" on): GPUs the driver could not initialise
    init_failed: list[tuple[str | None, int, str]] = field(default_factory=list)
    unreadable: list[tuple[int, str]] = field(default_factory=list)  # Xid lines without a readable code
    truncated: str | None = None  # why the log looks cut off at its end


def _process(rest: str) -> tuple[int | None, str | None, str]:
    pid = name = None
    if m := _PID.match(rest):
        pid = int(m["pid"]) if m["pid"] else None
        rest = rest[m.end() :]
    if m := _NAME.match(rest):
        value = m["name"].strip()
        name = None if value in ("", "<unknown>") else value
        rest = rest[m.end() :]
    return pid, name, rest.lstrip(", ").strip()


def _xid_event(m: re.Match[str], stamp: Stamp, line_no: int, message: str, host: str | None) -> XidEvent:
    pid, process, detail = _process(m["rest"])
    event = XidEvent(
        pci=normalize_pci(m["pci"]),
        xid=int(m["xid"]),
        stamp=stamp,
        line_no=line_no,
        message=message,
        pid=pid,
        process=process,
        detail=detail[:300],
        host=host,
    )
    for mig in _MIG.finditer(m["mig"]):
        if mig["kind"] == "I":
            event.gpu_instance = int(mig["id"])
        else:
            event.compute_instance = int(mig["id"])
    if 144 <= event.xid <= 150 and (x := _NVL5.search(detail)):
        event.nvlink = {
            "unit": x["unit"],
            "line_severity": "Nonfatal" if x["sev"].lower().startswith("non") else "Fatal",
            "link": int(x["link"]),
            "intrinfo": int(x["intr"], 16),
            "error_status": int(x["status"], 16),
        }
    if event.xid == 154 and (r := _RECOVERY.search(detail)):
        event.recovery_to = f"{r[3]} ({r[4]})"
    return event


def parse(lines: Iterable[str]) -> ParsedLog:
    """Scan a kernel log; only lines naming NVRM (and boot markers) are looked at closely."""
    log = ParsedLog()
    driver: str | None = None
    boot, last_uptime = 0, None
    pending: tuple[str, Stamp, int, str, str | None] | None = None  # "The NVIDIA GPU <pci>" awaiting its end
    pending_lines, pending_tail = 0, ""
    last_map_pci: str | None = None
    line_no = 0
    for line_no, raw in enumerate(lines, 1):
        line = raw.rstrip("\r\n")
        log.lines += 1
        if "Linux version" in line and _BOOT.search(line):  # the substring test first: most lines are neither
            if log.lines > 1:
                boot += 1
            else:
                log.starts_at_boot = True
            last_uptime = None
        at = line.find("NVRM:")
        if at < 0:
            if _KERNEL_LINE.search(line):
                log.kernel_lines += 1
            continue
        log.kernel_lines += 1
        log.nvidia_lines += 1
        uptime, wall, host = _prefix_stamp(line[:at])
        if uptime is not None:
            # a grep of several boots has no "Linux version" lines: the uptime going back is the reboot
            if last_uptime is not None and uptime + 1.0 < last_uptime:
                boot += 1
            last_uptime = uptime
        stamp = Stamp(uptime=uptime, wall=wall, boot=boot)
        if log.first is None:
            log.first = stamp
        log.last = stamp
        message = line[at:].strip()

        if pending is not None:
            pending_lines, pending_tail = pending_lines + 1, message
            if _FALLEN in message:
                pci, p_stamp, p_line, p_message, p_host = pending
                log.lost.append(LostEvent(pci, p_stamp, p_line, f"{p_message} ... {message}", host=p_host))
                pending = None
                continue
            if pending_lines >= 3 or message.startswith(("NVRM: Xid", "NVRM: GPU ", "NVRM: The NVIDIA GPU")):
                pending = None  # another message ("... is not supported by the driver"), not a lost GPU

        if m := _XID.search(message):
            event = _xid_event(m, stamp, line_no, message, host)
            event.driver = driver
            log.xids.append(event)
            if event.xid == 79:
                log.lost.append(LostEvent(event.pci, stamp, line_no, message, xid=79, host=host))
        elif _XID_ANY.search(message):
            log.unreadable.append((line_no, message[:200]))
        elif m := _GPU_AT.search(message):
            last_map_pci = normalize_pci(m["pci"])
            log.gpu_map.setdefault(last_map_pci, {})["uuid"] = m["uuid"]
        elif (m := _SERIAL.search(message)) and last_map_pci:
            log.gpu_map[last_map_pci]["serial"] = m["serial"]
        elif m := _INIT_FAILED.search(message):
            log.init_failed.append((normalize_pci(m["pci"]) if m["pci"] else None, boot, message[:300]))
        elif m := _GPU_FALLEN.search(message):
            log.lost.append(LostEvent(normalize_pci(m["pci"]), stamp, line_no, message, host=host))
        elif m := _THE_GPU.search(message):
            if _FALLEN in message:
                log.lost.append(LostEvent(normalize_pci(m["pci"]), stamp, line_no, message, host=host))
            else:
                pending = (normalize_pci(m["pci"]), stamp, line_no, message, host)
                pending_lines, pending_tail = 0, message
        elif m := _DRIVER.search(message):
            driver = m["ver"]
            if driver not in log.drivers:
                log.drivers.append(driver)
    log.boots = boot + 1
    # the driver's three lines end "installed in this system has" / "fallen off the bus ...": a log that
    # stops in between was cut, not a different message
    tail = pending_tail.strip()
    if pending is not None and (tail.endswith((" has", " this", " system")) or _HEADER_ONLY.fullmatch(tail)):
        log.truncated = f"line {pending[2]} begins a 'The NVIDIA GPU {pending[0]}' message that the log cuts off"
    elif log.unreadable and log.unreadable[-1][0] == line_no:
        log.truncated = f"the last line is an Xid line cut off before its code: {log.unreadable[-1][1]!r}"
    return log


@dataclass
class XidGroup:
    """One Xid on one GPU, over the whole log: what the report keeps and findings are made from."""

    pci: str
    xid: int
    count: int
    first_seen: str | None
    last_seen: str | None
    boots: list[int]
    pids: list[int] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)
    gpu_instances: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    line: str = ""  # the first occurrence, from "NVRM:" on
    details: list[str] = field(default_factory=list)  # up to 3 distinct details
    nvlink: list[dict[str, Any]] = field(default_factory=list)  # decoded extended lines, distinct
    recovery_to: str | None = None
    episodes: int | None = None  # separate occurrences (see `episodes`); None in files written before it
    # the last boot the log shows: events only in boots before it are history, not the GPU's state
    # now; None in files written before it was kept (every event is then taken as current)
    current_boot: int | None = None

    def history(self) -> bool:
        """Whether every event of the group came in a boot before the log's last one."""
        return self.current_boot is not None and bool(self.boots) and max(self.boots) < self.current_boot

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], "")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> XidGroup:
        names = set(cls.__dataclass_fields__)
        missing = {"pci", "xid", "count"} - set(d)
        if missing:
            raise ValueError(f"an Xid entry lacks {', '.join(sorted(missing))}")
        values = {k: v for k, v in d.items() if k in names}
        values.setdefault("first_seen", None)
        values.setdefault("last_seen", None)
        values.setdefault("boots", [0])
        group = cls(**values)
        if not isinstance(group.xid, int) or not isinstance(group.count, int) or not isinstance(group.pci, str):
            raise ValueError("an Xid entry needs an integer xid and count and a bus id string")
        return group


_LISTED = 20  # pids and process names kept per group: enough to see who, bounded for a flood of Xids
# One fault logs all its lines within about a second (an Xid 13 names every SM it hit); the same Xid
# more than a minute later is another occurrence.
EPISODE_GAP_S = 60.0


def episodes(events: list[XidEvent] | list[LostEvent]) -> int:
    """How many separate times the events happened: a new boot, or a line more than EPISODE_GAP_S
    after the first line of the current occurrence, starts another. Lines without a usable
    timestamp join the occurrence before them (uncertainty never inflates the count)."""
    count, boot = 0, None
    start: tuple[str, float] | None = None
    for e in events:
        now = e.stamp.clock()
        if boot != e.stamp.boot:
            count, boot, start = count + 1, e.stamp.boot, now
        elif now is None:
            continue
        elif start is None:
            start = now
        elif start[0] == now[0] and abs(now[1] - start[1]) > EPISODE_GAP_S:
            count, start = count + 1, now
    return count


def _unique(values: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(v for v in values if v is not None))


def group(
    events: list[XidEvent], *, driver: str | None = None, boot_offset: int = 0, boots: int | None = None
) -> list[XidGroup]:
    """Fold events per (bus id, Xid), in order of first appearance; NVLink5 lines are decoded with the
    driver the log names before them, else `driver` (from NVML or nvidia-smi). `boots`: how many
    boots the log shows (ParsedLog.boots), so each group knows which boot is the current one."""
    by_key: dict[tuple[str, int], list[XidEvent]] = {}
    for e in events:
        by_key.setdefault((e.pci, e.xid), []).append(e)
    groups = []
    for (pci, xid), evs in by_key.items():
        decoded: dict[tuple[Any, ...], dict[str, Any]] = {}
        for e in evs:
            if e.nvlink is None:
                continue
            nv = e.nvlink
            key = (nv["unit"], nv["link"], nv["intrinfo"], nv["error_status"], e.driver or driver)
            if key in decoded:
                decoded[key]["count"] += 1
                continue
            decoded[key] = {
                **{k: nv[k] for k in ("unit", "line_severity", "link")},
                "intrinfo": f"0x{nv['intrinfo']:08x}",
                "error_status": f"0x{nv['error_status']:08x}",
                "sub_code": nvlink5.sub_code(nv["intrinfo"]),
                "decode": nvlink5.decode(xid, nv["unit"], nv["intrinfo"], nv["error_status"], e.driver or driver),
                "count": 1,
            }
        groups.append(
            XidGroup(
                pci=pci,
                xid=xid,
                count=len(evs),
                first_seen=evs[0].stamp.text(),
                last_seen=evs[-1].stamp.text(),
                boots=_unique(e.stamp.boot + boot_offset for e in evs),
                pids=_unique(e.pid for e in evs)[:_LISTED],
                processes=_unique(e.process for e in evs)[:_LISTED],
                gpu_instances=_unique(e.gpu_instance for e in evs),
                hosts=_unique(e.host for e in evs),
                line=evs[0].message[:400],
                details=_unique(e.detail for e in evs if e.detail)[:3],
                nvlink=list(decoded.values()),
                recovery_to=next((e.recovery_to for e in reversed(evs) if e.recovery_to), None),
                episodes=episodes(evs),
                current_boot=None if boots is None else boot_offset + boots - 1,
            )
        )
    return groups
