"""cuda-error: a CUDA-stack error in a pasted log, what it means and what to run next.

The errors a user pastes alone ("RuntimeError: CUDA error: an illegal memory access was
encountered", with or without torchrun's "[rank0]:" or colours), explained with the table that
`fpdoctor run` uses (`fpdoctor.meanings`). Errors another env rule explains better are left
to it: no kernel image (arch-not-in-build), a too-old driver (driver-too-old), an uncorrectable
ECC error (a known hardware issue), and any line a finding already quotes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from typing import Any

from fpdoctor import catalog
from fpdoctor.env.rules import Context
from fpdoctor.report.model import Finding

LEFT_TO_OTHER_RULES = {"no-kernel-image", "driver-too-old", "ecc"}
# A fix line that runs as it stands: an environment assignment before a command, or a command.
_RUNS = re.compile(r"^(?:[A-Z][A-Z0-9_]*=\S*\s+)*(?:python3?|fpdoctor|compute-sanitizer|nvidia-smi|dmesg|df|grep)\b")


def explained(texts: Iterable[str]) -> tuple[Any, str] | None:
    """The first CUDA-stack error in `texts` (root causes first) and the line that shows it."""
    from fpdoctor.meanings import explain_text

    for text in texts:
        error = explain_text(text)
        if error is None or error.finding != "cuda-error":
            continue
        m = error.pattern.search(text)
        if m is None:
            continue
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end())
        return error, text[start : end if end != -1 else None].strip()[:240]
    return None


def _command(ctx: Context) -> tuple[str, str | None]:
    """The command that failed, as far as the log shows it (the script of its `<module>` frame)."""
    scripts = re.findall(r'File "(?P<file>[^"<>]+\.py)", line \d+, in <module>', "\n".join(ctx.facts.texts))
    scripts = [s for s in scripts if "site-packages" not in s and "dist-packages" not in s]
    if scripts:
        return f"python {shlex.quote(scripts[0])}", scripts[0]
    return "python train.py", None


def cuda_errors(ctx: Context) -> Iterable[Finding]:
    found = explained(ctx.facts.texts)
    if found is None:
        return
    error, line = found
    quoted = {q for f in ctx.findings for q in f.evidence.get("matched") or []}
    if error.key in LEFT_TO_OTHER_RULES or line in quoted:
        return
    command, script = _command(ctx)
    fix = [] if script else ["# the log does not show the command that failed; put it where `python train.py` is:"]
    for template in error.meaning.fix.splitlines():
        step = (
            template.replace("COMMAND", command)
            .replace("python SCRIPT.py", command)
            .replace("SCRIPT.py", script or "train.py")
        )
        fix.append(step if _RUNS.match(step) or step.startswith("#") else f"# {step}")
    fix.append(f"fpdoctor run -- {command}   # when it fails again: the error, the ops in flight and the Python stack")
    frames = (ctx.facts.raw.get("log") or {}).get("frames") or []
    yield catalog.make(
        "cuda-error",
        message=(
            f"The run failed with: {line}. {error.meaning.text}"
            + (f" The traceback's last frame: {frames[-1]}." if frames else "")
        ),
        fix="\n".join(fix),
        evidence={"matched": [line], "error_kind": error.key},
    )
