"""Live collection on this machine: every source runs independently and in parallel.

`import torch` is the slow part (about 1.8 s on a 2-core CPU), so the torch child starts first
and the other sources run while it imports. A source that fails or is not permitted becomes an
entry in `not_checked` with its reason; it never stops the others.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fpdoctor.env.facts import empty_facts
from fpdoctor.env.sources import gpus, libraries, startup, system, torch_child
from fpdoctor.env.sources.torch_child import MARKER
from fpdoctor.signals import died_of

TORCH_TIMEOUT_S = 180.0  # CUDA initialisation on 8 GPUs with a cold driver can take a minute


def finish_torch_child(proc: subprocess.Popen[str], timeout: float = TORCH_TIMEOUT_S) -> dict[str, Any]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        partial = _last_facts(out) or {"import": "failed"}
        partial["error"] = f"the torch child did not finish within {timeout:.0f} s (stage {partial.get('stage')})"
        return partial
    last = _last_facts(out)
    sig = died_of(proc.returncode)
    if last is None:
        facts: dict[str, Any] = {"import": "failed", "stage": "start"}
        facts["error"] = f"the torch child died by {sig}" if sig else f"the torch child exited {proc.returncode}"
        facts["traceback"] = err[-6000:]
    else:
        facts = last
    if sig:
        facts["signal"] = sig
        facts["stderr"] = err[-6000:]
    return facts


def _last_facts(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            try:
                parsed: dict[str, Any] = json.loads(line[len(MARKER) :])
                return parsed
            except json.JSONDecodeError:
                continue
    return None


def _distributions_and_copies() -> dict[str, Any]:
    found = libraries.scan_distributions()
    copies, not_checked = libraries.library_copies(found["wheels"])
    return {**found, "copies": copies, "not_checked": not_checked}


def _warm_up() -> None:
    """Import and load what judging and rendering need while the torch child is still importing."""
    import fpdoctor.report.redact
    import fpdoctor.report.render  # noqa: F401
    from fpdoctor.env.refdata import refdata
    from fpdoctor.env.rules import all_rules
    from fpdoctor.env.rules.known import _compiled

    all_rules()
    ref = refdata()
    _ = (ref.arch_rows, ref.driver_rows, ref.gpu_rows, ref.bundled_rows, ref.first_cuda_for_sm)
    _compiled()
    import rich.console
    import rich.table  # noqa: F401


def collect_live(*, force_load: bool = True, child: subprocess.Popen[str] | None = None) -> dict[str, Any]:
    """Collect every fact; `child` is a torch child the caller already started (`torch_child.spawn`)."""
    facts = empty_facts("live")
    if child is None:
        child = torch_child.spawn(force_load)
    with ThreadPoolExecutor(max_workers=1) as pool:  # one core stays free for the torch child
        jobs: dict[str, Future[Any]] = {
            "system": pool.submit(system.collect),
            "startup": pool.submit(startup.collect),
            "gpus": pool.submit(gpus.collect),
            "libraries": pool.submit(_distributions_and_copies),
            "warm": pool.submit(_warm_up),
        }
        results: dict[str, Any] = {}
        for name, job in jobs.items():
            try:
                results[name] = job.result()
                if name == "warm":
                    continue
            except Exception as exc:  # one broken source must not hide the others
                facts["not_checked"][name] = f"{type(exc).__name__}: {exc}"
    torch_facts = finish_torch_child(child)

    if "system" in results:
        facts.update(results["system"])
    if "startup" in results:
        facts.update(results["startup"])
    if "gpus" in results:
        gpu_facts, not_checked = results["gpus"]
        facts["gpus"], facts["driver"] = gpu_facts["gpus"], gpu_facts["driver"]
        if not gpu_facts["gpus"]:
            facts["not_checked"].update({f"gpus ({k})": v for k, v in not_checked.items()})
    if "libraries" in results:
        libs = results["libraries"]
        facts["libraries"].update(wheels=libs["wheels"], copies=libs["copies"])
        facts["torch_installs"] = libs["torch_installs"]
        facts["not_checked"].update(libs["not_checked"])

    mapped = torch_facts.pop("mapped", None)
    facts["torch"] = torch_facts
    if mapped is not None:
        facts["libraries"]["loaded"] = libraries.loaded_copies(mapped, facts["libraries"]["copies"])
    elif torch_facts.get("import") == "ok":
        facts["not_checked"]["loaded libraries"] = (
            f"the torch child stopped at stage {torch_facts.get('stage')!r} before reading /proc/self/maps"
        )
    if torch_facts.get("import") == "ok" and "registrations" not in torch_facts:
        why = (torch_facts.get("errors") or {}).get("registrations")
        facts["not_checked"]["ops registered at start-up"] = why or (
            f"the torch child stopped at stage {torch_facts.get('stage')!r} before reading the dispatcher"
        )
    if torch_facts.get("import") == "ok" and not torch_facts.get("cuda_available"):
        facts["not_checked"]["loaded CUDA libraries"] = "CUDA is not available to torch, so none load"
    _merge_torch_devices(facts)
    return facts


def _merge_torch_devices(facts: dict[str, Any]) -> None:
    """Fill compute capabilities NVML could not give from what torch saw (same order)."""
    devices = facts["torch"].get("devices") or []
    if not facts["gpus"] and devices:
        facts["gpus"] = [{**d, "source": "torch"} for d in devices]
        return
    for gpu, dev in zip(facts["gpus"], devices, strict=False):
        if not gpu.get("compute_capability"):
            gpu["compute_capability"] = dev.get("compute_capability")
