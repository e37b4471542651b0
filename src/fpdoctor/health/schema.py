"""What health facts JSON may hold, checked when `--from` reads it back.

The findings and the table read these values as written by `fpdoctor health` (health/nvml.py,
health/smi.py, health/kernel_log.py). A file edited by hand or written by another tool can hold
a string where a count belongs; it is refused on load with the field's path ("gpus[0].facts.ecc
must be an object, got a string"), so the user gets one line and exit 2 instead of a traceback
from deep in a rule. Keys fpdoctor does not know are left alone: a newer file still reads.
"""

from __future__ import annotations

import math
from typing import Any

# leaf kinds
INT, NUMBER, BOOL, TEXT = "an integer", "a number", "true or false", "a string"
OPTIONAL_TEXT = "a string or null"


class ListOf:
    def __init__(self, item: Any) -> None:
        self.item = item


class Fields:
    """An object whose listed keys, when present, hold the given kinds; `required` keys must be present."""

    def __init__(self, fields: dict[str, Any], *, required: tuple[str, ...] = ()) -> None:
        self.fields, self.required = fields, required


class MapOf:
    """An object whose every value has one kind (names -> reasons)."""

    def __init__(self, value: Any) -> None:
        self.value = value


_COUNTS = Fields(
    {
        "uncorrected": INT,
        "corrected": INT,
        "sram_uncorrected": INT,
        "dram_uncorrected": INT,
        "sram_corrected": INT,
        "dram_corrected": INT,
        "sram_threshold_exceeded": BOOL,
    }
)

GPU_FACTS = Fields(
    {
        "ecc_mode": Fields({"current": TEXT, "pending": TEXT}),
        "ecc": Fields({"volatile": _COUNTS, "aggregate": _COUNTS}),
        "retired_pages": Fields({"double_bit": INT, "single_bit": INT, "pending": BOOL}),
        "remapped_rows": Fields({"correctable": INT, "uncorrectable": INT, "pending": BOOL, "failure": BOOL}),
        "memory_repair": Fields(
            {"channel_repair_pending": BOOL, "tpc_repair_pending": BOOL, "unrepairable_memory": BOOL}
        ),
        "clock_event_reasons": ListOf(TEXT),
        "temperature_c": NUMBER,
        "power_w": NUMBER,
        "power_limit_w": NUMBER,
        "pcie_replays": INT,
        "recovery_action": TEXT,
    }
)

GPU = Fields(
    {
        "index": INT,
        **{
            k: OPTIONAL_TEXT
            for k in ("pci", "uuid", "serial", "name", "host", "driver", "source", "lost", "unreachable")
        },
        "facts": GPU_FACTS,
        "unavailable": MapOf(TEXT),
    }
)

_NVLINK_DECODE = Fields({k: TEXT for k in ("unit", "severity", "action", "cause", "investigate", "note", "table")})

XID = Fields(
    {
        "pci": TEXT,
        "xid": INT,
        "count": INT,
        "first_seen": OPTIONAL_TEXT,
        "last_seen": OPTIONAL_TEXT,
        "boots": ListOf(INT),
        "episodes": INT,
        "pids": ListOf(INT),
        "processes": ListOf(TEXT),
        "gpu_instances": ListOf(INT),
        "hosts": ListOf(TEXT),
        "line": TEXT,
        "details": ListOf(TEXT),
        "nvlink": ListOf(
            Fields(
                {"unit": TEXT, "line_severity": TEXT, "link": INT, "count": INT, "decode": _NVLINK_DECODE},
                required=("unit", "line_severity", "link"),
            )
        ),
        "recovery_to": OPTIONAL_TEXT,
        "current_boot": INT,
    },
    required=("pci", "xid", "count"),
)

LOST = Fields(
    {
        "pci": TEXT,
        "via": TEXT,
        "first_seen": OPTIONAL_TEXT,
        "line": TEXT,
        "count": INT,
        "boots": ListOf(INT),
        "current_boot": INT,
    },
    required=("pci", "via"),
)

HEALTH_FACTS = Fields(
    {
        "host": OPTIONAL_TEXT,
        "driver": OPTIONAL_TEXT,
        "gpus": ListOf(GPU),
        "xids": ListOf(XID),
        "lost": ListOf(LOST),
        "kernel_logs": ListOf(Fields({"source": TEXT, "lines": INT, "nvidia_lines": INT, "xid_lines": INT})),
        "sources": MapOf(TEXT),
        "not_checked": MapOf(TEXT),
        "notes": ListOf(TEXT),
        "no_gpu": OPTIONAL_TEXT,
        "no_driver": OPTIONAL_TEXT,
    },
    required=("gpus",),
)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {value[:40]!r}"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def _leaf_ok(kind: str, value: Any) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == OPTIONAL_TEXT:
        return value is None or isinstance(value, str)
    return isinstance(value, str)


def check(value: Any, spec: Any = HEALTH_FACTS, path: str = "") -> None:
    """Raise ValueError naming the first field of `value` that does not have the kind `spec` says."""
    where = path or "the facts"
    if isinstance(spec, Fields):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {_json_type(value)}")
        for key in spec.required:
            if key not in value:
                raise ValueError(f"{where} lacks '{key}'")
        for key, sub in spec.fields.items():
            if key in value:
                check(value[key], sub, f"{path}.{key}" if path else key)
    elif isinstance(spec, ListOf):
        if not isinstance(value, list):
            raise ValueError(f"{where} must be a list, got {_json_type(value)}")
        for i, item in enumerate(value):
            check(item, spec.item, f"{path}[{i}]")
    elif isinstance(spec, MapOf):
        if not isinstance(value, dict):
            raise ValueError(f"{where} must be an object, got {_json_type(value)}")
        for key, item in value.items():
            check(item, spec.value, f"{path}.{key}")
    elif not _leaf_ok(spec, value):
        raise ValueError(f"{where} must be {spec}, got {_json_type(value)}")
