"""Strict JSON for the tests: a report's JSON must be standard (RFC 8259), so NaN/Infinity fail."""

from __future__ import annotations

import json
from typing import Any


def _refuse(constant: str) -> Any:
    raise ValueError(f"non-standard JSON constant {constant}")


def strict_json(text: str) -> Any:
    return json.loads(text, parse_constant=_refuse)
