"""A report on disk: the format its file name asks for, written whole or not at all.

The CLI's `-o` and the framework callbacks' `report_path` both end here, so `report.json` is JSON
and `report.md` Markdown whoever writes it, a reader never sees half a file, and each rank of a
distributed run writes its own `report.rank1.json` beside the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fpdoctor import files
from fpdoctor.errors import InputError
from fpdoctor.report.render import render

BY_EXTENSION = {".json": "json", ".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html"}


def format_for(path: str) -> str:
    """The format a file name asks for: json, markdown or html by its extension, else text."""
    return BY_EXTENSION.get(Path(path).suffix.lower(), "text")


def rank_path(path: str, rank: int) -> str:
    """report.json -> report.rank1.json; report -> report.rank1."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def write_text(path: str, text: str) -> None:
    """`text` to `path` via a temporary file and a rename; InputError (one line) when `path` is a
    directory or its directory does not exist."""
    target = Path(path)
    if target.is_dir():
        raise InputError(f"{path} is a directory; give the name of a file to write")
    if not target.parent.exists():
        raise InputError(f"{target.parent} does not exist; create it or choose another output path")
    files.write_atomic(target, text.encode("utf-8"))


def file_text(report: dict[str, Any], path: str, fmt: str | None = None) -> str:
    """A report (its `to_dict()`) as its file at `path` holds it: in `fmt`, by default the one the
    extension names, with every fact, as `-v` shows them: nobody reads it on a terminal in a hurry."""
    return render(report, fmt or format_for(path), color=False, verbose=True)


def write(report: dict[str, Any], path: str, fmt: str | None = None) -> None:
    """A report (its `to_dict()`) to `path` as file_text gives it."""
    write_text(path, file_text(report, path, fmt))
