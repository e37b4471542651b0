from __future__ import annotations

import json

import pytest

from fpdoctor import catalog
from fpdoctor.report.model import SCHEMA, Finding, Report, Severity, Trial


def _finding(name: str = "driver-too-old", severity: Severity | None = None) -> Finding:
    return catalog.make(name, message="m", severity=severity)


def test_verdict_follows_the_worst_finding():
    report = Report(command="env")
    assert report.verdict == "ok" and report.exit_code == 0
    report.extend([_finding("known-issue", Severity.INFO)])
    assert report.verdict == "ok"
    report.extend([_finding("duplicate-cuda-library")])
    assert report.verdict == "warning" and report.exit_code == 0
    report.extend([_finding("driver-too-old")])
    assert report.verdict == "error" and report.exit_code == 1


def test_json_shape_matches_the_contract():
    report = Report(
        command="env", findings=[_finding("duplicate-cuda-library"), _finding("cublas-h20-sigfpe")], data={"x": 1}
    )
    doc = json.loads(report.to_json())
    assert list(doc) == ["schema", "command", "version", "verdict", "findings", "data"]
    assert doc["schema"] == SCHEMA == "fpdoctor.report/1"
    assert doc["verdict"] == "error"
    first = doc["findings"][0]
    assert list(first) == [
        "code", "name", "severity", "title", "message", "where", "evidence", "fix", "fix_trial", "references"
    ]  # fmt: skip
    assert first["fix_trial"]["status"] == "not-tried" and first["fix_trial"]["reason"]
    assert first["name"] == "cublas-h20-sigfpe"  # errors sort first
    assert first["code"] == "ENV101"


def test_finding_validation():
    with pytest.raises(ValueError, match="Severity"):
        Finding(code="ENV001", name="x", severity="error", title="t", message="m")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="code"):
        Finding(code="", name="x", severity=Severity.ERROR, title="t", message="m")


def test_unknown_where_and_evidence_keys_are_omitted_not_null():
    finding = catalog.make(
        "device-mismatch",
        message="m",
        where={"module": None, "op": None, "phase": None},
        evidence={"kind": "device", "count": 2, "numel": None, "dtype": None},
    )
    doc = json.loads(Report(command="audit", findings=[finding]).to_json())["findings"][0]
    # null module is a fact (outside any module); the rest was unknown
    assert doc["where"] == {"module": None}
    assert doc["evidence"] == {"kind": "device", "count": 2}


def test_json_is_standard_and_str_is_the_text_report():
    from fpdoctor.report.render import render

    finding = catalog.make(
        "nonfinite-produced",
        message="m",
        evidence={"inputs": [{"min": float("-inf"), "max": float("nan")}]},
        trial=Trial.checked("x in fp32", metric="max |x|", before=float("inf"), after=2.0),
    )
    report = Report(command="trace", findings=[finding], data={"absmax": float("inf")})
    for text in (report.to_json(), render(report.to_dict(), "json")):
        doc = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
        assert doc["findings"][0]["evidence"]["inputs"] == [{"min": "-inf", "max": "nan"}]
        assert doc["data"]["absmax"] == "inf"
    assert str(report).startswith(render(report.to_dict(), "text")[:40]) and "NUM001" in str(report)


def test_severity_rank_reads_a_report_dicts_spelling():
    from fpdoctor.report.model import severity_rank

    assert [severity_rank(s) for s in ("info", "warning", "error")] == [0, 1, 2]
    assert severity_rank("error") == Severity.ERROR.rank
    assert severity_rank("fatal") == 0  # a newer fpdoctor's severity ranks lowest here


def test_a_fix_says_whether_it_was_tried_in_json_and_every_rendering():
    from fpdoctor.report.render import render

    tried = catalog.make(
        "nonfinite-produced",
        message="m",
        trial=Trial.checked("line 3 in fp32", metric="max |x|", before=float("inf"), after=2.5, on="4096 tokens"),
    )
    untried = catalog.make("loss-spike", message="m")  # the catalogue says why its fixes are not tried
    report = Report(command="trace", findings=[tried, untried])
    doc = json.loads(report.to_json())
    assert doc["findings"][0]["fix_trial"] == {
        "status": "checked", "changed": "line 3 in fp32", "metric": "max |x|", "before": "inf", "after": 2.5,
        "on": "4096 tokens",
    }  # fmt: skip
    assert doc["findings"][1]["fix_trial"]["status"] == "not-tried"
    assert Finding.from_dict(doc["findings"][0]).trial == Trial.checked(
        "line 3 in fp32", metric="max |x|", before="inf", after=2.5, on="4096 tokens"
    )
    line = "checked on 4096 tokens: line 3 in fp32; max |x| inf "  # the arrow is escaped in markdown and HTML
    for fmt in ("text", "markdown", "html"):
        out = render(report.to_dict(), fmt)
        assert line in out and f"not tried: {catalog.get('loss-spike').untried}"[:60] in out, fmt


def test_a_trial_says_what_it_measured_or_why_not():
    with pytest.raises(ValueError, match="measured"):
        Trial(tried=True, changed="x")
    with pytest.raises(ValueError, match="why"):
        Trial(tried=False)
    no_fix = catalog.make("loss-spike", message="m", fix="")
    assert not no_fix.unproven and catalog.make("nonfinite-produced", message="m").unproven
