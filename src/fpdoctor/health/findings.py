"""Health facts -> findings (data in, `Finding`s out; nothing here reads a device or a file).

Severity rules, each from a named source:
- Xid: the catalogue's category (health/xid.py); application-class Xids (13, 31, 43, 45, ...) are
  warnings unless repeated on the GPU (two programs by name, three processes by pid, or three
  occurrences more than a minute apart or in different boots) or a memory/bus Xid
  (48/63/64/79/94/95) came in the same boot; NVLink5 Xids 144-150 take the decoded severity
  (else the line's own Fatal/Nonfatal); Xid 154 is a note when the new recovery action is None,
  else an error, as the same recovery action read from NVML or nvidia-smi is.
- Earlier boots: Xids and losses of the GPU only in boots before the kernel log's last one are
  history, at most warnings: the reboot has reset the GPU since.
- ECC: uncorrectable errors since the driver loaded are errors; only in the lifetime count, warnings.
- Row remapping: a pending remap is an error after uncorrectable errors, a warning after
  correctable ones (the reset is due either way); a remap failure is an error (the RMA criterion
  of NVIDIA, DCGM and gpud).
- Throttling: hardware slowdown, hardware thermal, power brake and software thermal slowdown; a
  software power cap under load is normal.
- A GPU nvidia-smi or NVML cannot open ("Unable to determine the device handle ...: Unknown
  Error"), and a driver that sees no GPU where the driver's own list or the kernel log names
  some (nvidia-smi's "No devices were found"), are errors: no job can use the GPU, whatever else
  could not be read.
"""

from __future__ import annotations

from typing import Any

from fpdoctor import catalog
from fpdoctor.health import xid as xids
from fpdoctor.health.checks import Check, at_most_one, run_checks
from fpdoctor.health.kernel_log import XidGroup
from fpdoctor.health.model import SLOWDOWN_REASONS, GpuFacts, HealthFacts, LostGpu
from fpdoctor.report.model import Finding, Judged, Severity

# An application-class Xid on one GPU from this many processes, or at this many separate times, is
# "repeated" (see _repeated).
REPEAT_RUNS = 3

_RECOVERY_TEXT = {
    "gpu_reset": "a GPU reset",
    "node_reboot": "a node reboot",
    "drain_p2p": "draining peer-to-peer traffic",
    "drain_and_reset": "draining the GPU and resetting it",
    "recover_imex_domain": "recovering the IMEX domain",
    "bus_reset": "a PCIe bus reset",
    "system_reboot": "a system reboot",
}


def _gpu_text(pci: str | None, gpu: GpuFacts | None) -> str:
    if gpu is not None:
        return gpu.label()
    return f"the GPU at {pci}" if pci else "a GPU"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def _where(facts: HealthFacts, pci: str | None, gpu: GpuFacts | None, host: str | None = None) -> dict[str, Any]:
    where = gpu.where() if gpu is not None else {}
    where.setdefault("pci", pci)
    where.setdefault("host", host or facts.host)
    return {k: v for k, v in where.items() if v is not None}


def _times(count: int, first: str | None, last: str | None) -> str:
    head = "once" if count == 1 else f"{count} times"
    if first and last and first != last:
        return f"{head}, first at {first}, last at {last}"
    return f"{head}, at {first}" if first else head


def _process_text(g: XidGroup) -> str:
    if g.processes:
        pids = f" (pid {', '.join(map(str, g.pids))})" if g.pids else ""
        return f"; process {', '.join(g.processes)}{pids}"
    return f"; pid {', '.join(map(str, g.pids))}" if g.pids else ""


def _nvlink_severity(g: XidGroup) -> Severity | None:
    worst: Severity | None = None
    for line in g.nvlink:
        decoded = line.get("decode") or {}
        if "severity" in decoded:
            fatal = not str(decoded["severity"]).lower().startswith("non")
            quiet = decoded.get("action") == "IGNORE" and decoded.get("investigate") == "IGNORE"
            sev = Severity.ERROR if fatal else Severity.INFO if quiet else Severity.WARNING
        else:  # no decode: the line says Fatal or Nonfatal itself
            sev = Severity.ERROR if line.get("line_severity") == "Fatal" else Severity.WARNING
        worst = sev if worst is None or sev.rank > worst.rank else worst
    return worst


def _nvlink_text(g: XidGroup) -> str:
    parts = []
    for line in g.nvlink[:4]:
        d = line.get("decode") or {}
        what = (
            f"{d['unit']} {d.get('severity', '?')}, action {d.get('action', '?')} (cause {d.get('cause', '?')})"
            if "unit" in d
            else (f"{line['unit']} {line['line_severity']} (not decoded)")
        )
        parts.append(f"link {line['link']}: {what}; {d.get('note', '')}".rstrip("; "))
    return " NVLink5 decode: " + " | ".join(parts) + "." if parts else ""


def earlier_boot(boots: list[int], current_boot: int | None) -> str:
    """'in an earlier boot (before the log's last reboot)': when events of earlier boots came."""
    if current_boot is None or not boots:
        return ""
    ago = current_boot - max(boots)
    when = "before the log's last reboot" if ago == 1 else f"{ago} reboots before the log's last boot"
    return f"in {'an earlier boot' if len(boots) == 1 else f'{len(boots)} earlier boots'} ({when})"


def xid_severity(g: XidGroup, groups: list[XidGroup]) -> tuple[Severity, str]:
    """The severity of one Xid group and the reason, in words, when it differs from the catalogue's.
    Xids only of boots before the log's last one are history: a reboot reset the GPU, so they say
    what happened, not what the GPU is now, and are never more than a warning (like an ECC error
    seen only in the lifetime counter)."""
    severity, why = _xid_severity_now(g, groups)
    if not g.history():
        return severity, why
    return min(severity, Severity.WARNING, key=lambda s: s.rank), (
        f" Logged {earlier_boot(g.boots, g.current_boot)}: history, not the GPU's state now. If it comes "
        "back in this boot, the GPU is suspect."
    )


def _xid_severity_now(g: XidGroup, groups: list[XidGroup]) -> tuple[Severity, str]:
    info = xids.lookup(g.xid)
    if 144 <= g.xid <= 150 and (sev := _nvlink_severity(g)) is not None:
        return sev, ""
    if g.xid == 154 and g.recovery_to:
        # the driver's recovery action, as NVML and nvidia-smi report it (gpu-recovery-required): an
        # action other than none is an error whichever source says it
        changed_to_none = "none" in g.recovery_to.lower() or g.recovery_to.startswith("0x0 ")
        return (Severity.INFO, "") if changed_to_none else (Severity.ERROR, "")
    if not info.application_class:
        return xids.base_severity(info), ""
    companions = sorted(
        {o.xid for o in groups if o.pci == g.pci and o.xid in xids.HARDWARE_COMPANIONS and set(o.boots) & set(g.boots)}
    )
    if companions:
        return Severity.ERROR, (
            f" An error here: Xid {', '.join(map(str, companions))} came on the same GPU in the same boot, "
            "so the GPU rather than the program is suspect."
        )
    if len(g.processes) >= 2:
        return Severity.ERROR, (
            f" An error here: several programs ({', '.join(g.processes)}) hit it on this GPU, "
            "so the GPU rather than one program is suspect."
        )
    repeated = _repeated(g)
    if repeated:
        return Severity.ERROR, (
            f" An error here: {repeated}. A program's bug repeats too: if the same job runs clean on "
            "another GPU, this GPU is suspect."
        )
    return Severity.WARNING, (
        " Usually the program's own fault, not the GPU's: a warning unless it repeats on this GPU (another "
        f"program, {REPEAT_RUNS} processes, or {REPEAT_RUNS} times more than a minute apart) or Xid "
        f"{'/'.join(map(str, sorted(xids.HARDWARE_COMPANIONS)))} comes with it."
    )


def _repeated(g: XidGroup) -> str:
    """Why an application-class Xid counts as repeated on its GPU, in words; '' when it does not.
    Process names alone cannot tell programs apart (every PyTorch process is pt_main_thread) and
    many lines name none (pid='<unknown>'), so separate processes and separate times count too.
    Twice is the usual rerun of a failing job; a third time is a pattern."""
    if len(g.pids) >= REPEAT_RUNS:
        shown = ", ".join(map(str, g.pids[:6])) + (", ..." if len(g.pids) > 6 else "")
        return f"{len(g.pids)} processes hit it on this GPU (pid {shown})"
    times = g.episodes or len(g.boots)  # files written before episodes were counted: boots
    if times >= REPEAT_RUNS:
        boots = f", in {len(g.boots)} boots" if len(g.boots) > 1 else ""
        return f"it came {times} separate times on this GPU (more than a minute apart{boots})"
    return ""


def xid_findings(facts: HealthFacts) -> list[Finding]:
    out = []
    for g in facts.xids:
        if g.xid == 79:
            continue  # fallen off the bus: one gpu-lost finding says it
        info = xids.lookup(g.xid)
        gpu = facts.gpu_for(g.pci)
        severity, why = xid_severity(g, facts.xids)
        name = info.short_name or "unknown Xid"
        meaning = info.explain()
        message = (
            f"Xid {g.xid} ({name}) on {_gpu_text(g.pci, gpu)}: {_times(g.count, g.first_seen, g.last_seen)}"
            f"{_process_text(g)}. {meaning[:1].upper() + meaning[1:]}.{why}{_nvlink_text(g)}"
        )
        if g.xid == 154 and g.recovery_to:
            message += f" The driver's recovery action is now {g.recovery_to}."
        index = str(gpu.index) if gpu is not None and gpu.index is not None else "INDEX"
        where = _where(facts, g.pci, gpu, g.hosts[0] if g.hosts else None)
        if g.gpu_instances:
            where["gpu_instance"] = g.gpu_instances[0] if len(g.gpu_instances) == 1 else g.gpu_instances
        evidence: dict[str, Any] = {
            "xid": g.xid,
            "meaning": meaning,
            "action": info.immediate_action or None,
            "category": info.category,
            "count": g.count,
            "first_seen": g.first_seen,
            "last_seen": g.last_seen,
            "processes": g.processes or None,
            "pids": g.pids or None,
            "line": g.line,
            "nvlink": g.nvlink or None,
        }
        fix = info.action_text(bus=g.pci, index=index)
        if g.history():
            fix = f"Nothing now: a reboot has reset the GPU since. If the Xid comes back in this boot: {fix}"
        out.append(
            catalog.make(
                "xid-error",
                title=f"Xid {g.xid}: {name}",
                message=message,
                severity=severity,
                fix=fix,
                where=where,
                evidence=evidence,
            )
        )
    return out


def lost_findings(facts: HealthFacts) -> list[Finding]:
    out = []
    by_pci = {x.pci: x for x in facts.lost}
    nvml_lost = {g.pci or f"index {g.index}": g for g in facts.gpus if g.lost}
    for pci in dict.fromkeys([*by_pci, *nvml_lost]):
        log, gpu = by_pci.get(pci), nvml_lost.get(pci) or facts.gpu_for(pci)
        said = []
        evidence: dict[str, Any] = {}
        if log is not None:
            said.append(f"the kernel log says so ({log.via}, {_times(log.count, log.first_seen, None)})")
            evidence.update(count=log.count, first_seen=log.first_seen, line=log.line)
            if log.via == "Xid 79":
                evidence["xid"] = 79
        if log is not None and log.history() and not (gpu is not None and (gpu.lost or gpu.unreachable)):
            out.append(_lost_before_reboot(facts, log, gpu, evidence))
            continue
        if gpu is not None and gpu.lost:
            said.append(gpu.lost)
            evidence["nvml" if _opener(gpu) == "NVML" else "nvidia_smi"] = gpu.lost
        if gpu is not None and gpu.unreachable:  # the same GPU, still unusable now: one finding says both
            said.append(f"{_opener(gpu)} cannot open it ('{gpu.unreachable}')")
            evidence["unreachable"] = gpu.unreachable
        bus = log.pci if log else gpu.pci if gpu else None
        who = _sentence(_gpu_text(bus, gpu))
        out.append(
            catalog.make(
                "gpu-lost",
                message=f"{who} has fallen off the bus: {'; '.join(said)}. Nothing can use it until it is reset "
                "or the node rebooted.",
                where=_where(facts, bus, gpu),
                evidence=evidence,
            )
        )
    return out


def _lost_before_reboot(facts: HealthFacts, log: LostGpu, gpu: GpuFacts | None, evidence: dict[str, Any]) -> Finding:
    """A GPU that fell off the bus only in boots before the log's last one: the reboot brought it
    back, so it is history (a warning, as a lifetime-only ECC count is), said with its boot."""
    who = _sentence(_gpu_text(log.pci, gpu))
    when = earlier_boot(log.boots, log.current_boot)
    return catalog.make(
        "gpu-lost",
        message=f"{who} fell off the bus {when}: the kernel log says so ({log.via}, "
        f"{_times(log.count, log.first_seen, None)}). The node has rebooted since and the log does not show it "
        "lost in the last boot: history, not the GPU's state now. If it falls off again, replace it.",
        severity=Severity.WARNING,
        fix="Nothing now: the GPU is back after the reboot. If it falls off the bus again, drain the node, "
        "check power cables, cooling and the PCIe riser, and replace the GPU.",
        where=_where(facts, log.pci, gpu),
        evidence={**evidence, "boots": log.boots, "current_boot": log.current_boot},
    )


def _opener(gpu: GpuFacts) -> str:
    if gpu.source == "kernel log":
        return "the driver (this boot's kernel log)"
    return "nvidia-smi" if gpu.source.startswith("nvidia-smi") else "NVML"


def _unreachable_finding(facts: HealthFacts, gpu: GpuFacts) -> Finding | None:
    """gpu-unreachable: nvidia-smi or NVML cannot open the GPU. It is there (the driver counts it)
    but nothing can use it; gpu-lost says it instead when the kernel log has it off the bus."""
    if not gpu.unreachable or any(x.pci == gpu.pci for x in facts.lost):
        return None
    off_bus = xids.lookup(79)
    return catalog.make(
        "gpu-unreachable",
        message=f"{_sentence(gpu.label())} cannot be opened: {_opener(gpu)} says '{gpu.unreachable}'. No job "
        "can run on it and its health facts cannot be read. Most often such a GPU has fallen off the bus "
        f"(Xid 79, '{off_bus.short_name}') or hung after an earlier fault; this boot's kernel log says which.",
        fix=catalog.get("gpu-unreachable").fix.replace("BUS_ID", gpu.pci or "BUS_ID"),
        where=_where(facts, gpu.pci, gpu),
        evidence={"line": gpu.unreachable, "source": _opener(gpu), "xid_catalog": f"79: {off_bus.explain()}"},
    )


def no_gpu_findings(facts: HealthFacts) -> list[Finding]:
    """no-gpu-visible: the driver sees no GPU where something says there should be some."""
    if not facts.no_gpu:
        return []
    return [
        catalog.make(
            "no-gpu-visible",
            message=f"No GPU is visible to the NVIDIA driver: {facts.no_gpu}. No GPU job can run on this node.",
            where=_where(facts, None, None),
            evidence={"said": facts.no_gpu},
        )
    ]


def _ecc_finding(facts: HealthFacts, gpu: GpuFacts) -> Finding | None:
    ecc = gpu.facts.get("ecc") or {}
    vol = (ecc.get("volatile") or {}).get("uncorrected") or 0
    agg = (ecc.get("aggregate") or {}).get("uncorrected") or 0
    if not vol and not agg:
        return None
    split = []
    for counter in ("volatile", "aggregate"):
        c = ecc.get(counter) or {}
        if "sram_uncorrected" in c or "dram_uncorrected" in c:
            split.append(f"{counter}: SRAM {c.get('sram_uncorrected', '?')}, DRAM {c.get('dram_uncorrected', '?')}")
    threshold = (ecc.get("aggregate") or {}).get("sram_threshold_exceeded")
    text = (
        f"{gpu.label()} has {vol} uncorrectable ECC error(s) since the driver loaded and {agg} in its lifetime"
        + (f" ({'; '.join(split)})" if split else "")
        + "."
        + (" nvidia-smi reports 'SRAM Threshold Exceeded: Yes': the replacement criterion." if threshold else "")
        + ("" if vol else " None since the driver loaded: a past event, kept as a warning.")
    )
    return catalog.make(
        "ecc-uncorrectable",
        message=text,
        severity=Severity.ERROR if vol or threshold else Severity.WARNING,
        fix=catalog.get("ecc-uncorrectable").fix.replace("BUS_ID", gpu.pci or "BUS_ID"),
        where=_where(facts, gpu.pci, gpu),
        evidence={
            "volatile_uncorrected": vol,
            "aggregate_uncorrected": agg,
            "sram_threshold_exceeded": threshold,
            "ecc": ecc,
        },
    )


def _repair_findings(facts: HealthFacts, gpu: GpuFacts) -> list[Finding]:
    out = []
    rows = gpu.facts.get("remapped_rows") or {}
    pages = gpu.facts.get("retired_pages") or {}
    repair = gpu.facts.get("memory_repair") or {}
    fix_pending = catalog.get("row-remap-pending").fix.replace("BUS_ID", gpu.pci or "BUS_ID")
    where = _where(facts, gpu.pci, gpu)
    if (
        rows.get("pending")
        or pages.get("pending")
        or repair.get("channel_repair_pending")
        or repair.get("tpc_repair_pending")
    ):
        unc = rows.get("uncorrectable") or 0
        what = []
        if rows.get("pending"):
            what.append(
                f"a row remap is pending ({rows.get('uncorrectable', '?')} row(s) remapped for uncorrectable, "
                f"{rows.get('correctable', '?')} for correctable errors)"
            )
        if pages.get("pending"):
            what.append(f"page retirement is pending ({pages.get('double_bit', '?')} double-bit pages retired)")
        what += [f"{k.replace('_', ' ')}" for k in ("channel_repair_pending", "tpc_repair_pending") if repair.get(k)]
        severe = bool(unc or pages.get("double_bit"))
        out.append(
            catalog.make(
                "row-remap-pending",
                message=f"{gpu.label()}: {'; '.join(what)}. The repair takes effect at the next GPU reset"
                + (", and it follows uncorrectable errors." if severe else "."),
                severity=Severity.ERROR if severe else Severity.WARNING,
                fix=fix_pending,
                where=where,
                evidence={
                    "remapped_rows": rows or None,
                    "retired_pages": pages or None,
                    "memory_repair": repair or None,
                },
            )
        )
    if rows.get("failure") or repair.get("unrepairable_memory"):
        why = "row remapping failed" if rows.get("failure") else "nvidia-smi reports unrepairable memory"
        out.append(
            catalog.make(
                "row-remap-failure",
                message=f"{gpu.label()}: {why}; faulty memory stays in use and uncorrectable errors will recur.",
                where=where,
                evidence={"remapped_rows": rows or None, "memory_repair": repair or None},
            )
        )
    return out


def _throttle_finding(facts: HealthFacts, gpu: GpuFacts) -> Finding | None:
    reasons = [r for r in gpu.facts.get("clock_event_reasons") or [] if r in SLOWDOWN_REASONS]
    if not reasons:
        return None
    temp, power, limit = (gpu.facts.get(k) for k in ("temperature_c", "power_w", "power_limit_w"))
    context = ", ".join(
        x
        for x in (
            f"{temp} C" if temp is not None else "",
            f"{power} W of {limit} W" if power is not None and limit else "",
        )
        if x
    )
    return catalog.make(
        "gpu-throttled",
        message=f"{gpu.label()} was throttled when its facts were read: "
        f"{', '.join(r.replace('_', ' ') for r in reasons)}" + (f" ({context})." if context else "."),
        where=_where(facts, gpu.pci, gpu),
        evidence={"reasons": reasons, "temperature_c": temp, "power_w": power, "power_limit_w": limit},
    )


def _recovery_finding(facts: HealthFacts, gpu: GpuFacts) -> Finding | None:
    action = gpu.facts.get("recovery_action")
    if not action or action == "none":
        return None
    return catalog.make(
        "gpu-recovery-required",
        message=f"The driver's recovery action for {gpu.label()} is {_RECOVERY_TEXT.get(action, action)} "
        f"({action}); the GPU is not to be trusted until it is done.",
        fix=catalog.get("gpu-recovery-required").fix.replace("BUS_ID", gpu.pci or "BUS_ID"),
        where=_where(facts, gpu.pci, gpu),
        evidence={"recovery_action": action},
    )


def all_checks() -> list[Check]:
    """Every health check, declared once: machine checks, then the checks each GPU gets, in the
    order the report lists their findings. A new check goes here (and gets a rule fixture)."""
    return [
        Check("no-gpu-visible", machine=no_gpu_findings),
        Check("gpu-lost", machine=lost_findings),
        Check("xid-error", machine=xid_findings),
        Check("gpu-unreachable", gpu=at_most_one(_unreachable_finding)),
        Check("ecc-uncorrectable", gpu=at_most_one(_ecc_finding)),
        Check("row-remap-pending and row-remap-failure", gpu=_repair_findings),
        Check("gpu-throttled", gpu=at_most_one(_throttle_finding)),
        Check("gpu-recovery-required", gpu=at_most_one(_recovery_finding)),
    ]


def judge(facts: HealthFacts) -> Judged:
    """The findings of every check, and each check that failed (for the report's not_checked)."""
    return run_checks(facts, all_checks())


def findings(facts: HealthFacts) -> list[Finding]:
    """The findings of every check; `judge` also says which checks failed."""
    return judge(facts).findings
