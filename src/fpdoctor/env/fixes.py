"""Fix lines a user can paste: the interpreter the input shows, commands first, the cost of each.

Every line of a fix is a shell command or a `#` comment. The first command is the one to take;
alternatives follow with what they cost. Where no single command fits, a comment says why.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

# Changing torch (version or CUDA variant) changes its C++ ABI: extensions built against the old
# one fail to import ("undefined symbol") until rebuilt.
TORCH_CHANGE_COST = (
    "# cost: changes torch; rebuild or reinstall compiled extensions (flash-attn, xformers, apex, custom ops)"
)

# A pasted path into an installation: ".../envs/x/lib/python3.10/site-packages/torch/..."
_SITE = re.compile(r"(?P<prefix>/[\w.+@~/-]*?)/lib/python3\.\d+/(?P<kind>site|dist)-packages/")


def interpreter(facts: Any) -> str:
    """The Python whose pip must change: the one collected live, or the one a pasted path shows."""
    raw = facts.raw if hasattr(facts, "raw") else facts
    executable = (raw.get("python") or {}).get("executable")
    if executable:
        return shlex.quote(str(executable))
    for text in raw.get("texts") or []:
        m = _SITE.search(text)
        if not m:
            continue
        if m["kind"] == "dist":  # Debian/Ubuntu's system Python keeps packages in dist-packages
            return "python3"
        return shlex.quote(f"{m['prefix']}/bin/python")
    return "python"


def pip(python: str, args: str) -> str:
    return f"{python} -m pip {args}"


_SHELL = ("export ", "unset ", "nvidia-smi", "sudo ", "conda ", "docker ", "CUDA_", "fpdoctor ", "rm ")
_PIP = re.compile(r"^(?:python3? -m )?pip3? ")
# A pip argument: an option, a requirement ('numpy<2', nvidia-cublas-cu12==12.4.5.8), quoted or not.
_PIP_ARG = re.compile(
    r"""^(?:-[-\w=]+|'[^']+'|"[^"]+"|[A-Za-z0-9][\w.\-\[\]]*(?:[<>=!~]=?[\w.*]+(?:,[<>=!~]=?[\w.*]+)*)?)$"""
)
_ENGLISH = {"the", "a", "an", "version", "that", "which", "torch's", "of"}
# The reference data's own files mean nothing to a user.
_INTERNAL_REF = re.compile(r"\s*\((?:see )?[\w./ ]*\.(?:csv|yaml)\)")


def _pip_command(line: str, python: str) -> tuple[str, str] | None:
    """(command, comment) when `line` is a pip command that pastes; None when it is prose."""
    body, _, comment = line.partition("#")
    m = re.match(r"^(?P<cmd>.*?)\s*\((?P<note>[^)]*)\)\s*$", body.strip())
    if m:  # "pip install -U x (>= the version torch's cusparse needs)": the parenthesis is a comment
        body, comment = m["cmd"], (m["note"] + (f"; {comment.strip()}" if comment.strip() else ""))
    words = _PIP.sub("", body.strip()).split()
    args = words[1:] if words and words[0] in ("install", "uninstall") else []
    if not args or any(w in _ENGLISH or not _PIP_ARG.match(w) for w in args):
        return None
    return pip(python, " ".join(words)), comment.strip()


def data_fix(lines: list[str] | None, python: str) -> str:
    """A known issue's `fix` list (prose and commands, in order of preference) as fix lines: each
    a command or a comment, the first the one to take."""
    out: list[str] = []
    for k, item in enumerate(lines or []):
        line = _INTERNAL_REF.sub("", str(item)).strip()
        if k:
            line = re.sub(r"^(?:or|Or)\s+", "", line)
        lead = "" if k == 0 else "# or: "
        tag = "" if k == 0 else "alternative"
        command, sep, rest = line.partition(", or ")
        piped = _pip_command(line, python) if _PIP.match(line) else None
        if piped:
            note = "; ".join(x for x in (tag, piped[1]) if x)
            out.append(piped[0] + (f"   # {note}" if note else ""))
        elif command.startswith(_SHELL) and sep and not command.startswith("docker "):
            out.append(f"{command}   # {'alternative; ' if k else ''}or {rest}")
        elif line.startswith(_SHELL) and not line.startswith("docker "):
            out.append(line + (f"   # {tag}" if tag else ""))
        elif line.startswith("torch.") or "attn_implementation" in line:
            out.append(f"{lead or '# '}in your script (fpdoctor cannot edit it): {line}")
        else:
            out.append(f"{lead or '# '}{line}")
    if out and all(o.startswith("#") for o in out):
        out.append("# no single command: the steps above depend on this machine's setup, which the input does not show")
    return "\n".join(out)
