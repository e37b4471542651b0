"""Where this machine's kernel log can be read, and why it could not be when it cannot.

Tried in order, the first that yields lines wins: `dmesg` (this boot's ring buffer), `journalctl -k
-b` (this boot, from the journal), then `/var/log/kern.log`, `/var/log/syslog`, `/var/log/messages`
from their last boot on. A source that fails says why: `kernel.dmesg_restrict=1` without
CAP_SYSLOG, a container without access to the kernel log, no journal, a file absent or unreadable.
gcm's health checks treat a failed dmesg as a warning, never as healthy; so does fpdoctor.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

_ENV = {**os.environ, "LC_ALL": "C", "LANG": "C"}  # English messages and C dates, whatever the locale
_BOOT_MARKER = re.compile(r"\bkernel: (?:\[\s*\d+\.\d+\]\s*)?Linux version \d")
_FILE_TAIL = 64 * 2**20  # read at most the last 64 MiB of a syslog file


class NotReadable(Exception):
    """A kernel-log source could not be read; the message says why."""


@dataclass
class KernelText:
    source: str | None  # None: no source could be read
    lines: list[str]
    tried: dict[str, str] = field(default_factory=dict)  # sources before it that failed, and why
    note: str | None = None


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, errors="replace", env=_ENV, timeout=timeout, check=False
    )


def dmesg_denied_reason(restrict_path: str = "/proc/sys/kernel/dmesg_restrict") -> str:
    """Why reading the ring buffer was refused, from kernel.dmesg_restrict."""
    try:
        restrict = Path(restrict_path).read_text().strip()
    except OSError:
        restrict = ""
    if restrict == "1":
        return (
            "not readable: kernel.dmesg_restrict=1 and this process lacks CAP_SYSLOG "
            "(run as root, or: sudo sysctl kernel.dmesg_restrict=0)"
        )
    return "not readable: operation not permitted (a container without access to the kernel log?)"


def read_dmesg(timeout: float = 10.0) -> list[str]:
    exe = shutil.which("dmesg")
    if exe is None:
        raise NotReadable("dmesg not found on PATH")
    proc = _run([exe, "--time-format", "iso"], timeout)
    if proc.returncode != 0 and re.search(r"unrecognized|invalid|unknown option", proc.stderr):
        proc = _run([exe], timeout)  # busybox dmesg: plain seconds since boot
    if proc.returncode != 0:
        if re.search(r"not permitted|Permission denied", proc.stderr, re.I):
            raise NotReadable(dmesg_denied_reason())
        raise NotReadable(f"dmesg failed: {proc.stderr.strip()[:200] or f'exit status {proc.returncode}'}")
    lines = proc.stdout.splitlines()
    if not lines:
        raise NotReadable("dmesg returned nothing (ring buffer empty, or hidden in this container)")
    return lines


def read_journal(timeout: float = 20.0) -> list[str]:
    exe = shutil.which("journalctl")
    if exe is None:
        raise NotReadable("journalctl not found on PATH")
    base = [exe, "-k", "-b", "--no-pager"]
    proc = _run([*base, "-o", "short-iso-precise"], timeout)
    if proc.returncode != 0 and "short-iso-precise" in proc.stderr:
        proc = _run([*base, "-o", "short-iso"], timeout)  # systemd before v234
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("-- ")]
    if proc.returncode != 0 or not lines:
        why = proc.stderr.strip().splitlines()[0] if proc.stderr.strip() else f"exit status {proc.returncode}"
        if proc.returncode == 0:
            why = f"no kernel messages for this boot ({why})" if proc.stderr.strip() else "no kernel messages"
        raise NotReadable(f"journalctl -k: {why}")
    return lines


def read_syslog_file(path: str) -> tuple[list[str], str | None]:
    """The lines of a syslog file from its last boot on (older boots are history, not this GPU's state)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as fh:
            if size > _FILE_TAIL:
                fh.seek(size - _FILE_TAIL)
            data = fh.read()
    except FileNotFoundError:
        raise NotReadable("absent") from None
    except PermissionError:
        raise NotReadable("not readable: permission denied (root or the adm group can read it)") from None
    except OSError as exc:
        raise NotReadable(f"not readable: {exc.strerror or exc}") from None
    lines = data.decode("utf-8", errors="replace").splitlines()
    if size > _FILE_TAIL:
        lines = lines[1:]  # the first line of the tail is cut
    starts = [i for i, line in enumerate(lines) if _BOOT_MARKER.search(line)]
    if starts:
        return lines[starts[-1] :], None
    if not lines:
        raise NotReadable("empty")
    return lines, "no boot marker found: the whole file (possibly older boots too) was read"


Reader = Callable[[], "list[str] | tuple[list[str], str | None]"]


def read_live(readers: tuple[tuple[str, Reader], ...] | None = None) -> KernelText:
    """The first kernel-log source that yields lines, with the reasons the ones before it failed;
    `source` is None when none could be read (`tried` then says why for each)."""
    tried: dict[str, str] = {}
    for name, reader in readers or default_readers():
        try:
            got = reader()
        except NotReadable as exc:
            tried[name] = str(exc)
            continue
        except (OSError, subprocess.SubprocessError) as exc:
            tried[name] = f"not readable: {type(exc).__name__}: {exc}"
            continue
        lines, note = got if isinstance(got, tuple) else (got, None)
        return KernelText(source=name, lines=lines, tried=tried, note=note)
    return KernelText(source=None, lines=[], tried=tried)


def _file_reader(path: str) -> Reader:
    return lambda: read_syslog_file(path)


def default_readers() -> tuple[tuple[str, Reader], ...]:
    return (
        ("dmesg", read_dmesg),
        ("journalctl -k -b", read_journal),
        *((p, _file_reader(p)) for p in ("/var/log/kern.log", "/var/log/syslog", "/var/log/messages")),
    )
