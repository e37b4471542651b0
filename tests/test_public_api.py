"""The public facade: explicit exports, and `import fpdoctor` stays light (ARCHITECTURE.md, contract 3)."""

from __future__ import annotations

import subprocess
import sys

import fpdoctor


def test_all_is_sorted_and_complete():
    assert fpdoctor.__all__ == sorted(fpdoctor.__all__)
    for name in fpdoctor.__all__:
        assert getattr(fpdoctor, name) is not None


def test_public_names_resolve_to_their_definitions():
    from fpdoctor.env.doctor import diagnose_env
    from fpdoctor.report.model import Finding, Report

    assert fpdoctor.Report is Report
    assert fpdoctor.Finding is Finding
    assert fpdoctor.diagnose_env is diagnose_env


def test_unknown_attribute_raises():
    import pytest

    with pytest.raises(AttributeError):
        _ = fpdoctor.no_such_name


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nsys.stderr.write('MODULES:' + ' '.join(sys.modules))"
    err = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stderr
    return set(err.rsplit("MODULES:", 1)[1].split())


def test_import_does_not_import_torch_or_rich():
    modules = _modules_after("import fpdoctor")
    assert "torch" not in modules
    assert "rich" not in modules


def test_offline_commands_never_import_torch(tmp_path):
    report = tmp_path / "r.txt"
    report.write_text("PyTorch version: 2.3.0+cu121\nCUDA used to build PyTorch: 12.1\n")
    code = (
        "from fpdoctor.cli.main import main\n"
        f"main(['env', '--from', {str(report)!r}, '--format', 'json'])\n"
        "main(['explain', 'ENV101'])\nmain(['rules'])"
    )
    modules = _modules_after(code)
    assert "torch" not in modules


def test_dir_and_help_show_the_public_api_without_importing_it():
    code = (
        "import fpdoctor, pydoc, sys\n"
        "names = dir(fpdoctor)\n"
        "assert 'torch' not in sys.modules, 'dir() imported torch'\n"
        "missing = set(fpdoctor.__all__) - set(names)\n"
        "assert not missing and 'crash' in names, missing\n"
        "text = pydoc.render_doc(fpdoctor, renderer=pydoc.plaintext)\n"
        "assert 'FUNCTIONS' in text and 'keep_in_fp32' in text and 'diagnose_env' in text, text[:400]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_subpackages_as_the_readme_writes_them():
    """`fpdoctor.crash.run_command(...)` after a bare `import fpdoctor`."""
    modules = _modules_after("import fpdoctor\nassert callable(fpdoctor.crash.run_command)")
    assert "fpdoctor.crash" in modules and "torch" not in modules
