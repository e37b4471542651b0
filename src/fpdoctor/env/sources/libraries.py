"""Where the CUDA libraries live: pip wheels, torch/lib, LD_LIBRARY_PATH, CUDA_HOME, ldconfig.

A *copy* is one real file (symlinked sonames collapse into it). Matching is on the file name,
never a substring of the path, and accepts the hash-suffixed copies that auditwheel puts into
wheels (``libcudart-d0da41ae.so.11.0``); stub libraries are ignored.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from fpdoctor.env.sources import NotChecked

TRACKED = ("cublas", "cublasLt", "cudnn", "nccl", "cudart", "nvJitLink")
_LIB_NAME = re.compile(
    r"^lib(?P<lib>cublasLt|cublas|cudnn|nccl|cudart|nvJitLink)(?:-[0-9a-f]{8})?\.so(?P<ver>(?:\.\d+)*)$"
)
# Which pip distributions ship which libraries (CUDA 13 wheels drop the -cuXX suffix).
_PACKAGE = re.compile(r"^nvidia-(cublas|cudnn|nccl|cuda-runtime|nvjitlink)(?:-cu\d+)?$")
_PACKAGE_LIBS = {
    "cublas": ("cublas", "cublasLt"),
    "cudnn": ("cudnn",),
    "nccl": ("nccl",),
    "cuda-runtime": ("cudart",),
    "nvjitlink": ("nvJitLink",),
}


def classify(filename: str) -> tuple[str, str] | None:
    """'libcublasLt.so.12.1.3.1' -> ('cublasLt', '12.1.3.1'); None for untracked or stub files."""
    if "stub" in filename:
        return None
    match = _LIB_NAME.match(filename)
    if not match:
        return None
    return match["lib"], match["ver"].lstrip(".")


def wheel_entry(package: str, version: str, files: list[str] | None = None) -> dict[str, Any] | None:
    """A wheel record if `package` is one of the nvidia-* wheels that ship a tracked library."""
    match = _PACKAGE.match(_norm(package))
    if not match:
        return None
    return {
        "package": _norm(package),
        "version": version,
        "libraries": list(_PACKAGE_LIBS[match.group(1)]),
        "files": files or [],
    }


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# "<name>-<version>.dist-info": matching directory names avoids parsing the METADATA of every
# installed distribution (torch's alone is large), which matters for `fpdoctor env`'s budget.
_DIST_INFO = re.compile(r"^(?P<name>torch|nvidia[-_][\w.]+?)-(?P<version>[^-]+)\.dist-info$", re.IGNORECASE)


def _site_dirs() -> list[str]:
    import sys

    return list(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)))


def scan_distributions() -> dict[str, Any]:
    """nvidia-* wheels that ship a tracked library, every torch on sys.path, and pip debris."""
    # Imported here, not with the module: `env --from` reads this module's file-name patterns
    # only, and importlib.metadata (with email) is a tenth of its 0.15 s.
    from importlib import metadata

    wheels: list[dict[str, Any]] = []
    installs: list[dict[str, Any]] = []
    debris: list[str] = []
    for entry in _site_dirs():
        try:
            names = os.listdir(entry)
        except OSError:
            continue
        for name in names:
            if name.startswith("~") and "orch" in name:
                # pip renames a package to "~orch" while replacing it; a leftover means an
                # interrupted install ("WARNING: Ignoring invalid distribution ~orch").
                debris.append(str(Path(entry) / name))
                continue
            m = _DIST_INFO.match(name)
            if not m:
                continue
            dist = metadata.PathDistribution(Path(entry) / name)
            if _norm(m["name"]) == "torch":
                installs.append(
                    {
                        "version": m["version"],
                        "location": entry,
                        "installer": (dist.read_text("INSTALLER") or "").strip() or None,
                    }
                )
            elif _PACKAGE.match(_norm(m["name"])):
                files = [str(dist.locate_file(f)) for f in (dist.files or []) if ".so" in f.name]
                wheel = wheel_entry(m["name"], m["version"], files)
                if wheel:
                    wheels.append(wheel)
    return {"wheels": wheels, "torch_installs": {"installs": installs, "debris": debris}}


def _scan_dir(directory: str, origin: str) -> list[dict[str, Any]]:
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        kind = classify(name)
        if kind:
            path = os.path.join(directory, name)
            found.append({"library": kind[0], "path": path, "origin": origin, "soname_version": kind[1]})
    return found


def _ldconfig_entries() -> list[dict[str, Any]]:
    exe = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.access(p, os.X_OK)), None
    )
    if exe is None:
        raise NotChecked("ldconfig not found")
    out = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=10, check=False).stdout
    found = []
    for line in out.splitlines():
        if "=>" not in line:
            continue
        path = line.split("=>", 1)[1].strip()
        kind = classify(os.path.basename(path))
        if kind:
            found.append({"library": kind[0], "path": path, "origin": "ldconfig", "soname_version": kind[1]})
    return found


def _torch_lib_dir() -> str | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return str(Path(spec.origin).parent / "lib")


def library_copies(wheels: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """All reachable copies of the tracked libraries, one entry per real file."""
    not_checked: dict[str, str] = {}
    entries: list[dict[str, Any]] = []
    for wheel in wheels:
        for path in wheel["files"]:
            kind = classify(os.path.basename(path))
            if kind:
                entries.append(
                    {
                        "library": kind[0],
                        "path": path,
                        "origin": "pip",
                        "soname_version": kind[1],
                        "package": wheel["package"],
                        "package_version": wheel["version"],
                    }
                )
    torch_lib = _torch_lib_dir()
    if torch_lib:
        entries += _scan_dir(torch_lib, "torch_lib")
    for directory in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        entries += _scan_dir(directory, "ld_library_path")
    if os.environ.get("CONDA_PREFIX"):
        # conda's cudatoolkit / pytorch-cuda packages put the libraries in the env's lib/.
        entries += _scan_dir(os.path.join(os.environ["CONDA_PREFIX"], "lib"), "conda")
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
        entries += _scan_dir(os.path.join(cuda_home, sub), "cuda_home")
    try:
        entries += _ldconfig_entries()
    except (NotChecked, OSError, subprocess.SubprocessError) as exc:
        not_checked["ldconfig"] = str(exc)
    return merge_copies(entries), not_checked


def merge_copies(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Collapse symlinked sonames into one copy per real file; keep every origin that reaches it."""
    copies: dict[tuple[str, str], dict[str, Any]] = {}
    for entry in entries:
        real = os.path.realpath(entry["path"])
        key = (entry["library"], real)
        copy = copies.get(key)
        if copy is None:
            copy = copies[key] = {
                "library": entry["library"],
                "path": real,
                "origins": [],
                "version": None,
                "version_source": None,
                "package": None,
                "dirs": {},  # origin -> the directories (as configured, unresolved) that reach this file
            }
        if entry["origin"] not in copy["origins"]:
            copy["origins"].append(entry["origin"])
        reached_from = copy["dirs"].setdefault(entry["origin"], [])
        if os.path.dirname(entry["path"]) not in reached_from:
            reached_from.append(os.path.dirname(entry["path"]))
        if entry.get("package"):
            copy["package"], copy["version"], copy["version_source"] = (
                entry["package"],
                entry["package_version"],
                "wheel",
            )
        elif copy["version_source"] != "wheel":
            # The real file's name carries the full version for toolkit copies
            # (libcudart.so.13.0.88); a bare soname only gives the major.
            full = classify(os.path.basename(real))
            ver = full[1] if full and full[1].count(".") >= 1 else entry["soname_version"]
            if ver and (copy["version"] is None or len(ver) > len(copy["version"])):
                copy["version"] = ver
                copy["version_source"] = "filename" if "." in ver else "soname-major"
    return sorted(copies.values(), key=lambda c: (c["library"], c["path"]))


def loaded_copies(mapped: list[str], copies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tracked libraries among the paths mapped into the torch child process."""
    by_real = {c["path"]: c for c in copies}
    loaded = []
    for path in mapped:
        kind = classify(os.path.basename(path))
        if not kind:
            continue
        real = os.path.realpath(path)
        known = by_real.get(real)
        loaded.append(
            {
                "library": kind[0],
                "path": real,
                "version": known["version"] if known else (kind[1] or None),
                "package": known["package"] if known else None,
            }
        )
    return loaded
