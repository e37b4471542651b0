"""`diagnose_env`: collect (live or from a file) -> judge with the rule base -> one Report."""

from __future__ import annotations

from collections import Counter
from copy import deepcopy
from typing import Any

from fpdoctor.env.facts import Facts
from fpdoctor.env.rules import evaluate
from fpdoctor.report.model import Report
from fpdoctor.report.redact import redact


def diagnose_env(
    *,
    from_file: str | None = None,
    facts: dict[str, Any] | None = None,
    probe: bool | None = None,
    probe_specs: list[dict[str, Any]] | None = None,
    probe_timeout_s: float = 60.0,
    child: Any = None,
) -> Report:
    """Diagnose this machine, a saved facts dict, or a file (collect_env text, facts JSON, log).

    `probe=None` runs the GEMM probes only when collecting on this machine and torch sees a GPU;
    with `facts` or `from_file`, probes run only for explicit `probe_specs` (the casebook's).
    Raises `fpdoctor.env.errors.InputError` for a file that cannot be diagnosed.
    """
    here = facts is None and from_file is None  # the facts describe this machine, now
    if facts is not None:
        # The caller's dict stays as it was: probe results, texts and not-checked reasons are
        # added to a copy, so the same facts diagnose the same a second time.
        facts = deepcopy(facts)
    elif from_file is not None:
        from fpdoctor.env.parse import load

        facts = load(from_file)
    else:
        from fpdoctor.env.collect import collect_live

        facts = collect_live(child=child)
    view = Facts(facts)
    if probe is None:
        probe = here and bool(view.cuda_available)
    if probe and (here or probe_specs):
        from fpdoctor.env.probe import default_specs, run_probes

        if probe_specs is None:
            device = "cuda" if view.cuda_available else "cpu"
            caps = [str(g["compute_capability"]) for g in view.gpus if g.get("compute_capability")]
            major, _, minor = caps[0].partition(".") if caps else ("", "", "")
            probe_specs = default_specs(device, (int(major), int(minor or 0)) if caps else None)
        facts["probes"] = run_probes(probe_specs, timeout_s=probe_timeout_s)
        for result in facts["probes"]:
            if result.get("status") == "error":
                # An exception is not a crash, but its text ("no kernel image ...") is evidence.
                facts.setdefault("texts", []).append(str(result.get("error")))
                facts.setdefault("not_checked", {})[f"probe {result['name']}"] = f"raised {result.get('error')}"
    elif probe:
        facts.setdefault("not_checked", {})["probes"] = "probes run only on a live machine, not on a file"

    findings = evaluate(view)
    not_checked = dict(facts.get("not_checked") or {})
    for item in facts.get("missing") or []:
        not_checked[item] = "not shown in the input"
    return Report(
        command="env",
        findings=findings,
        data={"facts": redact(facts), "summary": summary(view), "not_checked": not_checked},
    )


def summary(facts: Facts) -> list[tuple[str, str]]:
    """The rows of the facts table that every format shows above the findings."""
    raw = facts.raw
    origin = raw.get("origin") or {}
    rows: list[tuple[str, str]] = []
    source = "this machine" if not facts.offline else f"{origin.get('kind')} {origin.get('path', '')}".strip()
    if origin.get("format"):
        source += f" ({origin['format']} format)"
    rows.append(("source", source))
    os_ = raw.get("os") or {}
    if os_.get("distro") or os_.get("system"):
        rows.append(("os", " ".join(str(x) for x in (os_.get("distro") or os_.get("system"), os_.get("libc")) if x)))
    if (raw.get("python") or {}).get("version"):
        rows.append(("python", str(raw["python"]["version"])))
    torch = facts.torch
    state = torch.get("import")
    if torch.get("version") or state:
        cuda = f"CUDA {facts.build_cuda}" if facts.build_cuda else "CPU-only" if facts.cpu_only_build else "CUDA ?"
        text = f"{torch.get('version') or '?'} ({cuda}"
        if state and state != "ok":
            text += f", import {state}"
        if torch.get("cuda_available") is not None:
            text += f", CUDA available: {'yes' if torch['cuda_available'] else 'no'}"
        rows.append(("torch", text + ")"))
    if facts.arch_list:
        rows.append(("torch arch list", " ".join(facts.arch_list)))
    if facts.gpus:
        groups = Counter((g["name"], g.get("compute_capability"), g.get("memory_mib")) for g in facts.gpus)
        rows.append(
            (
                "GPUs",
                "; ".join(
                    f"{n} × {name}" + (f" (sm {cc}" + (f", {mem} MiB" if mem else "") + ")" if cc else "")
                    for (name, cc, mem), n in groups.items()
                ),
            )
        )
    else:
        rows.append(("GPUs", "none found"))
    driver = raw.get("driver") or {}
    if driver.get("version") or driver.get("cuda"):
        rows.append(
            (
                "NVIDIA driver",
                f"{driver.get('version') or '?'}"
                + (f" (supports CUDA <= {driver['cuda']})" if driver.get("cuda") else ""),
            )
        )
    loaded = {c["library"]: c for c in facts.loaded or []}
    by_lib: dict[str, list[dict[str, Any]]] = {}
    for copy in facts.copies:
        by_lib.setdefault(copy["library"], []).append(copy)
    for wheel in facts.wheels:
        for lib in wheel["libraries"]:
            if not any(c.get("package") == wheel["package"] for c in by_lib.get(lib, [])):
                by_lib.setdefault(lib, []).append({"path": f"<wheel {wheel['package']}>", "version": wheel["version"]})
    for lib in sorted(set(by_lib) | set(loaded)):
        copies = by_lib.get(lib, [])
        parts = []
        if lib in loaded:
            parts.append(f"loaded {loaded[lib].get('version') or '?'} from {loaded[lib]['path']}")
        parts.append(", ".join(f"{c.get('version') or '?'} at {c['path']}" for c in copies) or "no copy found")
        rows.append((f"lib{lib}", "; ".join(parts)))
    for key, label in (("cudnn", "cuDNN (torch)"), ("nccl", "NCCL (torch)")):
        if torch.get(key):
            rows.append((label, str(torch[key])))
    numpy = torch.get("numpy") or raw.get("numpy")
    if numpy and numpy.get("version"):
        rows.append(
            ("numpy", f"{numpy['version']}" + (f" (torch interop: {numpy['interop']})" if numpy.get("interop") else ""))
        )
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
    env = raw.get("env") or {}
    if env:
        rows.append(("environment", ", ".join(f"{k}={v}" for k, v in env.items())))
    for p in facts.probes:
        rows.append(
            (
                f"probe {p.get('name')}",
                f"{p.get('status')}"
                + (f" ({p.get('signal')})" if p.get("signal") else "")
                + (f", err {p['max_abs_err']:.2g} <= {p['tolerance']:.2g}" if p.get("status") == "ok" else ""),
            )
        )
    return rows


def _onoff(value: Any) -> str:
    return "on" if value else "off"
