"""fpdoctor: why a PyTorch workload crashes with SIGFPE, produces NaN/Inf or silently loses
accuracy after a change of precision, device, GPU model or library version - and what to do.

Importing fpdoctor never imports torch and never initialises CUDA (ARCHITECTURE.md, contract 3): the public
functions import what they need when they are called.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fpdoctor._version import __version__

if TYPE_CHECKING:
    from fpdoctor.env.diff import diff_env
    from fpdoctor.env.doctor import diagnose_env
    from fpdoctor.health.api import HealthResult, health
    from fpdoctor.integrations.script import ScriptWatch, watch
    from fpdoctor.numerics.api import Trace, trace
    from fpdoctor.numerics.trace.tracer import NonFiniteError
    from fpdoctor.numerics.training.sentinel import Sentinel
    from fpdoctor.precision.audit.audit import audit
    from fpdoctor.precision.audit.boundary import keep_in_fp32
    from fpdoctor.precision.audit.harmonize import harmonize
    from fpdoctor.precision.compare.compare import compare
    from fpdoctor.precision.plan.plan import apply_plan, plan
    from fpdoctor.precision.record.record import CompareRecord
    from fpdoctor.report.model import Finding, Report, Severity, Trial

# Public name -> module that defines it; imported on first use, so `import fpdoctor` stays cheap.
_LAZY = {
    "CompareRecord": "fpdoctor.precision.record.record",
    "Finding": "fpdoctor.report.model",
    "Report": "fpdoctor.report.model",
    "Severity": "fpdoctor.report.model",
    "Trial": "fpdoctor.report.model",
    "NonFiniteError": "fpdoctor.numerics.trace.tracer",
    "Sentinel": "fpdoctor.numerics.training.sentinel",
    "ScriptWatch": "fpdoctor.integrations.script",
    "Trace": "fpdoctor.numerics.api",
    "apply_plan": "fpdoctor.precision.plan.plan",
    "audit": "fpdoctor.precision.audit.audit",
    "compare": "fpdoctor.precision.compare.compare",
    "diagnose_env": "fpdoctor.env.doctor",
    "diff_env": "fpdoctor.env.diff",
    "harmonize": "fpdoctor.precision.audit.harmonize",
    "health": "fpdoctor.health.api",
    "HealthResult": "fpdoctor.health.api",
    "keep_in_fp32": "fpdoctor.precision.audit.boundary",
    "plan": "fpdoctor.precision.plan.plan",
    "trace": "fpdoctor.numerics.api",
    "watch": "fpdoctor.integrations.script",
}


# Subpackages the README names by attribute (`fpdoctor.crash.run_command`): imported on first use.
_SUBPACKAGES = ("crash", "integrations")

# `fpdoctor.health` is the function health(), and fpdoctor.health is also a package. The import
# system sets a package as its parent's attribute when it first loads it, which would replace the
# function the first time anything imports fpdoctor.health.<module>. The package (whose __init__
# imports nothing) is loaded here, so that happens now, and the attribute is dropped again:
# __getattr__ below gives the function, and later imports find the package already loaded.
importlib.import_module("fpdoctor.health")
globals().pop("health", None)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return importlib.import_module(f"{__name__}.{name}")  # the import binds it here too
    raise AttributeError(f"module 'fpdoctor' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API (tab completion, dir(), help()) without importing any of it: only `__all__`,
    not the names this module imports for itself (typing helpers, importlib)."""
    return sorted(__all__)


__all__ = [
    "CompareRecord",
    "Finding",
    "HealthResult",
    "NonFiniteError",
    "Report",
    "ScriptWatch",
    "Sentinel",
    "Severity",
    "Trace",
    "Trial",
    "__version__",
    "apply_plan",
    "audit",
    "compare",
    "crash",
    "diagnose_env",
    "diff_env",
    "harmonize",
    "health",
    "integrations",
    "keep_in_fp32",
    "plan",
    "trace",
    "watch",
]
