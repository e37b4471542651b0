"""What `env --from` imports: its budget (0.5 s, run on every new issue by a triage bot) is spent
mostly on imports, so the modules it has no use for are kept out, each a test that fails when an
import creeps back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPORT = Path(__file__).resolve().parent.parent / "fixtures" / "env" / "collect_env" / "h20_cu121_pytorch133548.txt"

# Not needed to read a file, judge it and print JSON: torch and its neighbours, the other commands
# (their argument parsers), live collection (importlib.metadata, subprocess), the text renderer.
_KEPT_OUT = (
    "torch",
    "numpy",
    "rich",
    "fpdoctor.cli.trace",
    "fpdoctor.cli.compare",
    "fpdoctor.cli.watch",
    "fpdoctor.precision",
    "fpdoctor.numerics",
    "fpdoctor.env.collect",
    "importlib.metadata",
    "tempfile",
)


def _imported(*argv: str) -> tuple[int, list[str], str]:
    code = (
        "import sys, json\nfrom fpdoctor.cli.main import main\n"
        f"code = main({list(argv)!r})\n"
        "sys.stderr.write('MODULES:' + json.dumps([code, sorted(sys.modules)]))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    exit_code, modules = json.loads(proc.stderr.rsplit("MODULES:", 1)[1])
    return exit_code, modules, proc.stdout


def test_env_from_in_json_imports_nothing_it_does_not_use():
    code, modules, out = _imported("env", "--from", str(REPORT), "--format", "json")
    assert code == 1 and json.loads(out)["command"] == "env"  # the H20 report's cuBLAS error
    loaded = [m for m in modules if any(m == name or m.startswith(name + ".") for name in _KEPT_OUT)]
    assert loaded == []


def test_the_text_report_adds_only_its_renderer():
    code, modules, out = _imported("env", "--from", str(REPORT))
    assert code == 1 and "cublas" in out.lower()
    assert "rich.console" in modules and "torch" not in modules and "fpdoctor.cli.trace" not in modules


def test_help_still_lists_every_command(capsys):
    from fpdoctor.cli.main import _COMMANDS, main

    assert main([]) == 2  # no command: every command's help, exit 2
    shown = capsys.readouterr().out
    assert all(name in shown for name in _COMMANDS)
