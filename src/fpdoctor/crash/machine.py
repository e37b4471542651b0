"""What the machine says about a crash: the environment doctor's verdicts and new kernel-log lines.

Both are read only when something failed, in the background while the report is assembled,
and each is bounded in time: a GPU in a bad state can make `import torch` or a kernel-log read
slow, and the report is due within seconds of the death.
"""

from __future__ import annotations

import contextlib
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
    elif physical is not None:
        match = next((g for g in gpus if g.get("index") == int(physical)), None)
        entry["index"] = int(physical)
    if match is not None:
        entry.update({k: match[k] for k in ("index", "uuid", "name", "pci_bus_id") if match.get(k) is not None})
    return entry


@dataclass
class KernelLog:
    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    note: str | None = None


def kernel_log_since(start: float) -> KernelLog:
    """New NVIDIA lines in the kernel log since `start`, through the hardware-health reader."""
    try:
        from fpdoctor.health import kernel_log
    except ImportError:
        return KernelLog(note="kernel log not read: this fpdoctor has no kernel-log reader (fpdoctor.health)")
    reader = getattr(kernel_log, "read_since", None)
    if reader is None:
        return KernelLog(note="kernel log not read: fpdoctor.health.kernel_log has no read_since()")
    try:
        result = reader(start)
    except Exception as exc:
        return KernelLog(note=f"kernel log not read: {type(exc).__name__}: {exc}")
    return KernelLog(
        lines=[str(x) for x in getattr(result, "lines", []) or []],
        findings=list(getattr(result, "findings", []) or []),
        note=getattr(result, "note", None),
    )
