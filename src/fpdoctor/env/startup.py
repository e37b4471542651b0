"""The start-up facts read as sentences: what ran before the program's first line (the
`startup` facts of env/sources/startup.py) and the ops it registered with torch's dispatcher (the
torch child's `registrations`). The summary, `env --diff`'s table and the start-up rule all say
them alike."""

from __future__ import annotations

import os
from typing import Any

from fpdoctor.env.facts import Facts

_DONE = {"defines": "defined", "overrides": "kernel overridden", "adds": "kernel added"}


def registrations(facts: Facts) -> list[dict[str, Any]] | None:
    """The ops and kernels registered outside torch before the first line; None where unknown."""
    found = facts.torch.get("registrations")
    return found if isinstance(found, list) else None


def by_whom(entry: dict[str, Any]) -> str:
    """'sitecustomize (/etc/python/sitecustomize.py:5)'; the file alone where no module holds it."""
    where = f"{entry.get('file')}:{entry.get('line')}" if entry.get("line") else str(entry.get("file"))
    return f"{entry['module']} ({where})" if entry.get("module") else where


def registration_text(entry: dict[str, Any], *, where: bool = True) -> str:
    """'aten::exp: CPU kernel overridden by sitecustomize (...:5)', 'myns::scale defined by ...'."""
    key = f"{entry['key']} " if entry.get("key") else ""
    done = _DONE.get(str(entry.get("kind")), str(entry.get("kind")))
    who = by_whom(entry) if where else entry.get("module") or os.path.basename(str(entry.get("file")))
    return f"{entry['op']}: {key}{done} by {who}" if key else f"{entry['op']} {done} by {who}"


def torch_ops_changed(facts: Facts) -> list[dict[str, Any]]:
    """Kernels registered outside torch on ops torch defined (aten::exp's CPU kernel replaced, a
    kernel added for a key torch left to a fallback): every call of such an op runs that code."""
    found = registrations(facts) or []
    foreign = {e["op"] for e in found if e.get("kind") == "defines"}
    return [e for e in found if e.get("kind") in ("overrides", "adds") and e["op"] not in foreign]


def hooks_text(startup: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) rows for the summary: the customize modules, the .pth files that run code,
    the preloaded libraries."""
    rows = []
    for m in startup.get("customize") or []:
        state = "" if m.get("loaded") else " (not loaded by this start)"
        rows.append((m["module"], f"{m['path']}{state}"))
    pth = startup.get("pth") or []
    running = [p for p in pth if p.get("executes")]
    if pth:
        text = f"{len(pth)} file(s), {len(running)} running code at every start"
        if running:
            text += ": " + "; ".join(
                f"{os.path.basename(p['path'])} ({' / '.join(p.get('code') or [])})" for p in running
            )
        rows.append((".pth files", text))
    preload = startup.get("preload") or []
    if preload:
        rows.append(("preloaded libraries", ", ".join(f"{p['path']} ({p['source']})" for p in preload)))
    return rows
