"""The reference tables shipped in `fpdoctor/data`, loaded once and queried by the rules.

Every row keeps its `source` and `confidence`; rules copy both into a finding's evidence.
"""

from __future__ import annotations

import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from packaging.version import InvalidVersion, Version

INDEX_URL = "https://download.pytorch.org/whl/{variant}"


_DATA = Path(__file__).resolve().parent.parent / "data"


def _open(name: str) -> IO[str]:
    """A table of `fpdoctor/data`, read from the file itself where the package is on disk:
    importlib.resources (with tempfile, random and zipfile) costs `env --from` about 4 ms of its
    0.15 s. A zipped install needs it."""
    if (_DATA / name).is_file():
        return (_DATA / name).open(encoding="utf-8")
    from importlib import resources

    return resources.files("fpdoctor.data").joinpath(name).open(encoding="utf-8")


def _rows(name: str) -> list[dict[str, str]]:
    with _open(name) as fh:
        return list(csv.DictReader(fh))


def version(text: str | None) -> Version | None:
    """Parse a version leniently ('12.1', '535.104.05', '2.3.0+cu121'); None when unparseable."""
    if not text:
        return None
    # Each part at most 12 digits: a pasted 5-million-digit "version" is not one (and int() of it raises).
    match = re.match(r"\s*v?(\d{1,12}(?:\.\d{1,12}){0,5})(?!\d)", str(text)[:200])
    if not match:
        return None
    try:
        return Version(match.group(1))
    except (InvalidVersion, ValueError):
        return None


@dataclass(frozen=True)
class ArchRow:
    torch_minor: Version
    variant: str  # "cu121"
    platform: str
    sass: tuple[int, ...]  # (50, 60, 70, ...)
    ptx: int | None
    source: str
    confidence: str

    @property
    def cuda(self) -> Version:
        return variant_cuda(self.variant)


def variant_cuda(variant: str) -> Version:
    """'cu121' -> 12.1, 'cu118' -> 11.8, 'cu130' -> 13.0."""
    digits = variant.removeprefix("cu")
    return Version(f"{digits[:-1]}.{digits[-1]}")


def cuda_variant(cuda: Version) -> str:
    return f"cu{cuda.major}{cuda.minor}"


def sm_number(text: str) -> int:
    """'sm_90' / 'compute_90' / '9.0' / '90' -> 90."""
    text = text.strip()
    if "." in text:
        major, minor = text.split(".", 1)
        return int(major) * 10 + int(minor[:1] or 0)
    return int(re.sub(r"^(sm|compute)_", "", text).rstrip("af"))


class RefData:
    """Typed queries over the shipped tables."""

    @functools.cached_property
    def arch_rows(self) -> list[ArchRow]:
        rows = []
        for r in _rows("torch_cuda_arch.csv"):
            if not r["sass_targets"] or "removed" in r["torch_cuda_arch_list"]:
                continue  # proposals for future releases carry no arch list
            ptx = r["ptx_target"].strip()
            rows.append(
                ArchRow(
                    torch_minor=Version(r["torch_version"]),
                    variant=r["cuda_variant"],
                    platform=r["platform"],
                    sass=tuple(sm_number(s) for s in r["sass_targets"].split()),
                    ptx=sm_number(ptx) if ptx else None,
                    source=r["source"],
                    confidence=r["confidence"],
                )
            )
        return rows

    def arch_row(self, torch_version: Version, variant: str, platform: str = "linux-x86_64") -> ArchRow | None:
        minor = Version(f"{torch_version.major}.{torch_version.minor}")
        for row in self.arch_rows:
            if row.torch_minor == minor and row.variant == variant and row.platform == platform:
                return row
        return None

    @functools.cached_property
    def driver_rows(self) -> list[dict[str, str]]:
        return _rows("cuda_driver_min.csv")

    @staticmethod
    def driver_text(row: dict[str, str], windows: bool = False) -> str:
        """The minimum driver as NVIDIA writes it (Version() would print 450.80.02 as 450.80.2)."""
        return row["windows_x86_64_min_driver" if windows else "linux_x86_64_min_driver"]

    def family_floor(self, cuda_major: int, windows: bool = False) -> tuple[Version, dict[str, str]] | None:
        """Minimum driver for any CUDA `cuda_major`.x build (minor version compatibility)."""
        column = "windows_x86_64_min_driver" if windows else "linux_x86_64_min_driver"
        for row in self.driver_rows:
            if row["kind"] == "minor_version_compat" and row["cuda_major"] == str(cuda_major):
                floor = version(row[column])
                return (floor, row) if floor else None
        return None

    def toolkit_floor(self, cuda: Version, windows: bool = False) -> tuple[Version, dict[str, str]] | None:
        """Minimum driver NVIDIA lists for the exact toolkit (first release of that major.minor)."""
        column = "windows_x86_64_min_driver" if windows else "linux_x86_64_min_driver"
        best: tuple[Version, Version, dict[str, str]] | None = None
        for row in self.driver_rows:
            if row["kind"] != "toolkit_driver":
                continue
            toolkit = version(row["cuda_version"])
            floor = version(row[column])
            if toolkit is None or floor is None or (toolkit.major, toolkit.minor) != (cuda.major, cuda.minor):
                continue
            if best is None or toolkit < best[0]:
                best = (toolkit, floor, row)
        return (best[1], best[2]) if best else None

    def newest_cuda_for_driver(self, driver: Version, windows: bool = False) -> Version | None:
        """The newest CUDA toolkit this driver runs without compatibility packages."""
        column = "windows_x86_64_min_driver" if windows else "linux_x86_64_min_driver"
        best: Version | None = None
        for row in self.driver_rows:
            floor = version(row[column])
            toolkit = version(row["cuda_version"])
            if row["kind"] == "toolkit_driver" and floor and toolkit and floor <= driver:
                best = toolkit if best is None or toolkit > best else best
        return best

    @functools.cached_property
    def bundled_rows(self) -> list[dict[str, str]]:
        return _rows("torch_bundled_cuda_libs.csv")

    def _bundled(self, torch_version: Version, variant: str, column: str) -> tuple[Version, dict[str, str]] | None:
        for row in self.bundled_rows:
            if not row["cuda_variant"].startswith(variant):
                continue
            for spec in row["torch_version"].split("/"):
                parts = spec.split(".")
                if parts[-1] == "x":
                    match = parts[:2] == [str(torch_version.major), str(torch_version.minor)]
                else:
                    match = version(spec) == Version(torch_version.base_version)
                pinned = version(row[column])
                if match and pinned:
                    return pinned, row
        return None

    def bundled_cublas(self, torch_version: Version, variant: str) -> tuple[Version, dict[str, str]] | None:
        """The nvidia-cublas version a torch wheel pins, where the table proves it."""
        return self._bundled(torch_version, variant, "cublas_version")

    def bundled_nccl(self, torch_version: Version, variant: str) -> Version | None:
        """The nvidia-nccl version a torch wheel pins, where the table proves it."""
        found = self._bundled(torch_version, variant, "nccl_version")
        return found[0] if found else None

    @functools.cached_property
    def gpu_rows(self) -> list[dict[str, str]]:
        return _rows("gpu_compute_capability.csv")

    def gpu_capability(self, name: str) -> tuple[str, dict[str, str]] | None:
        """Compute capability for a GPU name seen in nvidia-smi or a report (fallback only)."""
        norm = name.lower().replace("nvidia ", "").strip()
        best: tuple[int, str, dict[str, str]] | None = None
        for row in self.gpu_rows:
            seen = [s.strip().lower() for s in row["nvidia_smi_names_seen"].split(";") if s.strip()]
            candidates = [*seen, row["gpu_model"].lower()]
            for cand in candidates:
                cand_norm = cand.replace("nvidia ", "")
                if norm == cand_norm:
                    return row["compute_capability"], row
                # "H100 80GB HBM3" matches model "H100"; prefer the longest model name that fits.
                fits = re.search(rf"(?<![\w-]){re.escape(cand_norm)}(?![\w])", norm)
                if fits and (best is None or len(cand_norm) > best[0]):
                    best = (len(cand_norm), row["compute_capability"], row)
        return (best[1], best[2]) if best else None

    @functools.cached_property
    def first_cuda_for_sm(self) -> dict[int, tuple[Version, dict[str, str]]]:
        return {sm_number(r["sm"]): (Version(r["first_cuda"]), r) for r in _rows("cuda_arch_min_toolkit.csv")}

    @functools.cached_property
    def known_issues(self) -> list[dict[str, Any]]:
        import yaml

        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        with _open("known_issues.yaml") as fh:
            issues: list[dict[str, Any]] = yaml.load(fh, Loader=loader)
        return issues

    def known_issue(self, issue_id: str) -> dict[str, Any]:
        for issue in self.known_issues:
            if issue["id"] == issue_id:
                return issue
        raise KeyError(issue_id)


@functools.lru_cache(maxsize=1)
def refdata() -> RefData:
    return RefData()
