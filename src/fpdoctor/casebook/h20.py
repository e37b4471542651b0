"""Incidents 1 and 2: SIGFPE inside cuBLAS on NVIDIA H20, and the upgrade that did not load.

No H20 is needed: the facts are the recorded shape of `fpdoctor env --save-facts` on such a
host, and the crashing GEMM is a real child process that dies of SIGFPE exactly as cuBLAS
makes it die (fault injection), so the probe machinery is exercised end to end.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from fpdoctor.casebook import Case
from fpdoctor.report.model import Report

# The published reproducer: nn.Linear(1024, 18432) in bf16 on a batch of 2 (pytorch/pytorch#133548).
_CRASHING_PROBE = {
    "name": "h20-linear-bf16",
    "dtype": "bf16",
    "shape": [2, 1024, 18432],
    "device": "cpu",
    "fault": "sigfpe",
}


def _facts(name: str) -> dict[str, Any]:
    text = resources.files("fpdoctor.casebook").joinpath(f"data/{name}").read_text(encoding="utf-8")
    facts: dict[str, Any] = json.loads(text)
    return facts


def _diagnose(name: str) -> Report:
    from fpdoctor.env.doctor import diagnose_env

    return diagnose_env(facts=_facts(name), probe=True, probe_specs=[dict(_CRASHING_PROBE)], probe_timeout_s=60)


SIGFPE = Case(
    name="h20-sigfpe",
    incident=1,
    title="SIGFPE in cuBLAS on a new GPU",
    story=(
        "A text-to-video model dies at start-up with 'Fatal Python error: Floating point exception' inside "
        "nn.Linear.forward on 4 x NVIDIA H20 (torch 2.3.1+cu121). Here: fpdoctor reads that host's recorded "
        "facts; its probe runs the published reproducer's shape (bf16 Linear 1024 -> 18432, batch 2) on this CPU "
        "in an isolated child, and the child's death by SIGFPE is injected (this CPU has no cuBLAS to crash), so "
        "what is shown is how a crashing probe is caught and reported."
    ),
    expect=frozenset({"cublas-h20-sigfpe", "probe-crashed"}),
    run=lambda: _diagnose("h20_sigfpe.facts.json"),
)

SHADOWED = Case(
    name="h20-shadowed-cublas",
    incident=2,
    title="The same crash after an A100 -> H20 move, with the fix installed but not loaded",
    story=(
        "Training moved from A100 to H20 dies with 'Signal 8 (SIGFPE)', exit code -8. nvidia-cublas-cu12 was "
        "upgraded to 12.4.5.8, but a CUDA 12.1 toolkit on LD_LIBRARY_PATH still provides the cuBLAS that loads."
    ),
    expect=frozenset({"cublas-h20-sigfpe", "library-shadowed", "duplicate-cuda-library", "probe-crashed"}),
    run=lambda: _diagnose("h20_shadowed_cublas.facts.json"),
)
