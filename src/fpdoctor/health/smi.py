"""Health facts from saved `nvidia-smi -q` text (whole output, `-d ECC,ROW_REMAPPER,...`, or an excerpt).

The output is an indented tree of `Key : Value` lines under one `GPU 00000000:52:00.0` header per
GPU. Layouts differ by driver: before ~R470 ECC counts are "Single Bit"/"Double Bit" with a
"Total"; later ones split SRAM/DRAM, and R550+ split SRAM uncorrectable into Parity and SEC-DED
and add "SRAM Threshold Exceeded"; R580 adds repair flags ("Channel Repair Pending") and nests
"HW Thermal Slowdown" under "HW Slowdown". "N/A" is nvidia-smi's "not supported or not
applicable"; other non-numbers ("Unknown Error", seen after an uncorrectable error) are "not read".

A GPU nvidia-smi cannot open has one line instead of its section, "Unable to determine the device
handle for GPU 00000000:47:00.0: Unknown Error": that GPU is unusable (lost, hung, unpowered), not
missing from the output. With the driver loaded and no GPU to see, nvidia-smi prints only "No
devices were found"; when it cannot talk to the driver, "NVIDIA-SMI has failed because it couldn't
communicate with the NVIDIA driver" or "Failed to initialize NVML: Driver/library version
mismatch": no GPU of the node can be used either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fpdoctor.health.kernel_log import normalize_pci
from fpdoctor.health.model import CLOCK_REASONS, NOT_SUPPORTED, GpuFacts
from fpdoctor.health.nvml import NOT_ABOUT_THE_GPU, ROW_REMAP_PRODUCTS

_PCI = r"[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]"
_GPU_HEADER = re.compile(rf"^GPU (?P<pci>{_PCI})\s*$")
# the line nvidia-smi prints in place of the section of a GPU it cannot open; the reason is NVML's
# error string ("Unknown Error", "GPU is lost. Reboot the system to recover this GPU", ...)
# (`nvidia-smi` without -q spells it "for gpu")
_UNOPENED = re.compile(
    rf"^\s*Unable to determine the device handle for GPU\s*(?P<pci>{_PCI})\s*:\s*(?P<why>.*?)\s*$", re.IGNORECASE
)
_NO_DEVICES = re.compile(r"^\s*No devices were found\s*$", re.M)
# nvidia-smi that cannot talk to the driver at all: no GPU of the node can be used (a driver upgraded
# without a reboot, a driver that is not loaded or hung); NVML's "Insufficient Permissions" says
# nothing of the GPUs
_DRIVER_FAILED = re.compile(
    r"^\s*(?:NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\b.*"
    r"|Failed to initialize NVML: (?P<why>.+?))\s*$",
    re.M,
)
_LINE = re.compile(r"^(?P<indent>\s*)(?P<key>[^:]+?)\s*(?::\s?(?P<value>.*))?$")
_SECTIONS = ("ECC Errors", "Remapped Rows", "Retired Pages", "Clocks Event Reasons", "Clocks Throttle Reasons")
_REASON_BY_LABEL = {label.lower(): name for name, label in CLOCK_REASONS.values()}
# health facts a saved output may leave out (`-d ECC` has no clocks): said, never assumed healthy
_EXPECTED = ("ecc", "remapped_rows", "clock_event_reasons")

Entries = list[tuple[tuple[str, ...], str | None]]


def looks_like_smi(text: str) -> bool:
    if "NVSMI LOG" in text or _NO_DEVICES.search(text) or driver_failed(text):
        return True
    if any(_GPU_HEADER.match(line) or _UNOPENED.match(line) for line in text.splitlines()):
        return True
    return sum(bool(re.search(rf"^\s+{re.escape(s)}\s*(?::.*)?$", text, re.M)) for s in _SECTIONS) >= 1


def _tree(lines: list[str]) -> Entries:
    """(path, value) for every line; a key with a value can still have children (R580 HW Slowdown)."""
    entries: Entries = []
    stack: list[tuple[int, str]] = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("="):
            continue
        m = _LINE.match(line.rstrip())
        if m is None:
            continue
        indent = len(m["indent"].expandtabs(4))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = m["key"].strip()
        value = m["value"].strip() if m["value"] is not None else None
        entries.append(((*(name for _, name in stack), key), value))
        stack.append((indent, key))
    return entries


def _get(entries: Entries, *path: str) -> str | None:
    return next((v for p, v in entries if p[-len(path) :] == path and len(p) == len(path)), None)


def _under(entries: Entries, *prefix: str) -> Entries:
    return [(p[len(prefix) :], v) for p, v in entries if p[: len(prefix)] == prefix and len(p) > len(prefix)]


def _int(value: str | None) -> int | None:
    m = re.match(r"^\s*(-?\d+)", value or "")
    return int(m[1]) if m else None


def _float(value: str | None) -> float | None:
    m = re.match(r"^\s*(-?\d+(?:\.\d+)?)", value or "")
    return float(m[1]) if m else None


def _why(value: str | None) -> str:
    if value is None:
        return "not in this nvidia-smi -q output"
    if value.strip().upper() == "N/A":
        return f"{NOT_SUPPORTED} (N/A in nvidia-smi -q)"
    return f"not read: nvidia-smi -q shows {value.strip()!r}"


def _yes(value: str | None) -> bool | None:
    v = (value or "").strip().lower()
    return True if v in ("yes", "active") else False if v in ("no", "not active") else None


def _ecc(gpu: GpuFacts, e: Entries) -> None:
    mode = {k: _get(e, "ECC Mode", k) for k in ("Current", "Pending")}
    if mode["Current"] and mode["Current"].lower() in ("enabled", "disabled"):
        gpu.facts["ecc_mode"] = {k.lower(): (v or "").lower() for k, v in mode.items()}
    elif "ECC Mode" in {p[0] for p, _ in e}:
        gpu.unavailable["ecc_mode"] = _why(mode["Current"])
    counts: dict[str, dict[str, Any]] = {}
    seen: list[str | None] = []
    for counter in ("Volatile", "Aggregate"):
        rows = _under(e, "ECC Errors", counter)
        values = {p: v for p, v in rows}
        seen += list(values.values())
        out: dict[str, Any] = {}
        total = {
            kind: _int(values.get((bits, "Total")))
            for kind, bits in (("corrected", "Single Bit"), ("uncorrected", "Double Bit"))
        }
        if any(v is not None for v in total.values()):  # drivers before ~R470
            out = {k: v for k, v in total.items() if v is not None}
        else:
            parts = {p[0]: _int(v) for p, v in rows if len(p) == 1}
            sram_unc = parts.get("SRAM Uncorrectable")
            if sram_unc is None and parts.get("SRAM Uncorrectable Parity") is not None:
                sram_unc = (parts.get("SRAM Uncorrectable Parity") or 0) + (
                    parts.get("SRAM Uncorrectable SEC-DED") or 0
                )
            split = {
                "sram_corrected": parts.get("SRAM Correctable"),
                "dram_corrected": parts.get("DRAM Correctable"),
                "sram_uncorrected": sram_unc,
                "dram_uncorrected": parts.get("DRAM Uncorrectable"),
            }
            known = {k: v for k, v in split.items() if v is not None}
            if known:
                out = {
                    "uncorrected": (known.get("sram_uncorrected") or 0) + (known.get("dram_uncorrected") or 0),
                    "corrected": (known.get("sram_corrected") or 0) + (known.get("dram_corrected") or 0),
                    **known,
                }
        if out:
            counts[counter.lower()] = out
    threshold = _yes(_get(e, "ECC Errors", "Aggregate", "SRAM Threshold Exceeded"))
    if counts:
        gpu.facts["ecc"] = counts
        if threshold is not None:
            counts.setdefault("aggregate", {})["sram_threshold_exceeded"] = threshold
    elif seen:
        na = [v for v in seen if v is not None]
        why = _why(na[0] if na else None)
        if gpu.unavailable.get("ecc_mode", "").startswith("not read"):
            why = f"not read: nvidia-smi -q shows N/A while ECC mode reads {mode['Current']!r}"
        gpu.unavailable["ecc"] = why
    repairs = {
        k: _yes(_get(e, "ECC Errors", label))
        for k, label in (
            ("channel_repair_pending", "Channel Repair Pending"),
            ("tpc_repair_pending", "TPC Repair Pending"),
            ("unrepairable_memory", "Unrepairable Memory"),
        )
    }
    if any(v is not None for v in repairs.values()):
        gpu.facts["memory_repair"] = {k: v for k, v in repairs.items() if v is not None}


def _pages_and_rows(gpu: GpuFacts, e: Entries) -> None:
    pages = _under(e, "Retired Pages")
    if pages:
        values = {p[0]: v for p, v in pages if len(p) == 1}
        found = {"single_bit": _int(values.get("Single Bit ECC")), "double_bit": _int(values.get("Double Bit ECC"))}
        pending = next((_yes(v) for k, v in values.items() if k.startswith("Pending")), None)
        page_facts = {k: v for k, v in (*found.items(), ("pending", pending)) if v is not None}
        if page_facts:
            gpu.facts["retired_pages"] = page_facts
        else:
            gpu.unavailable["retired_pages"] = _why(next(iter(values.values()), None))
    elif (v := _get(e, "Retired Pages")) is not None:
        gpu.unavailable["retired_pages"] = _why(v)

    rows = {p[0]: v for p, v in _under(e, "Remapped Rows") if len(p) == 1}
    if not rows:
        if (v := _get(e, "Remapped Rows")) is not None:
            gpu.unavailable["remapped_rows"] = _why(v)
        return
    facts: dict[str, Any] = {
        "correctable": _int(rows.get("Correctable Error")),
        "uncorrectable": _int(rows.get("Uncorrectable Error")),
        "pending": _yes(rows.get("Pending")),
        "failure": _yes(rows.get("Remapping Failure Occurred")),
    }
    facts = {k: v for k, v in facts.items() if v is not None}
    if not facts:
        gpu.unavailable["remapped_rows"] = _why(next(iter(rows.values()), None))
    elif gpu.name and not ROW_REMAP_PRODUCTS.search(gpu.name) and not any(facts.values()):
        gpu.unavailable["remapped_rows"] = f"not trusted: {gpu.name} is not known to have a row remapper"
    else:
        gpu.facts["remapped_rows"] = facts


def _clocks(gpu: GpuFacts, e: Entries) -> None:
    for section in ("Clocks Event Reasons", "Clocks Throttle Reasons"):
        rows = _under(e, section)
        if rows:
            active = [_REASON_BY_LABEL[p[-1].lower()] for p, v in rows if p[-1].lower() in _REASON_BY_LABEL and _yes(v)]
            gpu.facts["clock_event_reasons"] = active
            return
        if (v := _get(e, section)) is not None:
            gpu.unavailable["clock_event_reasons"] = _why(v)
            return


def _recovery(gpu: GpuFacts, e: Entries) -> None:
    action = _get(e, "GPU Recovery Action")
    if action is not None:
        text = action.strip().lower()
        for word, name in (
            ("none", "none"),
            ("drain", "drain_and_reset"),
            ("reboot", "node_reboot"),
            ("reset", "gpu_reset"),
        ):
            if word in text:
                gpu.facts["recovery_action"] = name
                return
        gpu.unavailable["recovery_action"] = _why(action)
        return
    reset = _yes(_get(e, "GPU Reset Status", "Reset Required"))
    drain = _yes(_get(e, "GPU Reset Status", "Drain and Reset Recommended"))
    if reset is not None or drain is not None:
        gpu.facts["recovery_action"] = "drain_and_reset" if drain else "gpu_reset" if reset else "none"


def _gpu(pci: str | None, lines: list[str], driver: str | None) -> GpuFacts:
    e = _tree(lines)
    gpu = GpuFacts(pci=normalize_pci(pci) if pci else None, driver=driver, source="nvidia-smi -q")
    for attr, key in (("name", "Product Name"), ("uuid", "GPU UUID"), ("serial", "Serial Number")):
        value = _get(e, key)
        if value and value.upper() != "N/A":
            setattr(gpu, attr, value)
    if gpu.pci is None and (bus := _get(e, "PCI", "Bus Id")):
        gpu.pci = normalize_pci(bus)
    _ecc(gpu, e)
    _pages_and_rows(gpu, e)
    _clocks(gpu, e)
    temp = _int(_get(e, "Temperature", "GPU Current Temp"))
    if temp is not None:
        gpu.facts["temperature_c"] = temp
    for section in ("GPU Power Readings", "Power Readings"):
        power = {p[0]: v for p, v in _under(e, section) if len(p) == 1}
        draw = next(
            (
                _float(power[k])
                for k in ("Power Draw", "Average Power Draw", "Instantaneous Power Draw")
                if _float(power.get(k)) is not None
            ),
            None,
        )
        limit = next(
            (
                _float(power[k])
                for k in ("Current Power Limit", "Enforced Power Limit", "Power Limit")
                if _float(power.get(k)) is not None
            ),
            None,
        )
        if draw is not None:
            gpu.facts["power_w"] = draw
        if limit is not None:
            gpu.facts["power_limit_w"] = limit
    replays = _int(_get(e, "PCI", "Replays Since Reset"))
    if replays is not None:
        gpu.facts["pcie_replays"] = replays
    _recovery(gpu, e)
    for key in _EXPECTED:
        if key not in gpu.facts and key not in gpu.unavailable:
            gpu.unavailable[key] = _why(None)
    return gpu


def _unopened_gpu(line: str, driver: str | None) -> GpuFacts:
    """The GPU of an "Unable to determine the device handle" line: lost, unreachable, or (when
    nvidia-smi was not allowed to open it) its facts not read."""
    m = _UNOPENED.match(line)
    pci, why = (m["pci"], m["why"]) if m else (None, "")
    gpu = GpuFacts(pci=normalize_pci(pci) if pci else None, driver=driver, source="nvidia-smi -q")
    if why.startswith("GPU is lost"):
        gpu.lost = f"nvidia-smi -q: {line.strip()}"
    elif why.startswith(NOT_ABOUT_THE_GPU):
        gpu.unavailable["device_handle"] = f"not read: nvidia-smi -q shows {line.strip()!r}"
    else:
        gpu.unreachable = line.strip()
    return gpu


# One GPU of the output, in order: its bus id, its section's lines, and the line that stands in
# for the section of a GPU nvidia-smi could not open (None for a section).
Part = tuple[str | None, list[str], str | None]


def _blocks(lines: list[str]) -> tuple[list[str], list[Part]]:
    """(the lines before the first GPU, [(bus id, the GPU's lines, the unopened line)])."""
    head: list[str] = []
    blocks: list[Part] = []
    current: list[str] | None = None
    for line in lines:
        if m := _GPU_HEADER.match(line):
            blocks.append((m["pci"], [], None))
            current = blocks[-1][1]
        elif m := _UNOPENED.match(line):
            blocks.append((m["pci"], [], line))
            current = None
        elif current is not None and (not line.strip() or line[:1].isspace()):
            current.append(line)
        elif current is not None:
            current = None  # a non-indented line ends the GPU (e.g. the next section of a bug report)
        elif not blocks:
            head.append(line)
    return head, blocks


@dataclass
class Completeness:
    cut: str | None = None  # where the text stops inside a GPU's section, in words
    missing: str | None = None  # GPUs the header counts that the text does not hold, in words


# sections whose length differs from GPU to GPU (one entry per process or MIG device)
_VARYING = ("Processes", "MIG devices")


def _shape(lines: list[str]) -> list[tuple[str, ...]]:
    """The keys of one GPU's section, two levels deep, leaving out the entries of _VARYING sections."""
    return list(dict.fromkeys(p[:2] for p, _ in _tree(lines) if not (p[0] in _VARYING and len(p) > 1)))


def _goes_on(whole: list[tuple[str, ...]], part: list[tuple[str, ...]]) -> bool:
    return len(whole) > len(part) and whole[: len(part)] == part


def completeness(text: str) -> Completeness:
    """Whether `nvidia-smi -q` text holds every GPU it says is attached, and each of them whole.

    Cut off: the text ends on a key without a value (a section header with nothing under it, or a
    line cut before its colon), or the last GPU's section stops where an earlier GPU's goes on.
    Missing: 'Attached GPUs' counts more GPUs than the text holds and none of them is cut; `-i`
    selects GPUs this way too, so the others are said to be not checked rather than refused."""
    head, blocks = _blocks(text.splitlines())
    if not blocks:
        return Completeness()
    attached = _int(_get(_tree(head), "Attached GPUs"))
    pci, lines, unopened = blocks[-1]
    entries = _tree(lines)
    last = entries[-1] if entries else None
    shape = _shape(lines)
    sections = [b for b in blocks[:-1] if b[2] is None]
    fuller = next((b for b in sections if _goes_on(_shape(b[1]), shape)), None)
    name = normalize_pci(pci) if pci else "?"
    cut = (last is not None and last[1] is None) or fuller is not None or (last is None and attached)
    # a text that ends on an unopened GPU's line went on after every section before it
    if unopened is None and cut:
        where = f"after '{' / '.join(last[0])}'" if last is not None else "right after its header"
        others = f" where GPU {normalize_pci(fuller[0] or '?')} goes on" if fuller is not None else ""
        gone = attached - len(blocks) if attached else 0
        rest = f", and {gone} of the {attached} GPUs 'Attached GPUs' counts are not in it at all" if gone > 0 else ""
        return Completeness(cut=f"the section of GPU {name} stops {where}{others}{rest}")
    if attached and attached > len(blocks):
        held = ", ".join(normalize_pci(p) if p else "?" for p, _, _ in blocks)
        return Completeness(
            missing=f"'Attached GPUs' counts {attached} but the output holds {len(blocks)} ({held}): the other "
            f"{attached - len(blocks)} are not checked (`nvidia-smi -q -i ...` output, or cut off between GPUs?)"
        )
    return Completeness()


def parse(text: str) -> tuple[list[GpuFacts], str | None]:
    """(GPUs, driver version) from `nvidia-smi -q` text; an excerpt without a GPU header is one GPU."""
    lines = text.splitlines()
    head, blocks = _blocks(lines)
    top = _tree(head)
    driver = _get(top, "Driver Version")
    if not blocks:
        gpu = _gpu(None, lines, driver)
        return ([gpu] if gpu.facts or gpu.name else []), driver
    gpus = [_gpu(pci, block, driver) if line is None else _unopened_gpu(line, driver) for pci, block, line in blocks]
    attached = _int(_get(top, "Attached GPUs"))
    if attached == len(gpus):  # nvidia-smi lists every GPU in index order
        for i, gpu in enumerate(gpus):
            gpu.index = i
    return gpus, driver


def driver_failed(text: str) -> str | None:
    """nvidia-smi's line when it cannot talk to the driver ("NVIDIA-SMI has failed because it
    couldn't communicate with the NVIDIA driver ...", "Failed to initialize NVML: Driver/library
    version mismatch"), else None; NVML refused for lack of permission says nothing of the GPUs."""
    for m in _DRIVER_FAILED.finditer(text):
        if not (m["why"] or "").startswith(NOT_ABOUT_THE_GPU):
            return m[0].strip()
    return None


def no_devices(text: str) -> str | None:
    """nvidia-smi's own words when it sees no GPU at all ("No devices were found", "NVIDIA-SMI has
    failed because it couldn't communicate with the NVIDIA driver", or an 'Attached GPUs : 0' header
    with no GPU after it), else None."""
    if m := _NO_DEVICES.search(text):
        return m[0].strip()
    if failed := driver_failed(text):
        return failed
    head, blocks = _blocks(text.splitlines())
    if not blocks and _int(_get(_tree(head), "Attached GPUs")) == 0:
        return next(line.strip() for line in head if line.strip().startswith("Attached GPUs"))
    return None
