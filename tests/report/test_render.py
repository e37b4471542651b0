"""Renderer goldens: fixed width, colours off, exact comparison.

Regenerate after an intended change with:  FPDOCTOR_REGEN_GOLDENS=1 python -m pytest tests/report
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.parse import parse_text
from fpdoctor.report.render import render
from tests.conftest import ENV_FIXTURES

GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture(scope="module")
def h20_report() -> dict:
    text = (ENV_FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt").read_text()
    return diagnose_env(facts=parse_text(text)).to_dict()


@pytest.mark.parametrize("fmt", ["text", "markdown", "html", "json"])
def test_golden(h20_report, fmt):
    got = render(h20_report, fmt, color=False, width=100)
    path = GOLDEN / f"h20_env.{ {'text': 'txt', 'markdown': 'md', 'html': 'html', 'json': 'json'}[fmt] }"
    if os.environ.get("FPDOCTOR_REGEN_GOLDENS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(got)
    assert got == path.read_text()


def test_json_round_trips(h20_report):
    assert json.loads(render(h20_report, "json")) == json.loads(json.dumps(h20_report, default=str))


def test_html_escapes_user_text():
    report = {
        "schema": "s",
        "command": "env",
        "version": "0",
        "verdict": "error",
        "data": {},
        "findings": [
            {
                "code": "ENV104",
                "name": "known-issue",
                "severity": "error",
                "title": "<script>x</script>",
                "message": "a & b",
                "where": {},
                "evidence": {},
                "fix": "",
                "references": [],
            }
        ],
    }
    out = render(report, "html")
    assert "<script>x" not in out and "&lt;script&gt;" in out


def test_color_only_when_asked(h20_report):
    assert "\x1b[" not in render(h20_report, "text", color=False)
    assert "\x1b[" in render(h20_report, "text", color=True)


def test_unknown_format():
    with pytest.raises(ValueError, match="unknown format"):
        render({}, "yaml")


@pytest.mark.parametrize("fmt", ["text", "markdown", "html"])
def test_a_results_table_is_rendered_in_every_format(h20_report, fmt):
    report = dict(h20_report, data={"table": {"title": "Per module", "columns": ["module", "x | y"], "rows": [
        ["encoder.layer.0", "57.4"], ["<root>", "non-finite"]
    ]}})  # fmt: skip
    got = render(report, fmt, color=False, width=100)
    assert "Per module" in got and "encoder.layer.0" in got and "non-finite" in got
    if fmt == "markdown":
        # escaped: GitHub shows <root> instead of dropping it as an unknown tag
        assert "| module | x \\| y |" in got and "| &lt;root&gt; |" in got
    if fmt == "html":
        assert "<td>&lt;root&gt;</td>" in got and "<th>x | y</th>" in got


def test_module_paths_stay_whole_where_a_long_note_can_be_cut(h20_report):
    """A per-module table of a deep model: the paths printed `blocks.0.mlp.fc` and `2` on the next line,
    read as two modules, while the notes column took the width."""
    columns = ["module", "propagated", "isolated", "floor", "isolated/floor", "NaN/Inf", "note"]
    rows = [[f"blocks.{k}.attention.out_proj", "63.0", "68.7", "73.9", "1.8x", "0", "Inf/NaN came in; op " * 3]
            for k in range(12)]  # fmt: skip
    report = dict(h20_report, data={"table": {"title": "Per module", "columns": columns, "rows": rows}})
    got = render(report, "text", color=False, width=100)
    assert all(f"blocks.{k}.attention.out_proj " in got for k in range(12)), got


def _finding_report(h20_report, **finding):
    base = dict(h20_report["findings"][0])
    return dict(h20_report, findings=[dict(base, **finding)], data={})


def test_markdown_escapes_pasted_text_and_keeps_prose_out_of_code_blocks(h20_report):
    from markdown_it import MarkdownIt

    report = _finding_report(
        h20_report,
        message="the loaded copy is <wheel nvidia-cublas-cu12> & not the system one",
        fix="Keep the named module in fp32; the finding says which one.",
        evidence={"inputs": [{"dtype": "torch.float16", "max": 70000.123456}], "shape": [64, 32], "ok": False},
    )
    md = render(report, "markdown")
    page = MarkdownIt("commonmark").enable("table").render(md)
    assert "&lt;wheel nvidia-cublas-cu12&gt; &amp; not" in page  # shown, not eaten as a tag
    assert "```sh" not in md and "<code>Keep the named" not in page  # prose stays prose
    assert "- inputs: (dtype torch.float16, max 7e+04)" in md and "- shape: [64, 32]" in md
    assert "- ok: false" in md and "{" not in md.split("**Fix**")[0].split("<details>")[1]  # no JSON blobs


def test_a_command_fix_is_a_code_block_in_markdown_and_pre_in_html(h20_report):
    md = render(h20_report, "markdown")
    assert "```sh\npython -m pip install" in md
    prose = _finding_report(h20_report, fix="Use bf16 where the cause is range.")
    assert "<p>Use bf16 where the cause is range.</p>" in render(prose, "html")
    assert "<pre>python -m pip install" in render(h20_report, "html")


def test_a_report_that_could_not_look_never_reads_ok(h20_report):
    blind = dict(h20_report, findings=[], verdict="ok", data={"status": "not checked"})
    assert render(blind, "text").startswith(" NOT CHECKED ")
    seen = dict(h20_report, findings=[], verdict="ok", data={"status": "healthy"})
    assert render(seen, "text").startswith(" OK ")


def test_a_clean_text_report_leads_with_the_verdict_and_a_few_facts(h20_report):
    from fpdoctor.report.render import CLEAN_ROWS

    rows = [[f"fact {i}", str(i)] for i in range(24)]
    clean = dict(h20_report, findings=[], verdict="ok", data={"summary": rows})
    short = render(clean, "text")
    assert "fact 7" in short and "fact 8" not in short and "16 more facts: -v shows them" in short
    assert "fact 23" in render(clean, "text", verbose=True) and CLEAN_ROWS == 8
    problem = dict(h20_report, data={"summary": rows})  # with findings, every fact is shown
    assert "fact 23" in render(problem, "text")


@pytest.mark.parametrize("status", ["incomplete", "in progress"])
def test_a_run_that_did_not_reach_its_end_never_reads_ok_in_any_format(status):
    from fpdoctor.report.model import Report

    cut = Report(command="watch", data={"status": status, "summary": [["steps", "3"]]})
    doc = cut.to_dict()
    assert doc["verdict"] == "warning" and cut.exit_code == 0  # not ok, and the exit status is not changed
    assert render(doc, "text").startswith(f" {status.upper()} ")
    assert f"### fpdoctor watch: **{status}**" in render(doc, "markdown")
    page = render(doc, "html")
    assert f'<span class="verdict">{status}</span>' in page and f"<title>fpdoctor watch: {status}" in page
    from fpdoctor.catalog import make

    found = Report(command="watch", findings=[make("nonfinite-loss", message="m")], data={"status": status})
    assert render(found.to_dict(), "text").startswith(f" ERROR, {status.upper()} ")
