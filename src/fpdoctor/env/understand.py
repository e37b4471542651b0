"""Values fpdoctor can judge, and the rest: a version it cannot parse is said to be not understood,
left out of every check, and shown shortened (a pasted report can hold anything).

Runs on every input (collect_env, log, facts JSON) before a rule reads it, so a rule only ever
sees a version it understands or None.
"""

from __future__ import annotations

import re
from typing import Any

SHOWN = 48  # characters of a value a report shows before shortening it
LINE_KEPT = 1000  # characters of one input line kept for matching and for the report's facts
TEXT_HEAD, TEXT_TAIL = 32 * 1024, 224 * 1024  # a long log keeps its start and, above all, its end

# PEP 440 as torch releases use it, with the local labels official builds carry (+cu121, +cpu,
# +rocm6.0, +git3749c58, +xpu); "2.3.0+cu12a" is not one of them.
_TORCH = re.compile(
    r"\d{1,3}\.\d{1,3}(?:\.\d{1,4})?(?:(?:a|b|rc)\d{1,6})?(?:\.(?:dev|post)\d{1,12})?"
    r"(?:\+(?:cu\d{3}|cpu|rocm\d{1,2}(?:\.\d{1,2}){0,2}|xpu|(?!cu)[a-z][a-z0-9.]{0,40}|[0-9a-f]{5,40}))?"
)
_DRIVER = re.compile(r"\d{2,4}(?:\.\d{1,3}){1,2}")  # 535.104.05, 442.92, 418.87.00
_CUDA = re.compile(r"\d{1,2}\.\d{1,2}(?:\.\d{1,4}){0,2}")  # 12.1, 11.8.89, 10.1.243


def shorten(value: object, limit: int = SHOWN) -> str:
    """`value` as a report may show it: at most `limit` characters, with its full length."""
    text = str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def _check(
    holder: dict[str, Any] | None, key: str, grammar: re.Pattern[str], label: str, facts: dict[str, Any]
) -> None:
    if not isinstance(holder, dict):
        return
    value = holder.get(key)
    if value is None or (isinstance(value, str) and grammar.fullmatch(value.strip())):
        if isinstance(value, str):
            holder[key] = value.strip()
        return
    holder[key] = None
    holder[f"{key}_not_understood"] = shorten(value)
    facts.setdefault("not_checked", {})[label] = (
        f"{shorten(value)!r} is not understood as a version; checks that need it were not run"
    )


def keep_text(text: str) -> str:
    """An input text as the facts keep it: long lines shortened, a long log cut in the middle."""
    if len(text) > TEXT_HEAD + TEXT_TAIL:
        cut = len(text) - TEXT_HEAD - TEXT_TAIL
        text = f"{text[:TEXT_HEAD]}\n[… {cut:,} characters left out …]\n{text[-TEXT_TAIL:]}"
    if any(len(line) > LINE_KEPT for line in text.split("\n")):
        text = "\n".join(shorten(line, LINE_KEPT) for line in text.split("\n"))
    return text


def understand(facts: dict[str, Any]) -> dict[str, Any]:
    """Replace versions fpdoctor cannot parse by None, and say so in `not_checked`; keep input
    texts to a size a report can carry."""
    facts["texts"] = [keep_text(t) for t in facts.get("texts") or []]
    torch = facts.get("torch")
    _check(torch, "version", _TORCH, "torch version", facts)
    _check(torch, "cuda", _CUDA, "CUDA version torch was built with", facts)
    _check(facts.get("driver"), "version", _DRIVER, "driver version", facts)
    _check(facts.get("driver"), "cuda", _CUDA, "driver's CUDA version", facts)
    _check(facts.get("cuda_toolkit"), "version", _CUDA, "CUDA runtime version", facts)
    for gpu in facts.get("gpus") or []:
        if isinstance(gpu, dict) and isinstance(gpu.get("name"), str) and len(gpu["name"]) > 2 * SHOWN:
            gpu["name"] = shorten(gpu["name"], 2 * SHOWN)
    return facts
