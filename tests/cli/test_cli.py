from __future__ import annotations

import json

import pytest

from fpdoctor import catalog
from tests.conftest import ENV_FIXTURES, run_fpdoctor


def test_version_and_help(cli):
    assert run_fpdoctor("--version").out.startswith("fpdoctor ")
    result = cli()
    assert result.code == 2 and "env" in result.out


@pytest.mark.parametrize("command", ["trace", "watch"])
def test_help_says_the_report_goes_to_stderr_without_o(capsys, command):
    """trace and watch leave stdout to the script: their report goes to stderr, and -o's help says so."""
    from fpdoctor.cli.main import main

    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help at the terminal's width
    assert done.value.code == 0
    assert "write the report to FILE instead of stderr" in text and "instead of stdout" not in text


def test_explain_by_code_and_name(cli):
    by_code = cli("explain", "ENV101")
    by_name = cli("explain", "cublas-h20-sigfpe")
    assert by_code.code == 0 and by_code.out == by_name.out
    assert by_code.out.startswith("ENV101 cublas-h20-sigfpe (error)")
    assert "What it does" in by_code.out and "How to fix" in by_code.out
    doc = json.loads(cli("explain", "ENV003", "--format", "json").out)
    assert doc["name"] == "driver-too-old"


def test_rules_lists_every_code(cli):
    out = cli("rules").out
    for rule in catalog.rules():
        assert rule.code in out and rule.name in out
    assert len(json.loads(cli("rules", "--format", "json").out)) == len(catalog.rules())


def test_every_format_renders(cli):
    report = ENV_FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt"
    for fmt in ("text", "json", "markdown", "html"):
        result = cli("env", "--from", str(report), "--format", fmt)
        assert result.code == 1 and "cublas-h20-sigfpe" in result.out


def test_output_file_atomic(tmp_path, cli):
    report = ENV_FIXTURES / "collect_env" / "healthy_h100_cu124_vllm11959.txt"
    out = tmp_path / "report.json"
    out.write_text("previous")
    result = cli("env", "--from", str(report), "--format", "json", "-o", str(out))
    assert result.code == 0 and result.out == ""
    assert json.loads(out.read_text())["verdict"] == "ok"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left behind


def test_python_dash_m_entry_point():
    result = run_fpdoctor("explain", "arch-not-in-build")
    assert result.code == 0 and "ENV004" in result.out


def test_a_saved_report_is_accepted_as_input(tmp_path, cli):
    report = ENV_FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt"
    saved = tmp_path / "report.json"
    cli("env", "--from", str(report), "--format", "json", "-o", str(saved))
    again = json.loads(cli("env", "--from", str(saved), "--format", "json").out)
    assert [f["name"] for f in again["findings"]] == ["cublas-h20-sigfpe"]


def test_output_format_follows_the_extension_and_a_missing_directory_stops_before_the_work(cli, tmp_path):
    facts = next(ENV_FIXTURES.glob("collect_env/*.txt"))
    out = tmp_path / "report.json"
    cli("env", "--from", str(facts), "-o", str(out))
    assert json.loads(out.read_text())["command"] == "env"
    md = tmp_path / "report.md"
    cli("env", "--from", str(facts), "-o", str(md))
    assert md.read_text().lstrip().startswith("#")
    explicit = tmp_path / "report2.json"
    cli("env", "--from", str(facts), "-o", str(explicit), "--format", "text")
    assert not explicit.read_text().lstrip().startswith("{")
    # the script must not run when its report could not be written afterwards
    marker = tmp_path / "ran"
    script = tmp_path / "s.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = cli("trace", "-o", str(tmp_path / "missing" / "x.json"), "--", str(script))
    assert result.code == 2 and "missing" in result.err and not marker.exists()


def test_explain_and_rules_take_format_and_output_like_every_command(tmp_path, cli):
    page = tmp_path / "rules.html"
    assert cli("rules", "-o", str(page)).code == 0
    assert page.read_text().startswith("<!doctype html>") and "nonfinite-produced" in page.read_text()
    saved = tmp_path / "explain.json"
    assert cli("explain", "NUM001", "-o", str(saved)).out == ""
    assert json.loads(saved.read_text())["code"] == "NUM001"
    assert "<h2>How to fix</h2>" in cli("explain", "NUM001", "--format", "html").out


def test_written_files_follow_the_umask_and_keep_an_existing_mode(tmp_path, cli):
    import os

    old = os.umask(0o022)
    try:
        new = tmp_path / "new.md"
        cli("explain", "NUM001", "-o", str(new))
        assert new.stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
        kept = tmp_path / "kept.md"
        kept.write_text("x")
        kept.chmod(0o640)
        cli("explain", "NUM001", "-o", str(kept))
        assert kept.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
