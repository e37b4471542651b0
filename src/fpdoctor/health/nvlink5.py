"""NVIDIA's decode table for the NVLink5 Xids 144-150 (fpdoctor/data/xid_nvlink5_decode.csv).

An extended line carries a unit name, Fatal/Nonfatal, the link and two words: `intrinfo` and the
error status. The table matches intrinfo against a 32-bit pattern ('-' = any bit) and the status
against one value per row. NVIDIA changed the intrinfo layout in driver branch R575: the same line
decodes with the V1 patterns before it and the V2 patterns from it on (NVSentinel selects per
message the same way), so a decode without the driver version can be ambiguous and says so.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources

V2_FROM_BRANCH = 575


@dataclass(frozen=True)
class DecodeRow:
    xid: int
    unit: str
    pattern_v1: str
    pattern_v2: str
    error_status: int
    immediate_action: str
    investigatory_action: str
    severity: str  # NVIDIA's: Fatal, Non-fatal, Link Fatal, Fatal**, ...
    hw_sw: str
    effect: str


@functools.cache
def _rows() -> tuple[DecodeRow, ...]:
    with resources.files("fpdoctor.data").joinpath("xid_nvlink5_decode.csv").open(encoding="utf-8") as fh:
        return tuple(
            DecodeRow(
                xid=int(r["xid"]),
                unit=r["unit"],
                pattern_v1=r["intrinfo_pattern_v1"],
                pattern_v2=r["intrinfo_pattern_v2"],
                error_status=int(r["error_status"], 16),
                immediate_action=r["immediate_action"],
                investigatory_action=r["investigatory_action"],
                severity=r["severity"],
                hw_sw=r["hw_sw"],
                effect=r["local_remote_effect"],
            )
            for r in csv.DictReader(fh)
        )


def _bits_match(pattern: str, value: int) -> bool:
    bits = format(value & 0xFFFFFFFF, "032b")[-len(pattern) :]
    return all(p in ("-", b) for p, b in zip(pattern, bits, strict=True))


def sub_code(intrinfo: int) -> int:
    """Bits 20-25 of intrinfo: the NETIR link-event reason in NVIDIA's table."""
    return (intrinfo >> 20) & 0x3F


def table_version(driver: str | None) -> str | None:
    """'v1' before driver branch R575, 'v2' from it on, None when the driver is unknown."""
    if not driver:
        return None
    try:
        branch = int(driver.strip().split(".")[0])
    except ValueError:
        return None
    return "v2" if branch >= V2_FROM_BRANCH else "v1"


def _rank(row: DecodeRow) -> tuple[int, int]:
    """Worse rows sort higher: fatal before non-fatal, a reset before an evaluation before nothing."""
    fatal = 0 if row.severity.lower().startswith("non") else 1
    action = {"RESET_GPU": 2, "XID_154_EVAL": 1}.get(row.immediate_action, 0)
    return fatal, action


def _match(xid: int, unit: str | None, intrinfo: int, status: int, version: str) -> DecodeRow | None:
    candidates = [
        r for r in _rows() if r.xid == xid and _bits_match(r.pattern_v1 if version == "v1" else r.pattern_v2, intrinfo)
    ]
    if unit:
        # the printed unit disambiguates rows whose bit patterns overlap ("NETIR_LINK_EVT/NETIR_LINK_DOWN")
        named = [r for r in candidates if unit in r.unit.split("/")]
        candidates = named or candidates
    exact = [r for r in candidates if r.error_status == status]
    if exact:
        return max(exact, key=_rank)
    # the status is a bit mask: a value with several bits set takes the worst of its bits' rows
    bitwise = [r for r in candidates if r.error_status and status & r.error_status == r.error_status]
    return max(bitwise, key=_rank) if bitwise else None


def _as_dict(row: DecodeRow, version: str) -> dict[str, str]:
    return {
        "unit": row.unit,
        "severity": row.severity,
        "action": row.immediate_action,
        "investigate": row.investigatory_action,
        "cause": row.hw_sw,
        "effect": row.effect,
        "table": version,
    }


def decode(xid: int, unit: str | None, intrinfo: int, status: int, driver: str | None) -> dict[str, object]:
    """NVIDIA's reading of one extended line: unit, severity, action, cause (HW/SW), effect, and
    `table` (v1/v2) with `note` saying how the table was chosen or why nothing matched."""
    version = table_version(driver)
    if version is not None:
        row = _match(xid, unit, intrinfo, status, version)
        if row is None:
            return {"note": f"no row of NVIDIA's {version} decode table (driver {driver}) matches this line"}
        return {**_as_dict(row, version), "note": f"decoded with the {version} table for driver {driver}"}
    rows = {v: _match(xid, unit, intrinfo, status, v) for v in ("v1", "v2")}
    found = {v: r for v, r in rows.items() if r is not None}
    if not found:
        return {"note": "driver version unknown, and no row of either decode table matches this line"}
    if len(found) == 1:
        ((version, row),) = found.items()
        branch = "before R575" if version == "v1" else "R575 and later"
        return {
            **_as_dict(row, version),
            "note": f"driver version unknown; only the {version} table (drivers {branch}) matches this line",
        }
    v1, v2 = found["v1"], found["v2"]
    if (v1.immediate_action, v1.severity) == (v2.immediate_action, v2.severity):
        return {**_as_dict(v1, "v1"), "table": "v1/v2", "note": "driver version unknown; both tables agree"}
    worse = max((v1, v2), key=_rank)
    return {
        **_as_dict(worse, "v1" if worse is v1 else "v2"),
        "note": f"driver version unknown and the tables disagree: v1 (before R575) says {v1.unit} "
        f"{v1.severity}/{v1.immediate_action}, v2 says {v2.unit} {v2.severity}/{v2.immediate_action}; "
        "the worse is shown",
    }
