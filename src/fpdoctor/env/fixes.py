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


def data_fix(lines: list[str] | None, python: str) -> str:
    """A known issue's `fix` list (prose and commands, in order of preference) as fix lines."""
    out: list[str] = []
    for k, item in enumerate(lines or []):
        line = str(item).strip()
        lead = "" if k == 0 else "# or: "
        command, sep, rest = line.partition(", or ")
        if _PIP.match(line):
            cmd = _PIP.sub(pip(python, ""), line)
            out.append(cmd if k == 0 else f"{cmd}   # alternative")
        elif command.startswith(_SHELL) and sep and not command.startswith("docker "):
            out.append(f"{command}   # or {rest}" if k == 0 else f"{command}   # alternative; or {rest}")
        elif line.startswith(_SHELL) and not line.startswith("docker "):
            out.append(line if k == 0 else f"{line}   # alternative")
        elif line.startswith("torch.") or "attn_implementation" in line:
            out.append(f"{lead or '# '}in your script (fpdoctor cannot edit it): {line}")
        else:
            out.append(f"{lead}{line}" if lead else f"# {line}")
    if out and all(o.startswith("#") for o in out):
        out.append("# no single command: the steps above depend on this machine's setup, which the input does not show")
    return "\n".join(out)
