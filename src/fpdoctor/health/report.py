"""The `fpdoctor health` report: the status line, one compact row per GPU, what was not checked.

The report's verdict comes from the findings (ARCHITECTURE.md, contract 1); `data.status` says how much was seen,
so a machine where nothing could be read is "not checked", never "healthy".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from fpdoctor.health.kernel_log import normalize_pci
from fpdoctor.health.model import SLOWDOWN_REASONS, GpuFacts, HealthFacts
from fpdoctor.report.model import Finding, Report, Severity

KEY_FACTS = ("ecc", "remapped_rows", "retired_pages", "clock_event_reasons")
_CLOCK_SHORT = {
    "hw_power_brake_slowdown": "pwr brake",
    "hw_thermal_slowdown": "hw thermal",
    "hw_slowdown": "hw slow",
    "sw_thermal_slowdown": "sw thermal",
    "sw_power_cap": "pwr cap",
    "gpu_idle": "idle",
}


def _n(count: int, what: str) -> str:
    return f"{count} {what}" + ("" if count == 1 else "s")


def _unread(facts: HealthFacts) -> list[str]:
    """Key facts some GPU could not give (other than 'not supported'), and 'device_handle' for a GPU
    this process was not allowed to open, so none of its facts were read."""
    return sorted(
        {
            k
            for g in facts.gpus
            for k, why in g.unavailable.items()
            if (k == "device_handle" or (g.facts and k.split(".")[0] in KEY_FACTS))
            and not why.startswith("not supported")
        }
    )


# The sources of GPU facts: not needed where the run asked about the CPU alone (build's cpu_only)
_GPU_SOURCES = ("NVML", "GPU facts", "kernel log")


def _gaps(facts: HealthFacts, *, cpu_only: bool = False) -> list[str]:
    """What was not checked, in a word each: the sources listed as not checked, GPU facts or the
    kernel log when not given, the key facts a GPU could not give."""
    gaps = list(facts.not_checked)
    if not any(g.facts for g in facts.gpus) and "NVML" not in gaps:
        gaps.append("GPU facts")
    if not facts.kernel_logs and "kernel log" not in gaps:
        gaps.append("kernel log")
    return [g for g in gaps + _unread(facts) if not (cpu_only and g in _GPU_SOURCES)]


def complete(facts: HealthFacts, *, cpu_only: bool = False) -> bool:
    """Whether every source was read: GPU facts (NVML or nvidia-smi -q) with every key fact, the
    kernel log, and nothing listed as not checked. Only then can 'no error' mean healthy.
    `cpu_only`: the CPU's fingerprints were asked for on a machine without an NVIDIA driver,
    where no GPU facts or kernel-log lines can be missing."""
    return not _gaps(facts, cpu_only=cpu_only)


def _cpu_only(facts: HealthFacts, fingerprints: Any, device: str | None) -> bool:
    """Whether the run asked about the CPU alone (--device cpu), on a machine without an NVIDIA
    driver, and got its fingerprints measured: then that is the whole verdict."""
    rows = fingerprints.rows if fingerprints is not None else []
    return device == "cpu" and facts.no_driver is not None and bool(rows) and not any("failure" in r for r in rows)


def exit_code(report: Report) -> int:
    """The exit status of `fpdoctor health`, a gate for a scheduler: 1 an error-level finding (drain,
    whatever could not be read); 0 every source read and no error (healthy, warnings at most); 2 no
    verdict: something was NOT CHECKED or INCOMPLETE and nothing read is an error (bad usage and
    refused input files exit 2 too, before any report)."""
    if report.exit_code:
        return 1
    return 0 if report.data.get("complete") else 2


def _status(
    facts: HealthFacts,
    findings: list[Finding],
    fingerprints: Any,
    failed: Mapping[str, str] | None = None,
    *,
    cpu_only: bool = False,
) -> tuple[str, str]:
    """(status, the text that leads the report). The report's banner comes from the findings alone
    (OK without any), so a check that read nothing says NOT CHECKED / INCOMPLETE here, in capitals,
    in the first summary row the text report prints right under the banner. `failed`: the checks
    that raised (health/checks.py); with one, the machine is never called healthy."""
    failed = failed or {}
    gpu_facts = [g for g in facts.gpus if g.facts]
    nvidia_lines = sum(k.get("nvidia_lines", 0) for k in facts.kernel_logs)
    fp_note = "" if fingerprints is not None else "; GEMM fingerprints not run"
    problems = [f for f in findings if f.severity.rank > Severity.INFO.rank]
    notes = len(findings) - len(problems)
    note_text = f"; {_n(notes, 'note')} below" if notes else ""
    if problems:
        gpus = {f.where.get("pci") or f.where.get("uuid") or f.where.get("index") for f in problems} - {None}
        on = f" on {len(gpus)} GPU(s)" if gpus else ""  # no-gpu-visible names no GPU
        gaps = [*_gaps(facts, cpu_only=cpu_only), *failed]
        skipped = f"; NOT CHECKED: {', '.join(gaps)}" if gaps else ""
        return "problems", f"problems found{on}: see the findings{skipped}{note_text}"
    if cpu_only and not failed and complete(facts, cpu_only=True):
        return "healthy", (
            f"healthy: the CPU fingerprints show no problem; no GPU to check ({facts.no_driver}){note_text}"
        )
    if not gpu_facts and not nvidia_lines:
        why = facts.not_checked.get("NVML") or "no NVML facts or nvidia-smi -q output given"
        log = "no kernel log read" if not facts.kernel_logs else "the kernel log has no NVIDIA lines"
        return "not checked", f"NOT CHECKED: no NVIDIA GPU seen. {why}; {log}{note_text}"
    if not gpu_facts:
        why = facts.not_checked.get("NVML") or "no NVML facts or nvidia-smi -q output given"
        return "incomplete", (
            f"INCOMPLETE: no GPU facts read ({why}); the kernel log shows no NVIDIA problem{fp_note}{note_text}"
        )
    if not facts.kernel_logs:
        why = facts.not_checked.get("kernel log") or "no kernel log given"
        return "incomplete", (
            f"INCOMPLETE: GPU facts show no problem, the kernel log was not read ({why}){fp_note}{note_text}"
        )
    if failed:
        return "incomplete", (
            f"INCOMPLETE: no problem in what was checked, but {', '.join(failed)} failed (see not checked){note_text}"
        )
    unread = _unread(facts) + [f"{k} ({why})" for k, why in facts.not_checked.items()]
    if unread:
        return "incomplete", (
            f"INCOMPLETE: no problem in what was read, but {', '.join(unread)} could not be read{note_text}"
        )
    return "healthy", (
        f"healthy: {len(gpu_facts)} GPU(s), NVML facts and kernel log show no problem{fp_note}{note_text}"
    )


def _short_pci(pci: str | None) -> str:
    return pci[5:] if pci and pci.startswith("0000:") else pci or "-"


def _cell(gpu: GpuFacts | None, key: str) -> tuple[Any, str | None]:
    """(value, None) or (None, short reason) for one fact of a row."""
    if gpu is None:
        return None, "-"
    if key in gpu.facts:
        return gpu.facts[key], None
    why = next((w for k, w in gpu.unavailable.items() if k.split(".")[0] == key), None)
    if why is None:
        return None, "-"
    return None, "n/s" if why.startswith("not supported") else "?"


def _ecc_cell(gpu: GpuFacts | None) -> str:
    ecc, miss = _cell(gpu, "ecc")
    if miss:
        return miss
    vol, agg = ((ecc.get(c) or {}).get("uncorrected") for c in ("volatile", "aggregate"))
    return f"{'?' if vol is None else vol}/{'?' if agg is None else agg}"


def _repair_cell(gpu: GpuFacts | None) -> str:
    rows, miss = _cell(gpu, "remapped_rows")
    pages = (gpu.facts.get("retired_pages") if gpu else None) or {}
    if miss and not pages:
        return miss if miss != "n/s" or _cell(gpu, "retired_pages")[1] == "n/s" else "-"
    rows = rows or {}
    state = [
        w for w, on in (("FAILED", rows.get("failure")), ("pending", rows.get("pending") or pages.get("pending"))) if on
    ]
    return "+".join(state) or "ok"


def _clock_cell(gpu: GpuFacts | None) -> str:
    reasons, miss = _cell(gpu, "clock_event_reasons")
    if miss:
        return miss
    for name in (*SLOWDOWN_REASONS, "sw_power_cap", "gpu_idle"):
        if name in reasons:
            return _CLOCK_SHORT[name]
    return "ok"


def _xid_cell(facts: HealthFacts, pci: str | None) -> str:
    """'48,13x3' for this boot; Xids only of earlier boots follow in brackets: '[48,79 earlier boot]'."""
    cells: dict[bool, list[str]] = {False: [], True: []}
    for g in facts.xids:
        if pci and g.pci == pci:
            cells[g.history()].append(f"{g.xid}x{g.count}" if g.count > 1 else str(g.xid))
    for lost in facts.lost:
        if pci and lost.pci == pci and "79" not in {p.split("x")[0] for p in cells[lost.history()]}:
            cells[lost.history()].append("off bus")
    now, before = ",".join(cells[False]), ",".join(cells[True])
    return " ".join(x for x in (now, f"[{before} earlier boot]" if before else "") if x) or "-"


def _matches(
    where: dict[str, Any], pci: str | None, uuid: str | None, index: Any, host: str | None, *, fp: Any = None
) -> bool:
    """Whether a finding's `where` names the row's GPU; `fp` is the row's fingerprint row, if any."""
    if where.get("host") and host and where["host"] != host:
        return False
    # a fingerprint finding names its rank, or its device: rows without bus id, UUID or index (CPU
    # ranks, a GPU whose identity was not read) are told apart by them, never all matched
    for key in ("rank", "device"):
        if where.get(key) is not None and fp and fp.get(key) is not None:
            return bool(where[key] == fp[key])
    if pci is uuid is index is None and not any(
        where.get(k) is not None for k in ("pci", "uuid", "index", "rank", "device")
    ):
        return True  # an excerpt without a GPU header: its findings are its GPU's
    if pci and where.get("pci") and normalize_pci(where["pci"]) == pci:
        return True
    if uuid and where.get("uuid") == uuid:
        return True
    return index is not None and where.get("index") == index and not where.get("pci")


def _state(
    findings: Iterable[Finding], pci: str | None, uuid: str | None, index: Any, host: str | None, *, fp: Any = None
) -> str:
    ranks = [f.severity.rank for f in findings if _matches(dict(f.where), pci, uuid, index, host, fp=fp)]
    return {2: "ERROR", 1: "warning", 0: "note"}[max(ranks)] if ranks else ""


def _rows(facts: HealthFacts, findings: list[Finding], fp_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per GPU: facts GPUs, GPUs only the kernel log names, fingerprint rows joined in."""
    entries: list[dict[str, Any]] = [
        {"gpu": g, "pci": g.pci, "uuid": g.uuid, "index": g.index, "name": g.name, "host": g.host or facts.host}
        for g in facts.gpus
    ]
    for pci in dict.fromkeys([*(x.pci for x in facts.xids), *(x.pci for x in facts.lost)]):
        if not any(e["pci"] == pci for e in entries):
            entries.append({"gpu": None, "pci": pci, "uuid": None, "index": None, "name": None, "host": facts.host})
    for row in fp_rows:
        row_pci = normalize_pci(row["pci"]) if row.get("pci") else None
        match = next(
            (
                e
                for e in entries
                if "fp" not in e
                and _matches(
                    {"pci": row_pci, "uuid": row.get("uuid"), "index": row.get("index"), "host": row.get("host")},
                    e["pci"],
                    e["uuid"],
                    e["index"],
                    e["host"],
                )
            ),
            None,
        )
        if match is None:
            match = {
                "gpu": None,
                "pci": row_pci,
                "uuid": row.get("uuid"),
                "index": row.get("index"),
                "name": row.get("name") or row.get("device"),
                "host": row.get("host"),
            }
            entries.append(match)
        match["fp"] = row
    return entries


def table(facts: HealthFacts, findings: list[Finding], fp_rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    entries = _rows(facts, findings, fp_rows or [])
    columns = ["GPU", "bus id", "ECC unc v/a", "repair", "clocks", "temp", "Xid"]
    if fp_rows is not None:
        columns.append("GEMM")
    columns.append("state")
    hosts = {e["host"] for e in entries if e["host"]}
    rows = []
    for e in entries:
        gpu, fp = e["gpu"], e.get("fp")
        label = " ".join(str(x) for x in (e["index"], (e["name"] or "").removeprefix("NVIDIA ")) if x not in (None, ""))
        if fp is not None and fp.get("rank") is not None:
            label = f"rank {fp['rank']}: {label}"
        if len(hosts) > 1 and e["host"]:
            label = f"{e['host']} {label}"
        temp, _ = _cell(gpu, "temperature_c")
        row = [
            label or "-",
            _short_pci(e["pci"]),
            _ecc_cell(gpu),
            _repair_cell(gpu),
            _clock_cell(gpu),
            f"{temp}C" if temp is not None else "-",
            _xid_cell(facts, e["pci"]),
        ]
        if fp_rows is not None:
            row.append(str((fp or {}).get("verdict") or ("failed" if (fp or {}).get("failure") else "-")))
        state = _state(findings, e["pci"], e["uuid"], e["index"], e["host"], fp=fp)
        row.append(state or ("ok" if (gpu is not None and gpu.facts) or fp is not None else "n/a"))
        rows.append(row)
    return {"title": "GPUs", "columns": columns, "rows": rows}


def _not_checked(facts: HealthFacts, failed: Mapping[str, str], *, cpu_only: bool = False) -> dict[str, str]:
    """Sources that could not be read, the checks that failed, then per-fact reasons other than
    'not supported', merged over GPUs; GPU sources not at all when the run needs none (cpu_only)."""
    out = {**{k: v for k, v in facts.not_checked.items() if not (cpu_only and k in _GPU_SOURCES)}, **failed}
    by_reason: dict[tuple[str, str], list[str]] = {}
    for g in facts.gpus:
        for key, why in g.unavailable.items():
            if not why.startswith("not supported"):
                by_reason.setdefault((key, why), []).append(str(g.index) if g.index is not None else g.pci or "?")
    for (key, why), gpus in by_reason.items():
        out[f"{key.replace('_', ' ')} (GPU {', '.join(gpus)})"] = why
    return out


def build(
    facts: HealthFacts,
    findings: list[Finding],
    *,
    fingerprints: Any = None,
    failed: Mapping[str, str] | None = None,
    device: str | None = None,
) -> Report:
    """The Report of `fpdoctor health`: findings, then `data` with status, summary, table, not_checked,
    notes and the facts (which `--from` reads back). `failed`: the checks that raised, and why
    (`findings.judge(facts).not_checked`). `device`: where fingerprints were asked to run; 'cpu'
    on a machine without an NVIDIA driver asks about the CPU alone (see _cpu_only)."""
    failed = failed or {}
    fp_findings = list(fingerprints.findings) if fingerprints is not None else []
    all_findings = findings + fp_findings
    cpu_only = _cpu_only(facts, fingerprints, device)
    status, status_text = _status(facts, all_findings, fingerprints, failed, cpu_only=cpu_only)
    summary: list[list[str]] = [["status", status_text]]
    if facts.host:
        summary.append(["host", facts.host])
    if facts.driver:
        summary.append(["driver", facts.driver])
    summary += [[os.path.basename(k) or k, v] for k, v in facts.sources.items()]  # a file's full path is in facts
    notes = list(facts.notes)
    if fingerprints is not None:
        count = len(fingerprints.rows)
        summary.append(["GEMM fingerprints", f"{count} device(s)" if count else "not run"])
        notes += list(fingerprints.notes)
        others = sorted({r["host"] for r in fingerprints.rows if r.get("host") and r["host"] != facts.host})
        if others and facts.host:
            notes.append(
                f"NVML facts and the kernel log are {facts.host}'s; for {', '.join(others)} run "
                "`fpdoctor health --duration 0` there"
            )
    summary += [["note", n] for n in notes]
    # `complete` with `status` decides the exit status (`exit_code`): a scheduler's gate reads either
    data: dict[str, Any] = {
        "status": status,
        "complete": complete(facts, cpu_only=cpu_only) and not failed,
        "summary": summary,
    }
    if facts.gpus or facts.xids or facts.lost or (fingerprints is not None and fingerprints.rows):
        data["table"] = table(facts, all_findings, fingerprints.rows if fingerprints is not None else None)
    not_checked = _not_checked(facts, failed, cpu_only=cpu_only)
    if not_checked:
        data["not_checked"] = not_checked
    data["notes"] = notes
    data["facts"] = facts.to_dict()
    if fingerprints is not None:
        data["fingerprints"] = {"rows": fingerprints.rows, "notes": list(fingerprints.notes)}
    return Report(command="health", findings=all_findings, data=data)
