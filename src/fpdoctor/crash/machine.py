"""What the machine says about a crash: the environment doctor's verdicts and new kernel-log lines.

Both are read only when something failed, in the background while the report is assembled,
and each is bounded in time: a GPU in a bad state can make `import torch` or a kernel-log read
slow, and the report is due within seconds of the death.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fpdoctor.report.model import Finding, Severity

ENV_TIMEOUT_S = 3.0


@dataclass
class Environment:
    """The environment doctor's warnings and errors, from this machine or a saved facts file."""

    findings: list[Finding] = field(default_factory=list)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    source: str = ""
    note: str | None = None  # why the verdicts are missing or partial


class EnvironmentJoin:
    """Collect and judge the environment in a thread; `result()` waits a bounded time for it."""

    def __init__(self, env_from: dict[str, Any] | None, source: str | None) -> None:
        self._facts = env_from
        self._source = source
        self._texts: list[str] = []
        self._result: Environment | None = None
        self._thread: threading.Thread | None = None
        self._child: Any = None

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._facts is None:
            # the torch child starts now, in this thread: its import is most of the time
            from fpdoctor.env.sources import torch_child

            with contextlib.suppress(OSError):
                self._child = torch_child.spawn(False)  # no GEMM: it would crash again on the same bug
            with contextlib.suppress(OSError, AttributeError):
                # below the job's priority: a launcher still printing its summary comes first
                os.setpriority(os.PRIO_PROCESS, self._child.pid, 10)
        self._thread = threading.Thread(target=self._run, name="fpdoctor-env", daemon=True)
        self._thread.start()

    def result(self, texts: list[str], timeout: float = ENV_TIMEOUT_S) -> Environment:
        self._texts = texts
        self.start()
        assert self._thread is not None
        self._thread.join(timeout)
        if self._result is None:
            if self._child is not None and self._child.poll() is None:
                self._child.kill()
            return Environment(
                source=self._source or "this machine",
                note=f"not joined: collecting the environment took longer than {timeout:.0f} s; run `fpdoctor env`",
            )
        return self._result

    def _run(self) -> None:
        try:
            self._result = self._judge()
        except Exception as exc:  # ours: the crash report is still written without the verdicts
            self._result = Environment(source=self._source or "this machine", note=f"{type(exc).__name__}: {exc}")

    def _judge(self) -> Environment:
        from copy import deepcopy

        from fpdoctor.env.doctor import diagnose_env

        if self._facts is not None:
            facts = deepcopy(self._facts)
            source = self._source or "saved facts"
        else:
            from fpdoctor.env.collect import collect_live

            facts = collect_live(force_load=False, child=self._child)
            source = "this machine (no probes)"
        # Give the rules the crash's own text (faulthandler headers, native frames) as symptoms,
        # except on a live machine without GPUs: there a GPU library's signature cannot apply.
        deadline = time.monotonic() + 1.0
        while not self._texts and time.monotonic() < deadline:
            time.sleep(0.01)
        if facts.get("gpus") or self._facts is not None:
            facts["texts"] = [*(facts.get("texts") or []), *self._texts]
        report = diagnose_env(facts=facts, probe=False)
        kept = [f for f in report.findings if f.severity is not Severity.INFO]
        return Environment(findings=kept, gpus=list(facts.get("gpus") or []), source=source)


# a GPU or MIG instance's UUID as nvidia-smi -L prints it (CUDA_VISIBLE_DEVICES may hold a prefix)
_FULL_UUID = re.compile(r"(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def gpu_for(gpus: list[dict[str, Any]], visible: str | None, device: int | None) -> dict[str, Any]:
    """The physical GPU behind `cuda:<device>` under CUDA_VISIBLE_DEVICES, as far as known."""
    if device is None:
        return {}
    entry: dict[str, Any] = {"cuda": device}
    physical: int | str | None = device
    if visible is not None:
        listed = [v.strip() for v in visible.split(",") if v.strip()]
        physical = listed[device] if device < len(listed) else None
    match = None
    if isinstance(physical, str) and not physical.isdigit():
        match = next((g for g in gpus if str(g.get("uuid", "")).startswith(physical)), None)
        if match is None and _FULL_UUID.fullmatch(physical):
            entry["uuid"] = physical  # named in full: known without the GPU list
    elif physical is not None:
        match = next((g for g in gpus if g.get("index") == int(physical)), None)
        entry["index"] = int(physical)
    if match is not None:
        entry.update({k: match[k] for k in ("index", "uuid", "name", "pci_bus_id") if match.get(k) is not None})
    return entry


@dataclass
class KernelLog:
    lines: list[str] = field(default_factory=list)  # new NVIDIA lines, with their time
    findings: list[Finding] = field(default_factory=list)  # xid-error / gpu-lost for them
    oom_killed: dict[int, str] = field(default_factory=dict)  # pid -> the OOM killer's line
    note: str | None = None  # why the log was not read, or what is uncertain


KERNEL_TIMEOUT_S = 2.0
SLACK_S = 1.0  # kernel and wall clocks drift; a line a second before the start still counts as new
_OOM = re.compile(r"(?:Killed process|oom-kill:.*?\bpid=|Out of memory: Kill(?:ed)? process) ?(?P<pid>\d+)")


def kernel_log_since(start: float, timeout: float = KERNEL_TIMEOUT_S) -> KernelLog:
    """New NVIDIA lines in this machine's kernel log since `start` (time.time()), through the
    hardware-health reader, and the pids the out-of-memory killer named; bounded in time."""
    try:
        from fpdoctor.health import kernel_sources
    except ImportError:
        return KernelLog(note="not read: this fpdoctor has no kernel-log reader (fpdoctor.health)")
    box: list[Any] = []
    reader = threading.Thread(target=lambda: box.append(kernel_sources.read_live()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        return KernelLog(note=f"not read: reading it took longer than {timeout:g} s")
    text = box[0]
    if text.source is None:
        return KernelLog(note="not read: " + "; ".join(f"{name}: {why}" for name, why in text.tried.items()))
    return new_lines(text.lines, start, boot_time())


def boot_time() -> float | None:
    """When this machine booted, in time.time() terms (Linux /proc/uptime)."""
    try:
        with open("/proc/uptime", encoding="ascii") as fh:
            return time.time() - float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _epoch(stamp: Any, boot: float | None, last_boot: int) -> float | None:
    if stamp.wall:
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(stamp.wall).timestamp()
    if stamp.uptime is not None and boot is not None and stamp.boot == last_boot:
        return boot + stamp.uptime
    return None


_UPTIME = re.compile(r"^\s*\[\s*(?P<s>\d+\.\d+)\]")
_ISO_START = re.compile(r"^\s*(?:kern\s*:\s*\w+\s*:\s*)?(?P<t>\d{4}-\d{2}-\d{2}[T ][\d:.,]+(?:Z|[+-]\d{2}:?\d{2})?)")


def _line_time(line: str, boot: float | None) -> float | None:
    """A kernel-log line's time from its own prefix (dmesg's uptime or an ISO time), if it has one."""
    m = _ISO_START.match(line)
    if m:
        with contextlib.suppress(ValueError):
            return datetime.datetime.fromisoformat(m["t"].replace(",", ".").replace("Z", "+00:00")).timestamp()
    m = _UPTIME.match(line)
    return boot + float(m["s"]) if m and boot is not None else None


def new_lines(lines: list[str], start: float, boot: float | None) -> KernelLog:
    """The part of a kernel log that is newer than `start`: Xid and fallen-off-the-bus events
    as the health module parses and judges them, and the OOM killer's victims."""
    from fpdoctor.health import kernel_log
    from fpdoctor.health.findings import lost_findings, xid_findings
    from fpdoctor.health.model import HealthFacts, LostGpu

    parsed = kernel_log.parse(lines)
    last_boot = parsed.boots - 1
    undated = 0

    def new(stamp: Any) -> bool:
        nonlocal undated
        when = _epoch(stamp, boot, last_boot)
        if when is None:
            undated += 1
            return False
        return when >= start - SLACK_S

    xids = [e for e in parsed.xids if new(e.stamp)]
    lost = [e for e in parsed.lost if new(e.stamp)]
    out = KernelLog()
    events: list[Any] = sorted([*xids, *lost], key=lambda e: e.line_no)
    out.lines = [f"{e.stamp.text() or ''} {e.message}".strip() for e in events]
    facts = HealthFacts(
        host=socket.gethostname(),
        driver=parsed.drivers[-1] if parsed.drivers else None,
        xids=kernel_log.group(xids, driver=parsed.drivers[-1] if parsed.drivers else None),
        lost=[
            LostGpu(
                pci=e.pci,
                via="Xid 79" if e.xid == 79 else "kernel log message",
                first_seen=e.stamp.text(),
                line=e.message[:400],
            )
            for e in lost
        ],
    )
    out.findings = xid_findings(facts) + lost_findings(facts)
    for line in lines:
        m = _OOM.search(line)
        if m and (when := _line_time(line, boot)) is not None and when >= start - SLACK_S:
            out.oom_killed[int(m["pid"])] = line.strip()[:300]
    if undated:
        out.note = f"{undated} NVIDIA line(s) without a usable time were left out (not provably new)"
    return out
