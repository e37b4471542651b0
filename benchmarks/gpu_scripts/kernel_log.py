"""This machine's kernel log as `fpdoctor health --from` reads it back: from the first source that
fpdoctor's own reader can read (dmesg, journalctl -k -b, the syslog files), the NVIDIA driver's
lines (NVRM, the nvidia modules, Xids) and the boot markers between them; the rest of the log is
the machine's own business and is not kept.

Exit 0 with the file written, or with no file when the log holds no NVIDIA line (an empty file is
no kernel log to `--from`); exit 3 when no source could be read, each source's reason printed.

Run: python benchmarks/gpu_scripts/kernel_log.py OUT.log   (PYTHONPATH=src where fpdoctor is not installed)
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # gpu_check.py imports NOT_READ where fpdoctor may not be importable
    from fpdoctor.health.kernel_sources import KernelText

NOT_READ = 3
KEEP = re.compile(r"NVRM:|nvidia|\bXid\b|\bLinux version \d", re.IGNORECASE)


def kept(lines: list[str]) -> list[str]:
    return [line for line in lines if KEEP.search(line)]


def main(argv: list[str] | None = None, read: Callable[[], KernelText] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: kernel_log.py OUT.log", file=sys.stderr)
        return 2
    if read is None:
        from fpdoctor.health.kernel_sources import read_live

        read = read_live
    text = read()
    if text.source is None:
        print("no kernel log could be read: " + "; ".join(f"{name}: {why}" for name, why in text.tried.items()))
        return NOT_READ
    lines = kept(text.lines)
    nvidia = sum(1 for line in lines if "Linux version" not in line)
    if nvidia:
        Path(args[0]).write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    print(f"{nvidia} NVIDIA line(s) of {len(text.lines)} kept from {text.source}" + ("" if nvidia else "; no file"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
