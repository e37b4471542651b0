"""Reading `--from FILE`: a saved kernel log, `nvidia-smi -q` output or health facts JSON.

Bad input is refused with one line that says what is wrong and what to give instead: a missing,
empty, binary or truncated file (cut JSON, a damaged gzip, a log that stops inside an NVIDIA
message), a JSON that is not health facts. `-` reads standard input.
"""

from __future__ import annotations

import gzip
import json
import re
import sys
import zlib
from pathlib import Path
from typing import Any

from fpdoctor.errors import InputError
from fpdoctor.health import smi
from fpdoctor.health.model import HealthFacts

WHAT = "give a saved kernel log (dmesg, journalctl -k), `nvidia-smi -q` output or the JSON of `fpdoctor health`"


def read_text(path: str) -> str:
    name = "standard input" if path == "-" else path
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path} does not exist; {WHAT}") from None
    except IsADirectoryError:
        raise InputError(f"{path} is a directory; {WHAT}") from None
    except OSError as exc:
        raise InputError(f"{path} cannot be read ({exc.strerror or exc}); {WHAT}") from None
    if data[:2] == b"\x1f\x8b":  # a gzipped log, e.g. nvidia-bug-report.log.gz
        try:
            data = gzip.decompress(data)
        except (EOFError, OSError, zlib.error):
            raise InputError(f"{name} is a truncated or damaged gzip file; save it again") from None
    if not data.strip():
        raise InputError(f"{name} is empty; {WHAT}")
    head = data[:65536]
    text = data.decode("utf-8", errors="replace")
    if b"\x00" in head or text[:65536].count("\ufffd") > max(8, len(head) // 100):
        raise InputError(f"{name} is binary, not text; {WHAT}")
    return text


def kind(text: str) -> str:
    """'json', 'smi' (nvidia-smi -q), 'smi+kernel' (a bug report holding both) or 'kernel'."""
    head = text.lstrip()
    # "[" also opens a dmesg line ("[ 1843.308145] NVRM: ..."); JSON's "[" is followed by a value
    if head[:1] == "{" or re.match(r"\[\s*[\[{\]\"]", head):
        return "json"
    if smi.looks_like_smi(text):
        return "smi+kernel" if "NVRM:" in text else "smi"
    return "kernel"


def load_json(text: str, name: str) -> HealthFacts:
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{name} is not complete JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); was it cut off?"
        ) from None
    if isinstance(obj, dict) and str(obj.get("schema", "")).startswith("fpdoctor.report/"):
        if obj.get("command") != "health":
            raise InputError(f"{name} is a report of `fpdoctor {obj.get('command')}`, not of `fpdoctor health`; {WHAT}")
        obj = (obj.get("data") or {}).get("facts")
    if not isinstance(obj, dict) or "gpus" not in obj:
        raise InputError(f"{name} is JSON but not fpdoctor health facts; {WHAT}")
    if isinstance(obj.get("driver"), dict):
        raise InputError(f"{name} holds `fpdoctor env` facts; use `fpdoctor env --from {name}`, or {WHAT}")
    try:
        return HealthFacts.from_dict(obj)
    except (TypeError, ValueError, AttributeError) as exc:
        raise InputError(
            f"{name} has malformed health facts ({exc}); give the JSON as `fpdoctor health -o FILE` wrote it"
        ) from None
