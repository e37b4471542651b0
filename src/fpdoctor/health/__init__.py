"""GPU health: NVML facts, kernel-log Xids, `nvidia-smi -q`, GEMM fingerprints across GPUs and ranks.

`fpdoctor.health()` and `HealthResult` are in api.py; they are named here too and imported on
first use, because this file must import nothing: `import fpdoctor` loads it so that the facade's
`health` stays the function (fpdoctor/__init__.py says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fpdoctor.errors import InputError
    from fpdoctor.health.api import HealthResult, health
    from fpdoctor.health.model import GpuFacts, HealthFacts

_API = {
    "GpuFacts": "fpdoctor.health.model",
    "HealthFacts": "fpdoctor.health.model",
    "HealthResult": "fpdoctor.health.api",
    "InputError": "fpdoctor.errors",
    "health": "fpdoctor.health.api",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GpuFacts", "HealthFacts", "HealthResult", "InputError", "health"]
