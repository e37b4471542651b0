"""The facts table every format shows above the findings: short, each copy once, and what was
inferred said to be inferred."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from fpdoctor.env.facts import Facts
from fpdoctor.env.startup import hooks_text, registration_text, registrations
from fpdoctor.env.understand import shorten

ENV_SHOWN = 72  # characters of one environment variable's value in the table


def _source(raw: dict[str, Any]) -> str:
    origin = raw.get("origin") or {}
    if origin.get("kind") == "live":
        return "this machine"
    parts = []
    for item in origin.get("inputs") or [origin]:
        text = f"{item.get('kind')} {item.get('path') or ''}".strip()
        if item.get("format"):
            text += f" ({item['format']} format)"
        parts.append(text)
    return " + ".join(parts)


def env_value(value: object) -> str:
    """One environment variable's value, summarised: a list (paths, NVIDIA_REQUIRE_CUDA's
    `brand=... driver>=...` pairs) shows its first entry and how many follow."""
    text = str(value)
    if len(text) <= ENV_SHOWN:
        return text
    for sep in (" ", ":", ","):
        entries = [e for e in text.split(sep) if e]
        if len(entries) > 2:
            return f"{shorten(entries[0], ENV_SHOWN // 2)} (+{len(entries) - 1} more, {len(text):,} characters)"
    return shorten(text, ENV_SHOWN)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number


def probe_line(p: dict[str, Any]) -> str:
    """'ok: max error 0.00076 of the scale ..., tolerance 0.71 of it (...)': error and tolerance
    relative to the scale the dot-product error bound grows with, and what the tolerance is made of."""
    status = str(p.get("status"))
    text = status + (f" ({p['signal']})" if p.get("signal") else "")
    err, tol, scale = _number(p.get("max_abs_err")), _number(p.get("tolerance")), _number(p.get("scale"))
    if status not in ("ok", "wrong") or err is None or tol is None:
        return text
    if not math.isfinite(err):
        return f"{text}: the result holds NaN/Inf"
    if scale and scale > 0 and p.get("k"):
        u = _number(p.get("u"))
        basis = f"8·√k·u with k = {p['k']}" + (f", u = 2^{round(math.log2(u))} for {p.get('dtype')}" if u else "")
        return (
            f"{text}: max error {err / scale:.2g} of the scale max(|A|·|B|) = {scale:.3g}; "
            f"tolerance {tol / scale:.2g} of it ({basis}: the rounding bound of a length-k dot product, "
            "plus the output's rounding)"
        )
    return f"{text}: max error {err:.2g} (tolerance {tol:.2g})"


def _gpus(facts: Facts) -> str:
    if not facts.gpus:
        return "none found"
    groups = Counter(
        (g["name"], g.get("compute_capability"), g.get("memory_mib"), bool(g.get("capability_source")))
        for g in facts.gpus
    )
    parts = []
    for (name, cc, mem, from_table), n in groups.items():
        text = f"{n} × {shorten(name)}"
        if cc:
            detail = [f"sm {cc}" + (", inferred from the name" if from_table else "")]
            if mem:
                detail.append(f"{mem} MiB")
            text += f" ({', '.join(detail)})"
        parts.append(text)
    return "; ".join(parts)


def _libraries(facts: Facts) -> list[tuple[str, str]]:
    loaded = {c["library"]: c for c in facts.loaded or []}
    by_lib: dict[str, list[dict[str, Any]]] = {}
    for copy in facts.copies:
        by_lib.setdefault(copy["library"], []).append(copy)
    for wheel in facts.wheels:
        for lib in wheel["libraries"]:
            if not any(c.get("package") == wheel["package"] for c in by_lib.get(lib, [])):
                by_lib.setdefault(lib, []).append({"path": f"<wheel {wheel['package']}>", "version": wheel["version"]})
    rows = []
    for lib in sorted(set(by_lib) | set(loaded)):
        copies = by_lib.get(lib, [])
        parts = []
        here = loaded.get(lib)
        if here and here["path"] not in {c["path"] for c in copies}:
            parts.append(f"{here.get('version') or '?'} at {here['path']} (loaded)")
        for c in copies:
            mark = " (loaded)" if here and here["path"] == c["path"] else ""
            parts.append(f"{c.get('version') or '?'} at {c['path']}{mark}")
        rows.append((f"lib{lib}", "; ".join(parts) or "no copy found"))
    return rows


def _defined(found: list[dict[str, Any]]) -> set[str]:
    """Ops defined outside torch: their own kernels go without saying in the summary."""
    return {e["op"] for e in found if e.get("kind") == "defines"}


def summary(facts: Facts) -> list[tuple[str, str]]:
    raw = facts.raw
    rows: list[tuple[str, str]] = [("source", _source(raw))]
    os_ = raw.get("os") or {}
    if os_.get("distro") or os_.get("system"):
        shown = (os_.get("distro") or os_.get("system"), os_.get("libc"))
        rows.append(("os", shorten(" ".join(str(x) for x in shown if x), 2 * ENV_SHOWN)))
    if (raw.get("python") or {}).get("version"):
        rows.append(("python", shorten(raw["python"]["version"])))
    torch = facts.torch
    state = torch.get("import")
    version = torch.get("version") or (
        f"not understood: {torch['version_not_understood']}" if torch.get("version_not_understood") else "?"
    )
    if torch.get("version") or state or torch.get("version_not_understood"):
        cuda = f"CUDA {facts.build_cuda}" if facts.build_cuda else "CPU-only" if facts.cpu_only_build else "CUDA ?"
        text = f"{version} ({cuda}"
        if state and state != "ok":
            text += f", import {state}"
        if torch.get("cuda_available") is not None:
            text += f", CUDA available: {'yes' if torch['cuda_available'] else 'no'}"
        rows.append(("torch", text + ")"))
    if facts.arch_list:
        rows.append(("torch arch list", " ".join(facts.arch_list)))
    rows.append(("GPUs", _gpus(facts)))
    driver = raw.get("driver") or {}
    if driver.get("version") or driver.get("cuda") or driver.get("version_not_understood"):
        driver_text = driver.get("version") or (
            f"not understood: {driver['version_not_understood']}" if driver.get("version_not_understood") else "?"
        )
        supports = f" (supports CUDA <= {driver['cuda']})" if driver.get("cuda") else ""
        rows.append(("NVIDIA driver", driver_text + supports))
    rows += _libraries(facts)
    for key, label in (("cudnn", "cuDNN (torch)"), ("nccl", "NCCL (torch)")):
        if torch.get(key):
            rows.append((label, str(torch[key])))
    numpy = torch.get("numpy") or raw.get("numpy")
    if numpy and numpy.get("version"):
        interop = f" (torch interop: {numpy['interop']})" if numpy.get("interop") else ""
        rows.append(("numpy", f"{numpy['version']}{interop}"))
    prec = torch.get("precision")
    if prec:
        rows.append(
            (
                "precision defaults",
                (
                    f"fp32 matmul precision {prec['float32_matmul_precision']}, "
                    f"TF32 matmul {_onoff(prec['matmul_allow_tf32'])}, cuDNN TF32 {_onoff(prec['cudnn_allow_tf32'])}, "
                    "fp16/bf16 reduced-precision reductions "
                    f"{_onoff(prec['fp16_reduced_precision_reduction'])}/"
                    f"{_onoff(prec['bf16_reduced_precision_reduction'])}, "
                    f"deterministic algorithms {_onoff(prec['deterministic_algorithms'])}"
                ),
            )
        )
    startup = raw.get("startup")
    if isinstance(startup, dict):
        rows += hooks_text(startup)
    found = registrations(facts)
    if found is not None:
        said = [registration_text(e) for e in found if e.get("kind") != "adds" or e["op"] not in _defined(found)]
        rows.append(("ops registered at start-up", "; ".join(said) or "none (every op and kernel is torch's)"))
    env = raw.get("env") or {}
    if env:
        rows.append(("environment", ", ".join(f"{k}={env_value(v)}" for k, v in env.items())))
    for p in facts.probes:
        rows.append((f"probe {p.get('name')}", probe_line(p)))
    return rows


def _onoff(value: Any) -> str:
    return "on" if value else "off"
