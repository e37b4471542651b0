"""duplicate-cuda-library and library-shadowed: which copies exist, and which one loaded."""

from __future__ import annotations

import os
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.fixes import interpreter, pip
from fpdoctor.env.refdata import version
from fpdoctor.env.rules import Context
from fpdoctor.report.model import Finding, Severity

# Origins the dynamic loader can reach when torch loads; a toolkit copy under CUDA_HOME alone
# is used for building extensions, not by torch at run time.
REACHABLE = {"pip", "torch_lib", "ld_library_path", "ldconfig", "conda", "report", "wheel"}


def _copies_with_wheels(ctx: Context) -> list[dict[str, Any]]:
    """Copies on disk, plus wheels known only by name and version (pasted reports, logs)."""
    copies = list(ctx.facts.copies)
    with_files = {c.get("package") for c in copies if c.get("package")}
    for wheel in ctx.facts.wheels:
        if wheel["package"] in with_files:
            continue
        for lib in wheel["libraries"]:
            copies.append(
                {
                    "library": lib,
                    "path": f"<wheel {wheel['package']}>",
                    "origins": ["wheel"],
                    "version": wheel["version"],
                    "package": wheel["package"],
                }
            )
    return copies


def _same_release(a: str | None, b: str | None) -> bool:
    """'12.1.3.1' and '12' agree (a soname major cannot tell them apart); '12.1' and '12.4' do not."""
    if not a or not b:
        return True
    short, long_ = sorted((a, b), key=len)
    return long_.startswith(short)


def duplicate_cuda_library(ctx: Context) -> Iterable[Finding]:
    found = list(_duplicates(ctx))
    yield from found
    matched = ctx.symptoms.get("DUPLICATE_CUDA_RUNTIME_LIBS")
    if matched and not found:
        # A loader's complaint in a log: the copies exist, but the log does not say which loads.
        yield catalog.make(
            "duplicate-cuda-library",
            message="The log shows several copies of a CUDA library found on the loader's path: " + matched[0],
            fix=(
                "# the log lists the copies but not which one loads; on that machine, in that environment,\n"
                "# this lists every copy, the one that loaded and the command that removes the others:\n"
                "fpdoctor env"
            ),
            evidence={"matched": matched},
        )


def _duplicates(ctx: Context) -> Iterable[Finding]:
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for copy in _copies_with_wheels(ctx):
        if REACHABLE & set(copy.get("origins") or []):
            groups[copy["library"]].append(copy)
    loaded_paths = {c["path"] for c in ctx.facts.loaded or []}
    for library, copies in sorted(groups.items()):
        versions = [c.get("version") for c in copies]
        if len(copies) < 2 or all(_same_release(versions[0], v) for v in versions[1:]):
            continue
        lines: list[str] = []
        fixes: list[str] = []
        drop: list[str] = []
        for c in copies:
            mark = " [loaded]" if c["path"] in loaded_paths else ""
            lines.append(f"{c['path']} ({c.get('version') or '?'}; {', '.join(c['origins'])}){mark}")
            if "ld_library_path" in c["origins"]:
                drop += (c.get("dirs") or {}).get("ld_library_path") or [os.path.dirname(c["path"])]
        if drop:
            fixes.append(_without_dirs(ctx, list(dict.fromkeys(drop))))
        packages = sorted({c["package"] for c in copies if c.get("package")})
        python = interpreter(ctx.facts)
        if len(packages) > 1:
            keep = packages[-1]
            fixes += [pip(python, f"uninstall -y {p}") + f"   # keep {keep}" for p in packages[:-1]]
        if not fixes:
            fixes.append(
                "# the copies come from places fpdoctor does not manage (system CUDA, the conda env, torch/lib):\n"
                "# keep the one torch pins on the loader's path; this lists what torch requires:\n"
                + pip(python, "show torch")
            )
        yield catalog.make(
            "duplicate-cuda-library",
            message=f"{len(copies)} different copies of lib{library} are reachable: " + "; ".join(lines) + ".",
            fix="\n".join(dict.fromkeys(fixes)),
            where={"library": library},
            evidence={"library": library, "copies": lines},
        )


def _without_dirs(ctx: Context, dirs: list[str]) -> str:
    """An export that drops `dirs` from LD_LIBRARY_PATH: written out when the value is known."""
    env = ctx.facts.raw.get("env") or {}
    if "LD_LIBRARY_PATH" in env:
        entries = [d for d in str(env["LD_LIBRARY_PATH"]).split(":") if d]
        kept = [d for d in entries if d not in dirs and os.path.realpath(d) not in dirs]
        return f'export LD_LIBRARY_PATH="{":".join(kept)}"   # drops {", ".join(dirs)}'
    pattern = "|".join(re.escape(d) for d in dirs)
    return (
        f"export LD_LIBRARY_PATH=\"$(printf %s \"$LD_LIBRARY_PATH\" | tr : '\\n' | grep -Ev '^({pattern})/?$' "
        f'| paste -sd:)"   # drops {", ".join(dirs)}'
    )


def library_shadowed(ctx: Context) -> Iterable[Finding]:
    loaded = ctx.facts.loaded
    if not loaded:
        return
    env = ctx.facts.raw.get("env") or {}
    for lib in loaded:
        wheel_copies = [c for c in ctx.facts.copies if c["library"] == lib["library"] and c.get("package")]
        if not wheel_copies or lib["path"] in {c["path"] for c in wheel_copies}:
            continue
        wheel = wheel_copies[0]
        lv, wv = version(lib.get("version")), version(wheel.get("version"))
        older = lv is None or wv is None or lv < wv
        copy = next((c for c in ctx.facts.copies if c["path"] == lib["path"]), {})
        origins: list[str] = copy.get("origins", [])
        if "ld_library_path" in origins:
            # Drop the LD_LIBRARY_PATH entries that reach the loaded file (as written, and resolved).
            reach = set((copy.get("dirs") or {}).get("ld_library_path", [])) | {os.path.dirname(lib["path"])}
            entries = [d for d in str(env.get("LD_LIBRARY_PATH", "")).split(":") if d]
            kept = [d for d in entries if d not in reach and os.path.realpath(d) not in reach]
            dropped = [d for d in entries if d not in kept] or sorted(reach)
            fix = f'export LD_LIBRARY_PATH="{":".join(kept)}"   # drops {", ".join(dropped)}'
        else:
            fix = (
                f'export LD_LIBRARY_PATH="{os.path.dirname(wheel["path"])}:$LD_LIBRARY_PATH"   '
                f"# puts {wheel['package']}'s copy first"
            )
        yield catalog.make(
            "library-shadowed",
            severity=Severity.ERROR if older else Severity.WARNING,
            message=(
                f"The process loaded lib{lib['library']} {lib.get('version') or '?'} from {lib['path']}"
                f"{' (' + ', '.join(origins) + ')' if origins else ''}, not {wheel['package']} "
                f"{wheel.get('version')} at {wheel['path']}."
                + (" The installed wheel is newer, so its fixes are not in effect." if older else "")
            ),
            fix=fix,
            where={"library": lib["library"]},
            evidence={
                "loaded": lib["path"],
                "loaded_version": lib.get("version"),
                "wheel": wheel["package"],
                "wheel_version": wheel.get("version"),
                "wheel_path": wheel["path"],
                "origins": origins,
            },
        )
