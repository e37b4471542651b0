"""Isolated GEMM probes: each dtype in a child process with a timeout (ARCHITECTURE.md, contract 5).

One child runs the probes in order and reports each; if it dies by a signal, the probe in
flight is recorded as crashed and a fresh child continues with the rest, so one crashing
library never hides the other results, and never kills fpdoctor.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from typing import Any

from fpdoctor.env import probe_child
from fpdoctor.env.probe_child import RESULT, START
from fpdoctor.signals import died_of

IMPORT_ALLOWANCE_S = 120.0  # import torch + CUDA init before the first probe starts

# The published H20 reproducers: Linear(1024 -> 18432) in bf16 on a batch of 2
# (pytorch/pytorch#133548) and a 64x14688 @ 14688x1536 fp16 GEMM (pytorch/pytorch#152017).
H20_SHAPES = (("h20-linear-bf16", "bf16", (2, 1024, 18432)), ("h20-gemm-fp16", "fp16", (64, 14688, 1536)))


def default_specs(device: str, capability: tuple[int, int] | None) -> list[dict[str, Any]]:
    """The probe plan for a device: every dtype it supports, then the H20 reproducer shapes."""
    dtypes = ["fp32", "bf16", "fp16"]
    if device == "cuda":
        dtypes.insert(1, "tf32")
        if capability and capability >= (8, 9):
            dtypes.append("fp8_e4m3")
    specs = [{"name": f"gemm-{d}", "dtype": d, "shape": [256, 512, 256], "device": device} for d in dtypes]
    if device == "cuda":
        specs += [{"name": n, "dtype": d, "shape": list(s), "device": device} for n, d, s in H20_SHAPES]
    return specs


STDERR_TAIL = 16384  # characters of the child's stderr kept as evidence: the last lines say why it died


def _reader(stream: Any, out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def _drain(stream: Any, tail: list[str]) -> None:
    """Read `stream` to its end, keeping only its last STDERR_TAIL characters in `tail[0]`.

    The child's stderr must be read while it runs: a child that writes more than the pipe holds
    (64 KiB on Linux: torch warnings, cuBLAS/NCCL debug logging) blocks in write() until someone
    reads, and would look like a hung probe."""
    for chunk in iter(lambda: stream.read(8192), ""):
        tail[0] = (tail[0] + chunk)[-STDERR_TAIL:]


def run_probes(specs: list[dict[str, Any]], *, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Run `specs` in child processes; return one result dict per spec, in order."""
    results: dict[str, dict[str, Any]] = {}
    remaining = list(specs)
    while remaining:
        before = len(results)
        try:
            proc = subprocess.Popen(
                [sys.executable, probe_child.__file__, json.dumps(remaining)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        except OSError as exc:  # no interpreter to start, no processes left: each probe says so
            for spec in remaining:
                results[spec["name"]] = {"status": "error", "error": f"probe child did not start: {exc}"}
            break
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
        tail = [""]
        drainer = threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True)
        drainer.start()
        current: str | None = None
        deadline = time.monotonic() + IMPORT_ALLOWANCE_S + timeout_s
        started = time.monotonic()
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                name = current or remaining[0]["name"]
                results[name] = {"status": "timeout", "seconds": round(time.monotonic() - started, 1)}
                break
            if line is None:
                break
            if line.startswith(START):
                current, started = line[len(START) :], time.monotonic()
                deadline = started + timeout_s
            elif line.startswith(RESULT):
                result = json.loads(line[len(RESULT) :])
                results[result.pop("name")] = result
                current = None
        proc.wait()
        drainer.join(timeout=5.0)  # the pipe closes with the child (a grandchild holding it open is not waited for)
        stderr = tail[0]
        sig = died_of(proc.returncode)
        if sig and current is not None and current not in results:
            results[current] = {
                "status": "crashed",
                "signal": sig,
                "returncode": proc.returncode,
                "stderr_tail": stderr[-500:],
            }
        elif current is None and proc.returncode != 0 and not any(s["name"] in results for s in remaining):
            # The child never reached a probe: torch itself would not import or start.
            for spec in remaining:
                results[spec["name"]] = {
                    "status": "error",
                    "error": (stderr.strip().splitlines() or ["?"])[-1][:300],
                    "signal": sig,
                }
        if len(results) == before:  # the child made no progress: do not start it again
            for spec in remaining:
                results[spec["name"]] = {
                    "status": "error",
                    "signal": sig,
                    "error": f"probe child exited {proc.returncode}: {stderr.strip()[-300:]}",
                }
        remaining = [s for s in remaining if s["name"] not in results]
    return [{**spec, **results[spec["name"]]} for spec in specs]
