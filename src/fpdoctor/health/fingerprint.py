"""GEMM fingerprints per GPU and across GPUs and ranks (`fpdoctor health --duration S`).

Each device runs in its own child process (`python -m fpdoctor.health.fingerprint SPEC`), all in
parallel, with a timeout: a child killed by a signal or stuck in a kernel becomes a finding, and
this process creates no CUDA context (it only counts the GPUs). A child runs known-answer GEMMs,
seeded GEMMs repeated for about `duration` seconds and digested on the device, and times them
(`fpdoctor.health.gemm`). Under torchrun every rank fingerprints its own GPU, one
`all_gather_object` brings every rank's rows to every rank, and `fpdoctor.health.ranks` judges
them by fingerprint group, the same on every rank; rank 0 reports.

Faults are injected in tests and the casebook by passing a `child_command` that runs a script
patching torch.mm inside the child (tests/fixtures/health/): the product has no switch that could
corrupt results.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fpdoctor import progress
from fpdoctor.errors import InputError
from fpdoctor.report.model import Finding
from fpdoctor.signals import died_of

# The child's lines: READY + its identity (so a child that dies later is still named by UUID and
# bus id), START + the step it enters (so a hang or a crash names the step), RESULT + everything.
READY, START, RESULT = "FPDOCTOR-FINGERPRINT-READY:", "FPDOCTOR-FINGERPRINT-START:", "FPDOCTOR-FINGERPRINT-RESULT:"
STARTUP_ALLOWANCE_S = 120.0  # import torch and create a CUDA context, before the work's own clock starts
WORK_SLACK_S = 30.0  # known answers, input generation and the last repeat beyond `duration`
# under torchrun, beyond the slowest child's limit, for every rank to join the merge; a rank started
# with --duration 0 or --from never joins (it reads no fingerprints), and the others stop waiting here
JOIN_SLACK_S = 60.0
STDERR_TAIL = 4000
# cuBLAS is bitwise reproducible run to run only with a fixed per-stream workspace (cuBLAS docs,
# "Results reproducibility"); torch.use_deterministic_algorithms refuses cuBLAS without it. Forced,
# not defaulted, in the child: the workspace size takes part in cuBLAS's choice of kernel.
CUBLAS_WORKSPACE = ":4096:8"
_SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# a device's spec -> the argv of the child that fingerprints it
ChildCommand = Callable[[dict[str, Any]], list[str]]


@dataclass
class FingerprintResult:
    findings: list[Finding] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)  # one per GPU (or per CPU rank)
    notes: list[str] = field(default_factory=list)  # what was not run or not compared, and why
    reporting: bool = True  # False on the ranks other than 0 under torchrun: they print nothing
    shared: list[Any] = field(default_factory=list)  # what `share` returned on each rank, in rank order


def check_duration(duration: Any, *, name: str = "duration") -> float:
    """`duration` in seconds as a float; ValueError (one line, says the fix) when it is not usable.
    `name` is how the caller spells the option ("--duration" on the command line)."""
    if isinstance(duration, bool) or not isinstance(duration, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {duration!r}")
    value = float(duration)
    if not math.isfinite(value) or value < 0:
        example = f"{name} 5" if name.startswith("--") else f"{name}=5"
        raise ValueError(f"{name} must be zero or more seconds, got {duration!r}; e.g. {example}")
    return value


def check_device(device: Any, *, name: str = "device") -> str:
    """'cpu', 'cuda' or 'cuda:N', lower case; ValueError (one line) for anything else."""
    text = device.strip().lower() if isinstance(device, str) else ""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise ValueError(f"{name} must be cpu, cuda or cuda:N, got {device!r}")
    return text


class DeviceNotFound(InputError):
    """`cuda:N` names a GPU this machine does not have (one line, says which exist)."""


def run_fingerprints(
    duration: float,
    *,
    device: str | None = None,
    child_command: ChildCommand | None = None,
    share: Callable[[], Any] | None = None,
) -> FingerprintResult:
    """Fingerprint every visible GPU of this node (`device=None`), one device ("cuda:1", "cpu"),
    or under torchrun this rank's device; every rank returns every rank's rows and the same
    findings, and rank 0 is the one that reports. `child_command` makes the argv of a device's
    child from its spec (default `child_command`). `share`, called on every rank once every rank's
    children are done, reads what each rank is to know of the others (the health facts): its
    results come back in `shared`, in rank order (only this rank's when the ranks are not joined)."""
    from fpdoctor.health import ranks

    duration = check_duration(duration)
    dist = ranks.dist_env()
    with progress.task("health: the GPUs to fingerprint (import torch)"):
        devices, notes = _devices(device, dist)
    limit_s = STARTUP_ALLOWANCE_S + WORK_SLACK_S + 2 * duration
    with contextlib.ExitStack() as shown, ThreadPoolExecutor(max_workers=max(1, len(devices))) as pool:
        done = shown.enter_context(
            progress.task(f"health: GEMM fingerprints, {duration:g} s per device", total=len(devices), unit="devices")
        )
        jobs = []
        for d in devices:
            line = shown.enter_context(progress.task(f"health: {d}: start-up (import torch, create the context)"))
            spec = {"device": d, "duration": duration}
            job = pool.submit(run_child, spec, duration, on_step=line.describe, command=child_command)

            def finished(_: Any, line: progress.Task = line, d: str = d) -> None:
                line.describe(f"health: {d}: done")
                done.advance()

            job.add_done_callback(finished)
            jobs.append(job)
        rows = [_row(job.result(), dist) for job in jobs]
    mine: list[Any] = []  # this rank's share, read once

    def read_share() -> Any:
        if not mine:
            mine.append(share() if share is not None else None)
        return mine[0]

    if dist is not None:
        try:
            # ranks whose children finish later arrive later: the timeout outlasts the slowest child
            with ranks.process_group(dist, timeout_s=limit_s + JOIN_SLACK_S) as group:
                with progress.task(f"health: rank {dist.rank}: gathering every rank's fingerprints"):
                    gathered = ranks.gather(group, {"rows": rows, "notes": notes})
                shared = []
                if share is not None:  # every rank's children are done: what is read now holds what they provoked
                    shared = [part.get("shared") for part in ranks.gather(group, {"shared": read_share()})]
        except Exception as exc:  # a rank that died, a store out of reach: this rank reports alone
            notes.append(f"rank {dist.rank}: fingerprints not compared across ranks ({_one_line(exc)})")
        else:
            rows = [row for part in gathered for row in part.get("rows", [])]
            notes = ranks.merge_notes([(r, part.get("notes", [])) for r, part in enumerate(gathered)])
            findings, judged_notes = ranks.judge(rows)
            return FingerprintResult(
                findings=findings,
                rows=rows,
                notes=notes + judged_notes,
                reporting=dist.rank == 0,
                shared=shared,
            )
    findings, judged_notes = ranks.judge(rows)
    own = [read_share()] if share is not None else []
    return FingerprintResult(findings=findings, rows=rows, notes=notes + judged_notes, shared=own)


def _devices(device: str | None, dist: Any) -> tuple[list[str], list[str]]:
    """Which devices this process fingerprints, and notes for what it leaves out: "cuda:N" that
    GPU; "cuda" or None every GPU of the node, or under torchrun this rank's GPU."""
    text = None if device is None else check_device(device)
    if text == "cpu":
        return ["cpu"], []
    import torch

    count = torch.cuda.device_count()  # NVML or the driver's count; no CUDA context is created
    if text is not None and text.startswith("cuda:"):
        if int(text[5:]) >= count:
            have = f"cuda:0 to cuda:{count - 1}" if count > 1 else "cuda:0" if count else "none; use --device cpu"
            raise DeviceNotFound(f"{text} is not a GPU of this machine (GPUs visible to CUDA: {have})")
        return [text], []
    if count == 0:
        return [], ["no GPU: fingerprints not run; --device cpu runs them on the CPU"]
    if dist is not None:
        return [f"cuda:{dist.local_rank % count}"], []
    return [f"cuda:{i}" for i in range(count)], []


def child_command(spec: dict[str, Any]) -> list[str]:
    """The argv of the child that fingerprints one device: this module run with the spec as JSON."""
    return [sys.executable, "-m", "fpdoctor.health.fingerprint", json.dumps(spec)]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
    return env


def _reader(stream: Any, out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def _drain(stream: Any, tail: list[str]) -> None:
    """Keep reading stderr: a child that fills the pipe (warnings, library logs) would block and look hung."""
    for chunk in iter(lambda: stream.read(8192), ""):
        tail[0] = (tail[0] + chunk)[-STDERR_TAIL:]


def run_child(
    spec: dict[str, Any],
    duration: float,
    *,
    on_step: Callable[[str], None] | None = None,
    command: ChildCommand | None = None,
) -> dict[str, Any]:
    """Run one device's fingerprint in a child; its result, or {"device", "identity", "failure": {...}}.
    `on_step` hears which step the child is in (for the progress display); `command` makes the
    child's argv (default `child_command`)."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            (command or child_command)(spec),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
    except OSError as exc:
        return {"device": spec["device"], "failure": {"kind": "error", "error": f"child did not start: {exc}"}}
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    tail = [""]
    drainer = threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True)
    drainer.start()
    deadline = started + STARTUP_ALLOWANCE_S
    step, result = "start-up (import torch, create the device context)", None
    identity: dict[str, Any] = {}
    startup_s = None
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            seconds = round(time.monotonic() - started, 1)
            timeout = {"kind": "timeout", "step": step, "seconds": seconds}
            return {"device": spec["device"], "identity": identity, "failure": timeout}
        if line is None:
            break
        if line.startswith(READY):
            identity = json.loads(line[len(READY) :])
            startup_s = round(time.monotonic() - started, 3)
            deadline = time.monotonic() + WORK_SLACK_S + 2 * duration
            if on_step is not None:
                on_step(f"health: {spec['device']} ({identity.get('name') or 'ready'})")
        elif line.startswith(START):
            step = line[len(START) :]
            if on_step is not None:
                on_step(f"health: {spec['device']} ({identity.get('name') or 'ready'}): {step}")
        elif line.startswith(RESULT):
            result = json.loads(line[len(RESULT) :])
    proc.wait()
    drainer.join(timeout=5.0)
    if result is not None and proc.returncode == 0:
        # where a node's wall time goes: the child's start (interpreter, torch, the device's
        # context) against its GEMMs (`seconds`), for a budget of 10 s per node
        return {**result, "startup_s": startup_s}
    failure: dict[str, Any] = {"step": step, "returncode": proc.returncode, "stderr_tail": tail[0][-1500:]}
    sig = died_of(proc.returncode)
    if sig:
        failure.update(kind="crashed", signal=sig)
    else:
        last = (tail[0].strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        failure.update(kind="error", error=last[:300])
    return {"device": spec["device"], "identity": identity, "failure": failure}


def _row(result: dict[str, Any], dist: Any) -> dict[str, Any]:
    """The table row of one device: identity, then what its fingerprint says."""
    import socket

    ident = result.get("identity", {})
    known = result.get("known_answer", {})
    seeded = result.get("seeded", {})
    ok_known = {d: r["ok"] for d, r in known.items() if "ok" in r}
    digests = {d: r["digest"] for d, r in seeded.items() if "digest" in r}
    row: dict[str, Any] = {
        "rank": dist.rank if dist is not None else None,
        "host": ident.get("host") or socket.gethostname(),
        "device": result.get("device"),
        "index": ident.get("index"),
        "pci": ident.get("pci"),
        "uuid": ident.get("uuid"),
        "name": ident.get("name"),
        "sm_count": ident.get("sm_count"),
        "threads": ident.get("threads"),
        "isa": ident.get("isa"),
        "mig": ident.get("mig"),
        "cublas": ident.get("cublas"),
        "driver": ident.get("driver"),
        "torch": ident.get("torch"),
        "kind": ident.get("kind"),
        "group": None,  # set by ranks.judge
        "known_answer_ok": all(ok_known.values()) if ok_known else None,
        "known_answer": ok_known,
        "digests": digests,
        "self_consistent": all(r["distinct"] == 1 for r in seeded.values() if "distinct" in r) if digests else None,
        "tflops": {d: float(f"{r['tflops']:.4g}") for d, r in seeded.items() if "tflops" in r},  # CPUs: 0.0005
        "verdict": None,  # set by ranks.judge
        "detail": {k: result[k] for k in ("known_answer", "seeded", "not_run", "errors") if result.get(k)},
    }
    if result.get("startup_s") is not None:
        row["detail"]["seconds"] = {"start-up": result["startup_s"], "work": result.get("seconds")}
    if "failure" in result:
        row["failure"] = result["failure"]
    return row


# --- the child -------------------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()  # CUDA's messages run to several lines of advice
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def child_main(argv: list[str]) -> int:
    """`python -m fpdoctor.health.fingerprint SPEC`: fingerprint one device, print one result line."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # before torch creates a cuBLAS handle
    spec = json.loads(argv[0])
    import torch

    from fpdoctor.health import device_id, gemm

    device = torch.device(spec["device"])
    gemm.deterministic(device)
    identity = device_id.describe(device)
    print(READY + json.dumps(identity), flush=True)
    started = time.perf_counter()
    shapes = gemm.GPU_SHAPES if device.type == "cuda" else gemm.CPU_SHAPES
    out: dict[str, Any] = {"device": spec["device"], "known_answer": {}, "seeded": {}, "not_run": {}, "errors": {}}
    dtypes = []
    for name in spec.get("dtypes") or gemm.DTYPES:
        reason = gemm.supported(name, device)
        if reason:
            out["not_run"][name] = reason
        else:
            dtypes.append(name)
    for name in dtypes:
        print(f"{START}known answer {name}", flush=True)
        try:
            out["known_answer"][name] = gemm.known_answer(name, device, shapes.known_mn)
        except Exception as exc:  # an exception (out of memory, an unsupported kernel) is a result
            out["errors"][f"known answer {name}"] = _one_line(exc)
    for i, name in enumerate(dtypes):
        budget = max(0.0, float(spec["duration"]) - (time.perf_counter() - started)) / (len(dtypes) - i)
        print(f"{START}seeded {name}", flush=True)
        try:
            out["seeded"][name] = gemm.seeded(name, device, shapes.mn, shapes.k[name], budget)
        except Exception as exc:
            out["errors"][f"seeded {name}"] = _one_line(exc)
    if device.type == "cuda":
        identity["cublas"] = device_id.cublas_version() or f"cuda {torch.version.cuda} (cuBLAS not read)"
    out["identity"] = identity
    out["seconds"] = round(time.perf_counter() - started, 3)
    print(RESULT + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = child_main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the slow teardown of an interpreter that holds a CUDA context
