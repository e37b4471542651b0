"""One GPU's health over a job: what changed on it since the job started.

The sentinel takes a `Watch` of its GPU when it starts (NVML counters and the kernel log's Xid
counts, one read) and, when a bad step does not reproduce on replay (a transient: the machine, a race,
an uninitialised read or a nondeterministic kernel, told apart by numerics/training/transient.py),
asks what is new on that GPU since: Xid errors on its bus id, ECC counts that grew, rows waiting to be
remapped, the GPU lost. What changed is the machine's evidence, and names the GPU to drain.
Two reads per job at most, none per step. Never raises: what cannot be read is said.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from fpdoctor.health.model import GpuFacts, HealthFacts


@dataclass
class Watch:
    uuid: str
    before: HealthFacts | None = None
    error: str | None = None


@dataclass
class Changes:
    """What is new on one GPU since its `Watch`; `not_checked` says what could not be compared."""

    gpu: str | None = None  # label: index, bus id, name
    pci: str | None = None
    xids: list[dict[str, Any]] = field(default_factory=list)  # xid, count (new), meaning, last_seen
    ecc: dict[str, int] = field(default_factory=dict)  # counter -> increase ("volatile.uncorrected": 2)
    remap_pending: bool = False
    lost: str | None = None
    not_checked: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.xids or self.ecc or self.remap_pending or self.lost)

    def text(self) -> str:
        """One sentence for a finding's message."""
        name = self.gpu or "this GPU"
        if not self.any:
            seen = f"{name} shows no new Xid error, ECC error or pending row remap since the job started"
            return seen + (f" (not checked: {'; '.join(self.not_checked)})" if self.not_checked else "")
        parts = [f"Xid {x['xid']} x{x.get('count', '?')} ({x['meaning']})" for x in self.xids]
        parts += [f"ECC {counter} +{delta}" for counter, delta in self.ecc.items()]
        if self.remap_pending:
            parts.append("a memory row is waiting to be remapped (reset the GPU)")
        if self.lost:
            parts.append(f"lost: {self.lost}")
        return f"since the job started, {name} logged: {'; '.join(parts)}"

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], {}, False)}


def _read() -> HealthFacts:
    from fpdoctor.health.collect import collect_live

    return collect_live()


def start(uuid: str, *, read: Any = None) -> Watch:
    """Take the GPU's state now (`read`: the facts source, tests pass their own)."""
    try:
        return Watch(uuid, (read or _read)())
    except Exception as exc:  # health is a join, never a reason to stop the training
        return Watch(uuid, None, f"{type(exc).__name__}: {exc}")


def _gpu(facts: HealthFacts, uuid: str) -> GpuFacts | None:
    return next((g for g in facts.gpus if g.uuid and g.uuid == uuid), None)


def _counts(facts: HealthFacts, pci: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for group in facts.xids:
        if group.pci == pci:
            counts[group.xid] = counts.get(group.xid, 0) + group.count
    return counts


def since(watch: Watch, *, read: Any = None) -> Changes:
    """What is new on the watched GPU now."""
    from fpdoctor.health.xid import lookup

    changes = Changes()
    if watch.before is None:
        changes.not_checked.append(f"no reading at the start ({watch.error})")
        return changes
    try:
        after = (read or _read)()
    except Exception as exc:
        changes.not_checked.append(f"no reading now ({type(exc).__name__}: {exc})")
        return changes
    gpu, was = _gpu(after, watch.uuid), _gpu(watch.before, watch.uuid)
    if gpu is None:
        why = after.not_checked.get("NVML") or f"NVML does not list {watch.uuid} now"
        changes.not_checked.append(why)
        return changes
    changes.gpu, changes.pci, changes.lost = gpu.label(), gpu.pci, gpu.lost
    if gpu.pci:
        _new_xids(changes, watch.before, after, gpu.pci, lookup)
    if "kernel log" in after.not_checked:
        changes.not_checked.append(f"kernel log: {after.not_checked['kernel log']}")
    if was is None:
        changes.not_checked.append("ECC and row remapping: the GPU was not read at the start")
        return changes
    now, then = gpu.facts.get("ecc", {}), was.facts.get("ecc", {})
    for counter in ("volatile", "aggregate"):
        for kind in ("uncorrected", "corrected"):
            if kind not in now.get(counter, {}) or kind not in then.get(counter, {}):
                continue  # only a counter read both times has a change to tell
            delta = now[counter][kind] - then[counter][kind]
            if delta > 0:
                changes.ecc[f"{counter}.{kind}"] = delta
    if "ecc" in gpu.unavailable:
        changes.not_checked.append(f"ECC: {gpu.unavailable['ecc']}")
    if "remapped_rows" in was.facts:  # new only if read at the start and not pending then
        pending_then = bool(was.facts["remapped_rows"].get("pending"))
        changes.remap_pending = bool(gpu.facts.get("remapped_rows", {}).get("pending")) and not pending_then
    return changes


_ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T")


def _new_xids(changes: Changes, before: HealthFacts, after: HealthFacts, pci: str, lookup: Any) -> None:
    """Xids on `pci` logged since the start: more of them than then, or - when the kernel ring
    buffer rotated old lines out, so counts cannot be compared - a last occurrence later than the
    start reading's last line (ISO timestamps, as `dmesg --time-format iso` and journalctl give)."""
    start_last = max((str(k.get("until") or "") for k in before.kernel_logs), default="")
    old = _counts(before, pci)
    for xid, count in sorted(_counts(after, pci).items()):
        groups = [g for g in after.xids if g.pci == pci and g.xid == xid]
        last = max((g.last_seen or "" for g in groups), default="")
        new: int | None = count - old.get(xid, 0)
        if new is not None and new <= 0:
            later = bool(_ISO.match(last) and _ISO.match(start_last) and last > start_last)
            new = None if later else 0  # None: new, how many unknown
        if new != 0:
            entry = {"xid": xid, "meaning": lookup(xid).explain(), "last_seen": last}
            changes.xids.append({**entry, "count": new} if new is not None else entry)
