"""The facts model: one JSON-able dict that live collection and offline parsing both produce.

Rules read facts only through `Facts`, so a rule works the same on this machine, on a saved
facts file and on a pasted `collect_env` report; a fact that a source could not provide is
None, and `missing` says so in the report.
"""

from __future__ import annotations

import re
from typing import Any

from packaging.version import Version

from fpdoctor.env.refdata import cuda_variant, refdata, version

SCHEMA = "fpdoctor.facts/1"


def empty_facts(origin: str) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "origin": {"kind": origin},
        "os": {},
        "python": {},
        "env": {},
        "torch": {"import": None},
        "torch_installs": {"installs": [], "debris": []},
        "gpus": [],
        "driver": None,
        "libraries": {"wheels": [], "copies": [], "loaded": None},
        "texts": [],  # error text to match against known symptoms (logs, import errors, warnings)
        "probes": [],
        "not_checked": {},
        "missing": [],
    }


# The shape of each field a rule or the summary reads, for facts that come from a file: a
# hand-edited or foreign file is refused with the field named, instead of failing somewhere inside.
_TEXT, _NUMBER, _FLAG = (str,), (int, float), (bool,)
_OPTIONAL_TEXT = (str, type(None))
_TORCH_FIELDS: dict[str, tuple[type, ...]] = {
    "version": _OPTIONAL_TEXT,
    "cuda": _OPTIONAL_TEXT,
    "hip": _OPTIONAL_TEXT,
    "import": _OPTIONAL_TEXT,
    "stage": _OPTIONAL_TEXT,
    "signal": _OPTIONAL_TEXT,
    "error": _OPTIONAL_TEXT,
    "traceback": _OPTIONAL_TEXT,
    "stderr": _OPTIONAL_TEXT,
    "nccl": _OPTIONAL_TEXT,
    "cudnn": (str, int, type(None)),
    "cuda_available": (bool, type(None)),
    "debug": (bool, type(None)),
    "arch_list": (list, type(None)),
    "warnings": (list,),
    "devices": (list,),
    "numpy": (dict, type(None)),
    "precision": (dict, type(None)),
    "registrations": (list, type(None)),
}
_ITEMS: dict[str, dict[str, tuple[type, ...]]] = {
    "gpus": {"name": _TEXT, "compute_capability": (str, int, float, type(None)), "index": (int, type(None))},
    "libraries.wheels": {"package": _TEXT, "version": _TEXT, "libraries": (list,)},
    "libraries.copies": {"library": _TEXT, "path": _TEXT, "version": _OPTIONAL_TEXT, "origins": (list,)},
    "libraries.loaded": {"library": _TEXT, "path": _TEXT, "version": _OPTIONAL_TEXT},
    "torch_installs.installs": {"version": _OPTIONAL_TEXT, "location": _OPTIONAL_TEXT},
    "torch.registrations": {
        "op": _TEXT,
        "kind": _TEXT,
        "key": _OPTIONAL_TEXT,
        "file": _TEXT,
        "line": (int, type(None)),
        "module": _OPTIONAL_TEXT,
    },
    "startup.customize": {"module": _TEXT, "path": _TEXT, "loaded": _FLAG, "sha256": _OPTIONAL_TEXT},
    "startup.pth": {"path": _TEXT, "executes": _FLAG, "code": (list,), "sha256": _OPTIONAL_TEXT},
    "startup.preload": {"path": _TEXT, "source": _TEXT},
    "probes": {
        "name": _OPTIONAL_TEXT,
        "status": _OPTIONAL_TEXT,
        "dtype": _OPTIONAL_TEXT,
        "max_abs_err": (int, float, str, type(None)),
        "tolerance": (int, float, type(None)),
        "scale": (int, float, type(None)),
        "seconds": (int, float, type(None)),
    },
}


def _wrong(field: str, value: Any, allowed: tuple[type, ...]) -> str | None:
    if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
        return None
    names = " or ".join(sorted({"null" if a is type(None) else a.__name__ for a in allowed}))
    return f"field {field} must be {names}, not {type(value).__name__}"


def shape_problem(raw: dict[str, Any]) -> str | None:
    """The first field of a facts dict whose shape the rules cannot read, or None."""
    for key in ("origin", "os", "python", "env", "torch", "torch_installs", "libraries", "not_checked"):
        if problem := _wrong(key, raw.get(key, {}), (dict,)):
            return problem
    for key in ("driver", "startup"):  # startup: None or absent where the input does not show it
        if problem := _wrong(key, raw.get(key), (dict, type(None))):
            return problem
    for key in ("gpus", "texts", "probes", "missing"):
        if problem := _wrong(key, raw.get(key, []), (list,)):
            return problem
    for key, value in (raw.get("env") or {}).items():
        if problem := _wrong(f"env.{key}", value, _TEXT):
            return problem
    for i, text in enumerate(raw.get("texts") or []):
        if problem := _wrong(f"texts[{i}]", text, _TEXT):
            return problem
    for key, allowed in _TORCH_FIELDS.items():
        if key in raw["torch"] and (problem := _wrong(f"torch.{key}", raw["torch"][key], allowed)):
            return problem
    for key in ("version", "cuda"):
        if problem := _wrong(f"driver.{key}", (raw.get("driver") or {}).get(key), _OPTIONAL_TEXT):
            return problem
    for path, fields in _ITEMS.items():
        holder: Any = raw
        for part in path.split("."):
            holder = holder.get(part) if isinstance(holder, dict) else None
        if holder is None and (path in ("libraries.loaded", "torch.registrations") or path.startswith("startup.")):
            continue  # not shown by the input: unknown, not empty
        if problem := _wrong(path, holder if holder is not None else [], (list,)):
            return problem
        for i, item in enumerate(holder or []):
            if problem := _wrong(f"{path}[{i}]", item, (dict,)):
                return problem
            for key, allowed in fields.items():
                if key in item and (problem := _wrong(f"{path}[{i}].{key}", item[key], allowed)):
                    return problem
    return None


class Facts:
    """Read-only typed view over a facts dict."""

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw

    @property
    def origin(self) -> str:
        return str(self.raw.get("origin", {}).get("kind", "live"))

    @property
    def offline(self) -> bool:
        return self.origin != "live"

    @property
    def torch(self) -> dict[str, Any]:
        return self.raw.get("torch") or {}

    @property
    def torch_version(self) -> Version | None:
        return version(self.torch.get("version"))

    @property
    def torch_local(self) -> str | None:
        """The local version label: 'cu121', 'cpu', 'rocm6.0' or None ('2.3.1' from PyPI)."""
        text = self.torch.get("version") or ""
        return text.split("+", 1)[1] if "+" in text else None

    @property
    def build_cuda(self) -> Version | None:
        """The CUDA version torch was built with; None for CPU builds or unknown."""
        cuda = version(self.torch.get("cuda"))
        if cuda is None and self.torch_local and re.fullmatch(r"cu\d{3}", self.torch_local):
            digits = self.torch_local[2:]
            cuda = Version(f"{digits[:-1]}.{digits[-1]}")
        return cuda

    @property
    def variant(self) -> str | None:
        cuda = self.build_cuda
        return cuda_variant(cuda) if cuda else None

    @property
    def cpu_only_build(self) -> bool | None:
        """True for a torch without CUDA/ROCm; None when the report does not say."""
        if self.torch.get("import") != "ok" and not self.torch.get("version"):
            return None
        if self.torch_local == "cpu":
            return True
        if self.build_cuda or self.torch.get("hip") or (self.torch_local or "").startswith("rocm"):
            return False
        if self.torch.get("cuda_known_none"):
            return True  # a report that says "CUDA used to build PyTorch: None / Could not collect"
        return True if not self.offline and self.torch.get("import") == "ok" else None

    @property
    def gpus(self) -> list[dict[str, Any]]:
        """NVIDIA GPUs with a compute capability filled in from the best available source."""
        out = []
        for seen in self.raw.get("gpus") or []:
            gpu = dict(seen)
            if not gpu.get("compute_capability"):
                found = refdata().gpu_capability(gpu.get("name", ""))
                if found:
                    gpu["compute_capability"] = found[0]
                    gpu["capability_source"] = f"table ({found[1]['confidence']})"
            out.append(gpu)
        return out

    @property
    def driver(self) -> Version | None:
        return version((self.raw.get("driver") or {}).get("version"))

    @property
    def driver_text(self) -> str | None:
        """The driver version as reported (keeps NVIDIA's leading zeros)."""
        return (self.raw.get("driver") or {}).get("version")

    @property
    def driver_max_cuda(self) -> Version | None:
        """The newest CUDA the driver supports, as reported by NVML or an error message."""
        return version((self.raw.get("driver") or {}).get("cuda"))

    @property
    def windows(self) -> bool:
        return (self.raw.get("os") or {}).get("system") == "Windows"

    @property
    def cuda_available(self) -> bool | None:
        value = self.torch.get("cuda_available")
        return None if value is None else bool(value)

    @property
    def arch_list(self) -> list[str] | None:
        return self.torch.get("arch_list")

    @property
    def copies(self) -> list[dict[str, Any]]:
        return (self.raw.get("libraries") or {}).get("copies") or []

    @property
    def loaded(self) -> list[dict[str, Any]] | None:
        return (self.raw.get("libraries") or {}).get("loaded")

    @property
    def wheels(self) -> list[dict[str, Any]]:
        return (self.raw.get("libraries") or {}).get("wheels") or []

    @property
    def texts(self) -> list[str]:
        texts = list(self.raw.get("texts") or [])
        for key in ("error", "traceback"):
            if self.torch.get(key):
                texts.append(self.torch[key])
        texts += self.torch.get("warnings") or []
        return texts

    @property
    def probes(self) -> list[dict[str, Any]]:
        return self.raw.get("probes") or []
