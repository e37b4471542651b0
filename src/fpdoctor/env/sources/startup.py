"""What runs before a program's first line: sitecustomize and usercustomize modules, `.pth` files
(a line starting with `import` is executed by `site` at every start), PYTHONPATH's entries and the
libraries the dynamic loader preloads (LD_PRELOAD, /etc/ld.so.preload).

Two machines with the same packages can still differ here, and such code can change any number:
it may set torch's flags, register kernels over torch's (the torch child lists those), or
replace functions of the C libraries every kernel calls. Read from this process (started like
any other Python on the machine) and from the files; nothing is imported or run.
"""

from __future__ import annotations

import hashlib
import os
import site
import sys
from typing import Any

PTH_LINES = 5  # executed lines kept per .pth file (the file's path and digest say the rest)
LINE_CHARS = 200


def digest(path: str) -> str | None:
    """The first 12 hex digits of the file's SHA-256: the same file on two machines, or not."""
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()[:12]
    except OSError:
        return None


def customize_modules() -> list[dict[str, Any]]:
    """sitecustomize and usercustomize: loaded by `site` at this process's start, or (under -S or
    -s) the file a default start would load."""
    import importlib.util

    found = []
    for name in ("sitecustomize", "usercustomize"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        loaded = module is not None
        if module is None:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError):
                spec = None
            path = spec.origin if spec is not None else None
        if path:
            found.append({"module": name, "path": path, "loaded": loaded, "sha256": digest(path)})
    return found


def site_dirs() -> list[str]:
    """The directories whose .pth files `site` reads at start-up."""
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def pth_files(dirs: list[str] | None = None) -> list[dict[str, Any]]:
    """Each .pth file `site` reads: its path, whether it executes code (a line starting with
    "import", which `site` runs), those lines, and how many directories it adds to sys.path."""
    found = []
    for directory in site_dirs() if dirs is None else dirs:
        try:
            names = sorted(n for n in os.listdir(directory) if n.endswith(".pth"))
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    lines = [line.rstrip("\n") for line in fh]
            except OSError:
                continue
            # site.addpackage: a line starting with "import " or "import\t" is exec'd; "#" is a comment
            code = [line.strip()[:LINE_CHARS] for line in lines if line.startswith(("import ", "import\t"))]
            paths = [line for line in lines if line.strip() and not line.startswith(("#", "import ", "import\t"))]
            entry: dict[str, Any] = {"path": path, "executes": bool(code), "paths": len(paths)}
            if code:
                entry["code"] = code[:PTH_LINES]
                entry["sha256"] = digest(path)
            found.append(entry)
    return found


def preloaded(environ: dict[str, str] | None = None) -> list[dict[str, str]]:
    """The libraries the dynamic loader maps before any other: LD_PRELOAD's, then /etc/ld.so.preload's."""
    environ = dict(os.environ if environ is None else environ)
    found = [{"path": p, "source": "LD_PRELOAD"} for p in environ.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    try:
        with open("/etc/ld.so.preload", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                for path in line.split("#", 1)[0].split():
                    found.append({"path": path, "source": "/etc/ld.so.preload"})
    except OSError:
        pass  # absent on most machines: nothing preloaded that way
    return found


def collect() -> dict[str, Any]:
    return {
        "startup": {
            "customize": customize_modules(),
            "pth": pth_files(),
            "pythonpath": [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p],
            "preload": preloaded(),
        }
    }
