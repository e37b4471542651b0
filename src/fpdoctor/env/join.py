"""Several inputs about one machine (a collect_env report, the crash log, nvidia-smi output)
joined into one facts dict: each fills what the others did not show.

The input that states the most (facts JSON, then collect_env, then a log) leads; a later input
adds what is missing and never overrides a stated value. Two inputs that state different torch
or driver versions describe different machines, and are refused.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from fpdoctor.env.understand import shorten
from fpdoctor.errors import InputError

_RANK = {"live": 0, "facts": 0, "collect_env": 1, "log": 2}


def _conflict(a: dict[str, Any], b: dict[str, Any], what: str, get: Any) -> None:
    va, vb = get(a), get(b)
    if va and vb and str(va).strip() != str(vb).strip():
        raise InputError(
            f"{a['origin'].get('path')} and {b['origin'].get('path')} describe different machines "
            f"({what} {shorten(va)} vs {shorten(vb)}); diagnose them separately"
        )


def _fill(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if into.get(key) in (None, "", [], {}) and value not in (None, "", [], {}):
            into[key] = deepcopy(value)


def join(inputs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(inputs, key=lambda f: _RANK.get(f["origin"].get("kind"), 3))
    for other in ordered[1:]:
        _conflict(ordered[0], other, "torch", lambda f: (f.get("torch") or {}).get("version"))
        _conflict(ordered[0], other, "driver", lambda f: (f.get("driver") or {}).get("version"))
    facts = deepcopy(ordered[0])
    for other in ordered[1:]:
        _fill(facts["torch"], other.get("torch") or {})
        if other.get("driver"):
            facts["driver"] = facts.get("driver") or {}
            _fill(facts["driver"], other["driver"])
        if not facts["gpus"]:
            facts["gpus"] = deepcopy(other.get("gpus") or [])
        else:
            for seen in other.get("gpus") or []:
                for gpu in facts["gpus"]:
                    if seen.get("compute_capability") and (seen["name"] in gpu["name"] or gpu["name"] in seen["name"]):
                        gpu.setdefault("compute_capability", seen["compute_capability"])
        libs = facts["libraries"]
        known = {w["package"] for w in libs["wheels"]}
        libs["wheels"] += [
            deepcopy(w) for w in (other.get("libraries") or {}).get("wheels") or [] if w["package"] not in known
        ]
        known_paths = {c["path"] for c in libs["copies"]}
        libs["copies"] += [
            deepcopy(c) for c in (other.get("libraries") or {}).get("copies") or [] if c["path"] not in known_paths
        ]
        if libs.get("loaded") is None and (other.get("libraries") or {}).get("loaded") is not None:
            libs["loaded"] = deepcopy(other["libraries"]["loaded"])
        facts["texts"] = [*facts.get("texts", []), *other.get("texts", [])]
        log, other_log = facts.setdefault("log", {}), other.get("log") or {}
        log["signals"] = list(dict.fromkeys([*(log.get("signals") or []), *(other_log.get("signals") or [])]))
        log["frames"] = [*(log.get("frames") or []), *(other_log.get("frames") or [])][-8:]
        for key in ("os", "python", "env", "cuda_toolkit", "numpy"):
            if isinstance(other.get(key), dict):
                facts[key] = facts.get(key) or {}
                _fill(facts[key], other[key])
        facts["torch_installs"]["installs"] += [
            i
            for i in other.get("torch_installs", {}).get("installs") or []
            if i not in facts["torch_installs"]["installs"]
        ]
        facts["not_checked"] = {**(other.get("not_checked") or {}), **(facts.get("not_checked") or {})}
    from fpdoctor.env.parse import missing

    facts["missing"] = missing(facts)
    facts["origin"] = {
        "kind": "several",
        "inputs": [{k: v for k, v in f["origin"].items() if k in ("kind", "path", "format")} for f in inputs],
    }
    return facts
