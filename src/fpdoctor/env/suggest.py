"""Which official torch build to suggest: covers every GPU, runs on the driver, smallest change."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

from fpdoctor.env.refdata import INDEX_URL, ArchRow, RefData


def sass_covers(sass: int, cc: int) -> bool:
    """SASS built for X.y runs on X.z for z >= y (same major only); NVIDIA's binary compatibility."""
    return sass // 10 == cc // 10 and sass % 10 <= cc % 10


def covers(row: ArchRow, cc: int) -> bool:
    return any(sass_covers(s, cc) for s in row.sass)


@dataclass(frozen=True)
class Suggestion:
    row: ArchRow
    pin: str  # "torch==2.0.1" or "torch==2.7.*"

    def command(self, python: str = "python") -> str:
        return f'{python} -m pip install --force-reinstall "{self.pin}" --index-url {self.index_url}'

    @property
    def index_url(self) -> str:
        return INDEX_URL.format(variant=self.row.variant)


def suggest_build(
    ref: RefData,
    *,
    torch_version: Version | None,
    capabilities: list[int],
    driver: Version | None,
    windows: bool = False,
    max_cuda: Version | None = None,
) -> Suggestion | None:
    """The official build closest to `torch_version` that covers all GPUs and runs on the driver."""
    candidates = []
    for row in ref.arch_rows:
        if row.platform != "linux-x86_64" or row.confidence == "unconfirmed":
            continue
        if not all(covers(row, cc) for cc in capabilities):
            continue
        if driver is not None:
            floor = ref.family_floor(row.cuda.major, windows)
            if floor is None or driver < floor[0]:
                continue
        if max_cuda is not None and row.cuda.major > max_cuda.major:
            continue
        candidates.append(row)
    if not candidates:
        return None
    current = Version(f"{torch_version.major}.{torch_version.minor}") if torch_version else None

    def key(row: ArchRow) -> tuple[int, float, float]:
        # Same minor first, then the nearest newer minor, older minors last; highest CUDA wins ties.
        minor, cuda = _as_float(row.torch_minor), _as_float(row.cuda)
        if current is None:
            return (0, -minor, -cuda)
        cur = _as_float(current)
        if minor == cur:
            return (0, 0.0, -cuda)
        return (1, minor, -cuda) if minor > cur else (2, -minor, -cuda)

    best = min(candidates, key=key)
    if current is not None and best.torch_minor == current and torch_version is not None:
        pin = f"torch=={torch_version.base_version}"
    else:
        pin = f"torch=={best.torch_minor}.*"
    return Suggestion(best, pin)


def _as_float(v: Version) -> float:
    return float(f"{v.major}.{v.minor:03d}")
