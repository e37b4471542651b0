"""Assemble the health facts of this machine (NVML + kernel log) or of saved files (`--from`)."""

from __future__ import annotations

import socket
from typing import Any

from fpdoctor import progress
from fpdoctor.health import inputs, kernel_log, kernel_sources, nvml, smi
from fpdoctor.health.model import GpuFacts, HealthFacts, LostGpu


def _fold_lost(events: list[kernel_log.LostEvent], *, boot_offset: int, current_boot: int) -> list[LostGpu]:
    """One LostGpu per bus id; its count is separate occurrences, not lines: the driver reports one
    loss with an Xid 79 line and a 'GPU has fallen off the bus' line (or the three-line message),
    all within a second (kernel_log.episodes)."""
    by_pci: dict[str, list[kernel_log.LostEvent]] = {}
    for e in events:
        by_pci.setdefault(e.pci, []).append(e)
    out = []
    for pci, evs in by_pci.items():
        first = evs[0]
        out.append(
            LostGpu(
                pci=pci,
                via="Xid 79" if any(e.xid == 79 for e in evs) else "kernel log message",
                first_seen=first.stamp.text(),
                line=first.message[:400],
                count=kernel_log.episodes(evs),
                boots=sorted({e.stamp.boot + boot_offset for e in evs}),
                current_boot=current_boot,
            )
        )
    return out


def _merge_identity(facts: HealthFacts, gpu_map: dict[str, dict[str, str]], host: str | None) -> None:
    """Bus id -> UUID/serial from the driver's 'GPU at PCI:' lines: fills known GPUs, adds the others."""
    for pci, ident in gpu_map.items():
        gpu = facts.gpu_for(pci) or next((g for g in facts.gpus if g.uuid and g.uuid == ident.get("uuid")), None)
        if gpu is None:
            facts.gpus.append(
                GpuFacts(pci=pci, uuid=ident.get("uuid"), serial=ident.get("serial"), source="kernel log", host=host)
            )
            continue
        gpu.pci = gpu.pci or pci
        gpu.uuid = gpu.uuid or ident.get("uuid")
        gpu.serial = gpu.serial or ident.get("serial")


def _not_initialised(facts: HealthFacts, failed: list[tuple[str | None, str]], host: str | None) -> None:
    """This boot's 'RmInitAdapter failed!': the driver could not initialise the GPU, so it is unusable
    (gpu-unreachable, the line quoted), unless NVML or nvidia-smi opened it since (then a note). An
    old driver's line names no bus id: one GPU of the node, said once."""
    opened = [g for g in facts.gpus if g.source != "kernel log" and not g.unreachable and not g.lost]
    for pci, line in dict(failed).items():
        gpu = facts.gpu_for(pci) if pci else next((g for g in facts.gpus if g.unreachable == line), None)
        if (gpu is not None and gpu in opened) or (pci is None and opened and len(opened) == len(facts.gpus)):
            facts.notes.append(f"this boot's kernel log says '{line}', yet the GPU was opened since")
            continue
        if gpu is None:
            gpu = GpuFacts(pci=pci, source="kernel log", host=host)
            facts.gpus.append(gpu)
        gpu.unreachable = gpu.unreachable or line


def _boot_offset(facts: HealthFacts) -> int:
    """The first boot number free for the next log: boots of different logs are different boots."""
    used = [b for g in facts.xids for b in g.boots] + [b for x in facts.lost for b in x.boots]
    used += [k["first_boot"] + k.get("boots", 1) - 1 for k in facts.kernel_logs if isinstance(k.get("first_boot"), int)]
    return max(used, default=-1) + 1


def add_kernel_log(
    facts: HealthFacts, lines: list[str], source: str, *, strict: bool, host: str | None = None
) -> dict[str, Any] | None:
    """Parse one kernel log into `facts`; `strict` (a --from file) refuses an unreadable Xid line or
    a log cut inside an NVIDIA message, a live log only notes them. A text without a single kernel
    message (a saved "dmesg: read kernel buffer failed") is no evidence either way: the kernel log is
    then NOT CHECKED (facts.not_checked) and None is returned."""
    parsed = kernel_log.parse(lines)
    if not parsed.kernel_lines:
        first = next((line.strip() for line in lines if line.strip()), "")
        why = f"{source} holds no kernel message ({_n(parsed.lines, 'line')}, the first {first[:100]!r})"
        earlier = facts.not_checked.get("kernel log")
        facts.not_checked["kernel log"] = f"{earlier}; {why}" if earlier else why
        return None
    if parsed.truncated:
        if strict:
            raise inputs.InputError(f"{source} looks cut off: {parsed.truncated}; save the whole log again")
        facts.notes.append(f"{source} looks cut off: {parsed.truncated}")
    if parsed.unreadable:
        line_no, text = parsed.unreadable[0]
        if strict:
            raise inputs.InputError(
                f"{source} line {line_no}: an Xid line without a readable Xid code ({text[:80]!r}); "
                "give the whole line as the kernel logged it"
            )
        facts.notes.append(f"{source}: {len(parsed.unreadable)} Xid line(s) could not be read, e.g. line {line_no}")
    offset = _boot_offset(facts)
    facts.xids += kernel_log.group(parsed.xids, driver=facts.driver, boot_offset=offset, boots=parsed.boots)
    facts.lost += _fold_lost(parsed.lost, boot_offset=offset, current_boot=offset + parsed.boots - 1)
    _merge_identity(facts, parsed.gpu_map, host)
    _not_initialised(facts, [(pci, line) for pci, boot, line in parsed.init_failed if boot == parsed.boots - 1], host)
    summary: dict[str, Any] = {
        "source": source,
        "lines": parsed.lines,
        "nvidia_lines": parsed.nvidia_lines,
        "xid_lines": len(parsed.xids),
        "boots": parsed.boots,
        "first_boot": offset,
        "since": parsed.first.text() if parsed.first else None,
        "until": parsed.last.text() if parsed.last else None,
        "drivers": parsed.drivers,
        "gpu_map": parsed.gpu_map,
        "starts_at_boot": parsed.starts_at_boot,
    }
    facts.kernel_logs.append({k: v for k, v in summary.items() if v not in (None, [], {}, False)})
    if parsed.drivers and not facts.driver:
        facts.driver = parsed.drivers[-1]
    return summary


def _n(count: int, what: str) -> str:
    return f"{count} {what}" + ("" if count == 1 else "s")


def _log_text(summary: dict[str, Any]) -> str:
    lines = _n(summary["lines"], "line")
    if not summary["nvidia_lines"]:
        return f"{lines}, no NVIDIA (NVRM) lines"
    text = f"{lines}, {_n(summary['nvidia_lines'], 'NVIDIA line')}, {_n(summary['xid_lines'], 'Xid line')}"
    if summary["boots"] > 1:  # its earlier boots' events are history (findings.earlier_boot)
        text += f"; {summary['boots']} boots, judged as of the last"
    return text


def collect_live(*, nvml_module: Any = None, readers: Any = None, host: str | None = None) -> HealthFacts:
    """This machine: NVML facts for every GPU, then this boot's kernel log."""
    facts = HealthFacts(host=host or socket.gethostname())
    sees_none = False
    try:
        with progress.task("health: NVML facts per GPU"):
            facts.gpus, facts.driver = nvml.collect(host=facts.host, nvml=nvml_module)
        if facts.gpus:
            facts.sources["NVML"] = f"{len(facts.gpus)} GPU(s), driver {facts.driver}"
        else:
            facts.not_checked["NVML"] = "NVML runs but sees no NVIDIA GPU"
            sees_none = True
    except nvml.NvmlUnavailable as exc:
        if exc.unusable:  # GPUs that no job can use: no-gpu-visible, never 'not checked'
            facts.no_gpu = str(exc)
        else:
            facts.not_checked["NVML"] = str(exc)
        facts.no_driver = str(exc) if exc.no_driver else None
    _live_kernel_log(facts, readers)
    if sees_none:
        _gpus_the_driver_registered(facts)
    return facts


def _gpus_the_driver_registered(facts: HealthFacts) -> None:
    """NVML runs (the driver is loaded) and sees no GPU: where the driver's own list or this boot's
    kernel log names GPUs, they are there and none of them works (facts.no_gpu); else, with
    nothing to say the node has GPUs, NVML is left not checked."""
    listed = nvml.driver_bus_ids()
    logged = sorted(g.pci for g in facts.gpus if g.pci and g.source == "kernel log")
    named = [
        f"{where} names {', '.join(ids)}"
        for where, ids in (("/proc/driver/nvidia/gpus", listed), ("this boot's kernel log", logged))
        if ids
    ]
    if named:
        facts.no_gpu = f"NVML runs but sees no GPU, while {' and '.join(named)}"
        del facts.not_checked["NVML"]


def _live_kernel_log(facts: HealthFacts, readers: Any) -> None:
    with progress.task("health: this boot's kernel log"):
        text = kernel_sources.read_live(readers)
    if text.source is None:
        facts.not_checked["kernel log"] = "; ".join(f"{name}: {why}" for name, why in text.tried.items())
        return
    summary = add_kernel_log(facts, text.lines, text.source, strict=False, host=facts.host)
    if summary is None:
        return
    facts.sources["kernel log"] = f"{text.source}: {_log_text(summary)}"
    if text.tried:
        facts.kernel_logs[-1]["not_read"] = text.tried
    if text.note:
        facts.notes.append(f"{text.source}: {text.note}")
    if text.source == "dmesg" and not summary["starts_at_boot"]:
        facts.notes.append(
            "the kernel ring buffer no longer holds the start of this boot: older Xids are not seen "
            "(journalctl -k -b keeps them)"
        )


def collect_files(paths: list[str]) -> HealthFacts:
    """Saved inputs: JSON facts and `nvidia-smi -q` first, kernel logs last, so NVLink5 lines are
    decoded with the driver version the other files name."""
    facts = HealthFacts()
    texts = [(p, inputs.read_text(p)) for p in paths]
    logs = []
    for path, text in texts:
        name = "standard input" if path == "-" else path
        what = inputs.kind(text)
        if what == "json":
            _merge(facts, inputs.load_json(text, name), name)
            continue
        if what.startswith("smi"):
            gpus, driver = smi.parse(text)
            none_seen = None if gpus else smi.no_devices(text)
            if none_seen:  # nvidia-smi ran, so the driver is there: a GPU node whose GPUs it cannot see
                facts.no_gpu = f"{name} is nvidia-smi output that says '{none_seen}'"
                facts.sources[name] = f"nvidia-smi: {none_seen}"
            elif not gpus:
                raise inputs.InputError(
                    f"{name} looks like nvidia-smi -q output but holds no GPU section; {inputs.WHAT}"
                )
            whole = smi.completeness(text)
            if whole.cut:
                raise inputs.InputError(f"{name} is cut off: {whole.cut}; save the whole nvidia-smi -q output again")
            if whole.missing:
                facts.not_checked[f"GPUs missing from {name}"] = whole.missing
            _add_gpus(facts, gpus)
            facts.driver = facts.driver or driver
            if gpus:
                facts.sources[name] = f"nvidia-smi -q: {len(gpus)} GPU(s)" + (f", driver {driver}" if driver else "")
        if what != "smi":
            logs.append((name, text))
    for name, text in logs:
        summary = add_kernel_log(facts, text.splitlines(), name, strict=True)
        if summary is None:
            facts.sources[name] = "not a kernel log: no line of it is a kernel message"
            continue
        label = "kernel log" if name not in facts.sources else facts.sources[name] + "; kernel log"
        facts.sources[name] = f"{label}: {_log_text(summary)}"
    hosts = {h for g in facts.xids for h in g.hosts}
    if not facts.host and len(hosts) == 1:
        facts.host = hosts.pop()
    return facts


def _same_gpu(a: GpuFacts, b: GpuFacts) -> bool:
    """The same board: the same UUID, or without UUIDs the same bus id on the same (or an unnamed) host."""
    if a.uuid and b.uuid:
        return a.uuid == b.uuid
    return bool(a.pci and a.pci == b.pci and (a.host == b.host or not a.host or not b.host))


def _add_gpus(facts: HealthFacts, gpus: list[GpuFacts]) -> None:
    """Each GPU once across the files (`health -o` JSON and `nvidia-smi -q` of the same node name the
    same boards): one seen before keeps what it said and takes what it lacked from the new file."""
    for gpu in gpus:
        seen = next((g for g in facts.gpus if _same_gpu(g, gpu)), None)
        if seen is None:
            facts.gpus.append(gpu)
            continue
        for name in ("index", "pci", "uuid", "serial", "name", "host", "driver", "lost", "unreachable"):
            if getattr(seen, name) is None:
                setattr(seen, name, getattr(gpu, name))
        seen.facts = {**gpu.facts, **seen.facts}
        seen.unavailable = {k: v for k, v in {**gpu.unavailable, **seen.unavailable}.items() if k not in seen.facts}
        seen.source = ", ".join(dict.fromkeys(s for s in (seen.source, gpu.source) if s))


def _merge(facts: HealthFacts, other: HealthFacts, name: str) -> None:
    facts.host = facts.host or other.host
    facts.driver = facts.driver or other.driver
    _add_gpus(facts, other.gpus)
    facts.xids += other.xids
    facts.lost += other.lost
    facts.kernel_logs += other.kernel_logs
    facts.sources[name] = f"health facts JSON: {len(other.gpus)} GPU(s), {len(other.xids)} Xid group(s)"
    facts.sources.update({f"{name}: {k}": v for k, v in other.sources.items()})
    facts.not_checked.update({f"{k} (in {name})": v for k, v in other.not_checked.items()})
    facts.notes += other.notes
    facts.no_gpu = facts.no_gpu or other.no_gpu
    facts.no_driver = facts.no_driver or other.no_driver
