"""Offline input for `fpdoctor env --from FILE`: collect_env reports, facts/report JSON, logs.

`python -m torch.utils.collect_env` has printed several formats over the years: the old short
one ("Is debug build: No", "[pip3] numpy (1.14.5)"), the current long one, and vLLM's
sectioned variant ("PyTorch version              : 2.7.1+cu128"). Pastes arrive quoted ("> "),
indented, cut short or wrapped in issue text. Every format becomes the same facts dict as live
collection; what the text did not show is listed in `missing`. Never imports torch.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from pathlib import Path
from typing import Any

from fpdoctor.env.facts import SCHEMA, empty_facts, shape_problem
from fpdoctor.env.refdata import refdata
from fpdoctor.env.sources.libraries import classify, wheel_entry
from fpdoctor.env.understand import keep_text, understand
from fpdoctor.errors import InputError

MAX_BYTES = 32 * 2**20
MAX_DEPTH = 32  # fpdoctor's own facts nest 5 levels; deeper JSON is not facts
STDIN = "-"
__all__ = ["STDIN", "InputError", "load", "load_all", "parse_collect_env", "parse_log", "parse_text"]


def _read(path: str) -> tuple[bytes, str]:
    """The bytes of FILE (or of standard input for "-") and the name to show for it."""
    if path == STDIN:
        stream = getattr(sys.stdin, "buffer", None)
        if stream is None:
            raise InputError("standard input is closed; pipe a report into `fpdoctor env --from -`")
        try:
            data = stream.read(MAX_BYTES)
        except OSError as exc:
            raise InputError(f"cannot read standard input ({exc.strerror})") from exc
        if not data.strip():
            raise InputError(
                "standard input is empty; pipe a report into it: "
                "python -m torch.utils.collect_env | fpdoctor env --from -"
            )
        return data, "standard input"
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such file; pass the path of a collect_env report, a facts JSON or a log")
    if p.is_dir():
        raise InputError(f"{path} is a directory; pass one file (a collect_env report, a facts JSON or a log)")
    try:
        with p.open("rb") as fh:
            return fh.read(MAX_BYTES), path
    except OSError as exc:
        raise InputError(f"{path}: cannot read it ({exc.strerror})") from exc


def load(path: str) -> dict[str, Any]:
    """Read FILE ("-": standard input) and return facts, or raise InputError saying what was
    wrong and how to fix it."""
    raw, name = _read(path)
    if not raw.strip():
        raise InputError(f"{name} is empty; save the output of `python -m torch.utils.collect_env` into it")
    if b"\x00" in raw[:8192]:
        raise InputError(f"{name} is a binary file; pass a text report, a facts JSON or a log")
    text = raw.decode("utf-8", errors="replace")
    if text.count("\ufffd") > max(16, len(text) // 100):
        raise InputError(f"{name} is not UTF-8 text; pass a text report, a facts JSON or a log")
    facts = parse_text(text, name=name)
    facts["origin"]["path"] = name
    return facts


def load_all(paths: list[str]) -> dict[str, Any]:
    """Several files about one machine (a collect_env report and the crash log, say), joined."""
    if len(paths) == 1:
        return load(paths[0])
    if paths.count(STDIN) > 1:
        raise InputError("standard input (-) can be read once; pass the other inputs as files")
    from fpdoctor.env.join import join

    return join([load(p) for p in paths])


def parse_text(text: str, name: str = "<text>") -> dict[str, Any]:
    stripped = text.lstrip("\ufeff \t\r\n")
    if stripped.startswith(("{", "[")):
        # Decided by trying: timestamped logs and torchrun's "[rank0]:" lines start with "[" too.
        try:
            doc = json.loads(stripped)
        except RecursionError:
            raise InputError(
                f"{name}: JSON nested too deeply to be fpdoctor facts; create facts with --save-facts"
            ) from None
        except json.JSONDecodeError as exc:
            facts = _parse_plain(text)
            if _recognised(facts):
                return understand(facts)
            if re.match(r'\{|\[\s*[\[{"]', stripped) or exc.pos >= len(stripped.rstrip()) - 1:
                raise InputError(
                    f"{name}: invalid or truncated JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); "
                    "write it again with `fpdoctor env --save-facts FILE`"
                ) from exc
            raise _unrecognised(name) from exc
        return understand(_facts_from_json(doc, name))
    facts = _parse_plain(text)
    if not _recognised(facts):
        raise _unrecognised(name)
    return understand(facts)


def _parse_plain(text: str) -> dict[str, Any]:
    # Bounded before any pattern runs: a pasted 5-million-character line is not a report line.
    text = keep_text(text)
    if _COLLECT_ENV_KEYS.search(_unquote(text)):
        return parse_collect_env(text)
    return parse_log(text)


def _unrecognised(name: str) -> InputError:
    return InputError(
        f"{name}: found neither collect_env fields, nor fpdoctor facts, nor a known error "
        "signature; pass the output of `python -m torch.utils.collect_env` or the log of the failing run"
    )


def _depth(doc: Any) -> int:
    """Nesting depth of a parsed JSON document, without recursion."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_DEPTH:
            break
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return deepest


def _facts_from_json(doc: Any, name: str) -> dict[str, Any]:
    if _depth(doc) > MAX_DEPTH:
        raise InputError(
            f"{name}: JSON nested more than {MAX_DEPTH} levels deep is not fpdoctor facts; "
            "create facts with `fpdoctor env --save-facts FILE`"
        )
    if isinstance(doc, dict) and doc.get("schema") == "fpdoctor.report/1":
        doc = (doc.get("data") or {}).get("facts")
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise InputError(
            f'{name}: JSON but not fpdoctor facts (expected "schema": "{SCHEMA}"); '
            "create one with `fpdoctor env --save-facts FILE`"
        )
    facts = empty_facts("facts")
    for key, value in doc.items():
        if key in facts and not isinstance(value, type(facts[key])) and facts[key] is not None and value is not None:
            raise InputError(f"{name}: field {key!r} has the wrong type; regenerate the file with --save-facts")
        facts[key] = value
    problem = shape_problem(facts)
    if problem:
        raise InputError(f"{name}: {problem}; regenerate the file with `fpdoctor env --save-facts FILE`")
    facts["origin"] = {
        **(doc.get("origin") or {}),
        "kind": "facts",
        "collected_as": (doc.get("origin") or {}).get("kind"),
    }
    return facts


# ---------------------------------------------------------------------------------------------
# collect_env

_COLLECT_ENV_KEYS = re.compile(
    r"^\s*(PyTorch version|CUDA used to build PyTorch|Is CUDA available|GPU models and configuration)\s*[:：]?",
    re.MULTILINE,
)
_KV = re.compile(r"^(?P<key>[A-Za-z][A-Za-z0-9 _/().-]*?)\s*[:：]\s*(?P<value>.*)$")
_GPU_LINE = re.compile(r"^GPU\s+(?P<index>\d+)\s*[:：]\s*(?P<name>.+?)(?:\s*\(UUID:\s*(?P<uuid>[^)]+)\))?\s*$")
_PIP_LINE = re.compile(r"^\[(?P<tool>pip3?|conda)\]\s+(?P<rest>.+)$")
_NONE = {"", "none", "n/a", "could not collect", "no cuda", "not available"}


def _unquote(text: str) -> str:
    """Undo e-mail/issue quoting ("> ") and indentation of a pasted block."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        lines.append(re.sub(r"^\s*(?:>\s?)+", "", line).strip())
    return "\n".join(lines)


def _value(text: str) -> str | None:
    text = text.strip()
    return None if text.lower() in _NONE else text


def _yes(text: str | None) -> bool | None:
    if text is None:
        return None
    return text.strip().lower() in {"yes", "true"}


def parse_collect_env(text: str) -> dict[str, Any]:
    facts = empty_facts("collect_env")
    body = _unquote(text)
    lines = body.split("\n")
    torch: dict[str, Any] = {"import": "ok"}
    kv: dict[str, str] = {}
    gpu_block = cudnn_block = False
    pip: list[tuple[str, str, str]] = []  # (tool, name, version)
    for line in lines:
        if not line:
            gpu_block = cudnn_block = False  # a blank line ends a multi-line value
            continue
        if line.startswith(("```", "=====", "<")):
            continue
        gpu = _GPU_LINE.match(line)
        if gpu:
            _add_gpu(facts, gpu)
            continue
        pipm = _PIP_LINE.match(line)
        if pipm:
            pip.append(_pip_entry(pipm["tool"], pipm["rest"]))
            continue
        if cudnn_block and line.startswith("/"):
            kind = classify(Path(line).name)
            if kind:
                facts["libraries"]["copies"].append(
                    {
                        "library": kind[0],
                        "path": line,
                        "origins": ["report"],
                        "version": kind[1] or None,
                        "version_source": "filename",
                        "package": None,
                    }
                )
            continue
        m = _KV.match(line) or re.match(r"^(?P<key>PyTorch version)\s+(?P<value>\S+)$", line)
        if not m:
            continue
        key, value = m["key"].strip().lower(), m["value"]
        kv.setdefault(key, value)
        gpu_block = key == "gpu models and configuration"
        cudnn_block = key == "cudnn version" and "probably one of" in value.lower()
        inline_gpu = _GPU_LINE.match(value.strip()) if gpu_block else None
        if inline_gpu:
            _add_gpu(facts, inline_gpu)

    version = _value(kv.get("pytorch version", ""))
    if version:
        torch["version"] = version
    else:
        torch["import"] = None
    if "cuda used to build pytorch" in kv:
        cuda = _value(kv["cuda used to build pytorch"])
        torch["cuda"] = cuda
        torch["cuda_known_none"] = cuda is None
    hip = _value(kv.get("rocm used to build pytorch", ""))
    if hip:
        torch["hip"] = hip
    torch["debug"] = _yes(_value(kv.get("is debug build", "")))
    torch["cuda_available"] = _yes(_value(kv.get("is cuda available", "")))
    facts["torch"] = torch
    driver = _value(kv.get("nvidia driver version", ""))
    if driver:
        facts["driver"] = {"version": driver, "cuda": None, "source": "report"}
    osname = _value(kv.get("os", "")) or ""
    platform_text = _value(kv.get("python platform", "")) or ""
    system = (
        "Windows"
        if "windows" in (osname + platform_text).lower()
        else "Darwin"
        if "macos" in osname.lower()
        else "Linux"
        if osname or platform_text
        else None
    )
    facts["os"] = {
        "system": system,
        "distro": osname or None,
        "platform": platform_text or None,
        "libc": _value(kv.get("libc version", "")),
    }
    pyver = _value(kv.get("python version", ""))
    facts["python"] = {"version": pyver.split()[0] if pyver else None}
    runtime = _value(kv.get("cuda runtime version", ""))
    if runtime:
        facts["cuda_toolkit"] = {
            "version": runtime,
            "source": "report (nvcc on PATH, not necessarily the one torch uses)",
        }
    _apply_packages(facts, pip)
    _merge_log_facts(facts, parse_log(text))
    facts["origin"]["format"] = (
        "vllm"
        if "vllm version" in kv or "PyTorch Info" in body
        else "pytorch-long"
        if "cuda_module_loading set to" in kv or "libc version" in kv
        else "pytorch-short"
    )
    facts["texts"] = [text]
    facts["missing"] = missing(facts)
    return facts


def _merge_log_facts(facts: dict[str, Any], log: dict[str, Any]) -> None:
    """What torch printed around the report (its sm_XY warning, a driver error) fills the gaps."""
    if log["torch"].get("arch_list") and not facts["torch"].get("arch_list"):
        facts["torch"]["arch_list"] = log["torch"]["arch_list"]
    if log["driver"] and log["driver"].get("cuda"):
        facts["driver"] = {**(facts["driver"] or {"version": None, "source": "log"}), "cuda": log["driver"]["cuda"]}
    for seen in log["gpus"]:
        for gpu in facts["gpus"]:
            if seen.get("compute_capability") and (seen["name"] in gpu["name"] or gpu["name"] in seen["name"]):
                gpu.setdefault("compute_capability", seen["compute_capability"])
    facts["log"] = log["log"]


def _add_gpu(facts: dict[str, Any], match: re.Match[str]) -> None:
    facts["gpus"].append(
        {
            "index": int(match["index"]),
            "name": match["name"].strip(),
            "uuid": match["uuid"],
            "source": "report",
        }
    )


def _pip_entry(tool: str, rest: str) -> tuple[str, str, str]:
    rest = rest.strip()
    if tool == "conda":
        parts = rest.split()
        channel = parts[3] if len(parts) > 3 else ""
        # "[conda] torch 2.1.0 pypi_0 pypi" is the pip install seen from conda, not a second copy
        tool = "conda-pip" if ("pypi" in channel or "<pip>" in rest) else "conda"
        return tool, parts[0].lower(), parts[1] if len(parts) > 1 else ""
    m = re.match(r"^(?P<name>[A-Za-z0-9_.-]+)\s*(?:==\s*(?P<v1>\S+)|\((?P<v2>[^)]+)\))?", rest)
    if not m:
        return "pip", rest.lower(), ""
    return "pip", m["name"].lower(), m["v1"] or m["v2"] or ""


def _apply_packages(facts: dict[str, Any], pip: list[tuple[str, str, str]]) -> None:
    installs = facts["torch_installs"]["installs"]
    for tool, name, ver in pip:
        norm = re.sub(r"[-_.]+", "-", name)
        if tool == "pip" and norm == "torch":
            installs.append({"version": ver, "location": None, "installer": "pip"})
        elif tool == "conda" and norm in {"pytorch", "torch"} and ver:
            installs.append({"version": ver, "location": None, "installer": "conda"})
        elif tool == "pip" and norm == "numpy":
            facts["numpy"] = {"version": ver}
        elif tool == "pip" and (wheel := wheel_entry(norm, ver)):
            facts["libraries"]["wheels"].append(wheel)
    facts["packages"] = [{"tool": t, "name": n, "version": v} for t, n, v in pip]


def missing(facts: dict[str, Any]) -> list[str]:
    """What the input did not show (a value shown but not understood is reported as such)."""
    gaps = []
    torch = facts["torch"]
    if not torch.get("version") and "version_not_understood" not in torch:
        gaps.append("torch version")
    if "cuda" not in torch:
        gaps.append("CUDA version torch was built with")
    if not facts["gpus"]:
        gaps.append("GPU models")
    if not facts["driver"]:
        gaps.append("driver version")
    if not torch.get("arch_list"):
        gaps.append("torch arch list (judged from fpdoctor's table of official wheels)")
    if facts["libraries"]["loaded"] is None:
        gaps.append("loaded CUDA libraries (only a live `fpdoctor env` can see them)")
    if not facts["libraries"]["wheels"]:
        gaps.append("installed nvidia-* wheels (judged from the torch build)")
    return gaps


# ---------------------------------------------------------------------------------------------
# logs and tracebacks

_TORCH_VERSION = re.compile(
    r"(?:\btorch(?:==|-|\s+|\s*version[:=]?\s*|\s*:\s*)|PyTorch\s+version[:=]?\s*)v?(?P<v>\d+\.\d+(?:\.\d+)?(?:\+[A-Za-z0-9.]+)?)"
)
# A line holding only a version with a CUDA/ROCm/CPU label is what print(torch.__version__) shows.
_BARE_TORCH_VERSION = re.compile(r"^\s*(?P<v>\d+\.\d+\.\d+\+(?:cu\d{3}|cpu|rocm[\d.]+))\s*$", re.MULTILINE)
_SMI_DRIVER = re.compile(r"Driver Version:\s*(?P<driver>\d+\.\d+(?:\.\d+)?)(?:\s+CUDA Version:\s*(?P<cuda>\d+\.\d+))?")
_FOUND_VERSION = re.compile(r"driver on your system is too old \(found version (?P<v>\d{4,6})\)")
_SM_WARNING = re.compile(
    r"(?P<name>NVIDIA [^\n]*?|[A-Z][^\n]*?) with CUDA capability sm_(?P<sm>\d{2,3}) is not compatible"
)
_SUPPORTS = re.compile(r"supports CUDA capabilities (?P<list>(?:(?:sm|compute)_\d+\s*)+)")
_WHEEL_VERSION = re.compile(
    r"\b(?P<pkg>nvidia-(?:cublas|cudnn|nccl|cuda-runtime|nvjitlink)(?:-cu\d+)?)(?:==|\s+)(?P<v>\d+(?:\.\d+)+)"
)
_SIGNAL = re.compile(
    r"Signal (?P<num>\d+) \((?P<name>SIG[A-Z]+)\)"
    r"|Fatal Python error: (?P<fatal>Floating point exception|Segmentation fault|Aborted|Bus error)"
    r"|exitcode\s*:\s*-(?P<code>\d{1,3})\b"
    r"|(?P<shell>Floating point exception|Segmentation fault|Bus error) \(core dumped\)"
)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<func>\w+)')
_FATAL_NAMES = {
    "Floating point exception": "SIGFPE",
    "Segmentation fault": "SIGSEGV",
    "Aborted": "SIGABRT",
    "Bus error": "SIGBUS",
}
_SIGNUMS = {8: "SIGFPE", 11: "SIGSEGV", 6: "SIGABRT", 7: "SIGBUS", 4: "SIGILL"}
# nvidia-smi's table row: "|   0  NVIDIA A100-SXM...  On   | 00000000:4B:00.0 Off |" (names cut at its width)
_SMI_ROW = re.compile(
    r"^\|\s+(?P<index>\d{1,2})\s+(?P<name>\S.*?)\s+(?:On|Off)\s+\|\s+(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d)",
    re.MULTILINE,
)
# Decorations that launchers and loggers put before each line: ANSI colours, torchrun's
# "[rank0]:" (with an optional "[E625 07:23:25.92 File.cpp:12]" glog header after it).
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:(?:\[[^\]\n]*\]\s?)?", re.MULTILINE)


# A traceback through `import torch` that ends in an error: the import failed.
_IMPORT_TORCH = re.compile(r"in <module>\n\s*(?:import torch|from torch\b[^\n]*)\s*\n")
_ERROR_LINE = re.compile(r"^(?P<line>\w*(?:Error|Exception): .+)$", re.MULTILINE)


def clean_log(text: str) -> str:
    return _RANK_PREFIX.sub("", _ANSI.sub("", text))


@functools.lru_cache(maxsize=1)
def _gpu_name_pattern() -> tuple[re.Pattern[str], dict[str, str]]:
    """One pattern for every GPU name the table has seen (longest first), and name -> table row id."""
    owner: dict[str, str] = {}
    for row in refdata().gpu_rows:
        for cand in (s.strip() for s in row["nvidia_smi_names_seen"].split(";")):
            if cand:
                owner.setdefault(cand, row["gpu_model"])
    names = sorted(owner, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(?:" + "|".join(re.escape(n) for n in names) + r")(?![\w-])")
    return pattern, owner


def _gpu_names_in(text: str) -> list[str]:
    """GPU names from the reference table that appear in free text, the longest per table row."""
    pattern, owner = _gpu_name_pattern()
    best: dict[str, str] = {}
    for m in pattern.finditer(text):
        name, row = m.group(0), owner[m.group(0)]
        if len(name) > len(best.get(row, "")):
            best[row] = name
    names = list(best.values())
    # "NVIDIA H100 80GB HBM3" also contains "NVIDIA H100"-like shorter names; keep the longest.
    return [n for n in names if not any(n != o and n in o for o in names)]


def parse_log(text: str) -> dict[str, Any]:
    facts = empty_facts("log")
    text = clean_log(text)
    torch: dict[str, Any] = {}
    m = _TORCH_VERSION.search(text) or _BARE_TORCH_VERSION.search(text)
    if m:
        torch["version"] = m["v"]
    facts["torch"] = torch
    rows = list(_SMI_ROW.finditer(text))
    if rows:
        facts["gpus"] = [
            {"index": int(r["index"]), "name": r["name"], "pci": r["bus"], "source": "log (nvidia-smi)"} for r in rows
        ]
    else:
        for i, name in enumerate(_gpu_names_in(text)):
            facts["gpus"].append({"index": i, "name": name, "source": "log"})
    for warn in _SM_WARNING.finditer(text):
        name = warn["name"].strip()
        sm = int(warn["sm"])
        cc = f"{sm // 10}.{sm % 10}"
        known = next((g for g in facts["gpus"] if g["name"] in name or name in g["name"]), None)
        if known:
            known["compute_capability"] = cc
        else:
            facts["gpus"].append({"index": len(facts["gpus"]), "name": name, "compute_capability": cc, "source": "log"})
    failed = _IMPORT_TORCH.search(text)
    error = _ERROR_LINE.search(text, failed.end()) if failed else None
    # NumPy prints "_ARRAY_API not found" as a traceback through `import torch`, and the import goes on.
    if error and "_ARRAY_API not found" not in error["line"]:
        torch.update({"import": "failed", "stage": "import", "error": error["line"].strip()[:1000]})
    sup = _SUPPORTS.search(text)
    if sup:
        torch["arch_list"] = sup["list"].split()
    smi = _SMI_DRIVER.search(text)
    if smi:
        facts["driver"] = {"version": smi["driver"], "cuda": smi["cuda"], "source": "log (nvidia-smi)"}
    found = _FOUND_VERSION.search(text)
    if found:
        # torch prints the driver's CUDA version as an integer: 11040 means CUDA 11.4.
        v = int(found["v"])
        facts["driver"] = {
            **(facts["driver"] or {"version": None, "source": "log"}),
            "cuda": f"{v // 1000}.{v % 1000 // 10}",
        }
    for found_wheel in _WHEEL_VERSION.finditer(text):
        if wheel := wheel_entry(found_wheel["pkg"], found_wheel["v"]):
            facts["libraries"]["wheels"].append(wheel)
    signals = []
    for sm_ in _SIGNAL.finditer(text):
        if sm_["name"]:
            signals.append(sm_["name"])
        elif sm_["fatal"]:
            signals.append(_FATAL_NAMES[sm_["fatal"]])
        elif sm_["code"]:
            signals.append(_SIGNUMS.get(int(sm_["code"]), f"signal {sm_['code']}"))
        elif sm_["shell"]:
            signals.append(_FATAL_NAMES[sm_["shell"]])
    frames = [f"{Path(f['file']).name}:{f['line']} in {f['func']}" for f in _FRAME.finditer(text)]
    facts["log"] = {"signals": list(dict.fromkeys(signals)), "frames": frames[-8:]}
    facts["texts"] = [text]
    facts["missing"] = missing(facts)
    return facts


def _recognised(facts: dict[str, Any]) -> bool:
    """Whether the text showed anything fpdoctor reads: facts, a signal, a known error, an Xid.
    A generic symptom alone (a script that prints "loss is NaN") is not enough."""
    from fpdoctor.env.rules import cuda_errors
    from fpdoctor.env.rules.known import HARDWARE, matched_issues

    return bool(
        facts["torch"].get("version")
        or facts["torch"].get("import") == "failed"
        or facts["gpus"]
        or facts["driver"]
        or facts["log"]["signals"]
        or facts["libraries"]["wheels"]
        or matched_issues(facts["texts"])
        or any(HARDWARE.search(t) for t in facts["texts"])
        or cuda_errors.explained(facts["texts"])
    )
