"""Writing a user's file whole or not at all: a temporary file in the same directory, renamed."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(target: Path, data: bytes) -> None:
    """Write `data` to `target` via a temporary file and a rename, so a reader never sees half a
    file. The caller has checked that `target` is no directory and its directory exists."""
    if target.exists() and not target.is_file():
        # /dev/null, /dev/stdout, a named pipe: write through; renaming over them would replace them.
        with target.open("wb") as fh:
            fh.write(data)
        return
    # mkstemp makes the file 0600; the user's file is like any other: an existing file keeps its
    # mode, a new one gets what the user's umask gives (0644 under umask 022).
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
    # Imported here: every command's report writer imports this module, and most print instead.
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it is to set it; put it back at once
    os.umask(mask)
    return mask
