"""One fixture and one expected outcome per rule code (like ruff's per-rule fixtures). A rule of
`env --diff` (ENV3xx) has a pair of fixtures, NAME.a.json and NAME.b.json, one per machine."""

from __future__ import annotations

import pytest

from fpdoctor import catalog
from fpdoctor.env.diff import diff_env
from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.parse import load
from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

RULE_FIXTURES = ENV_FIXTURES / "rules"
ENV_RULES = [r for r in catalog.rules() if r.code.startswith("ENV")]


def _fixture(rule: catalog.RuleInfo):
    stem = f"{rule.code}-{rule.name}"
    inputs = [p for p in RULE_FIXTURES.glob(f"{stem}.*") if not p.name.endswith(".expected.json")]
    expected = RULE_FIXTURES / f"{stem}.expected.json"
    return inputs, expected


def _pair(rule: catalog.RuleInfo) -> bool:
    return rule.code.startswith("ENV3")


@pytest.mark.parametrize("rule", ENV_RULES, ids=lambda r: r.code)
def test_every_rule_has_a_fixture_and_an_expectation(rule):
    inputs, expected = _fixture(rule)
    if _pair(rule):
        names = sorted(p.name for p in inputs)
        assert names == [f"{rule.code}-{rule.name}.a.json", f"{rule.code}-{rule.name}.b.json"], names
    else:
        assert len(inputs) == 1, f"{rule.code} needs exactly one fixture named {rule.code}-{rule.name}.<json|txt|log>"
    assert expected.exists(), f"{rule.code} needs {expected.name}"
    names = [n for n, _ in strict_json(expected.read_text())["findings"]]
    assert rule.name in names, f"{expected.name} must expect {rule.name}"


@pytest.mark.parametrize("rule", ENV_RULES, ids=lambda r: r.code)
def test_rule_fixture_gives_exactly_the_expected_findings(rule):
    inputs, expected = _fixture(rule)
    if _pair(rule):
        a, b = sorted(inputs)
        report = diff_env(str(a), str(b))
    else:
        report = diagnose_env(facts=load(str(inputs[0])))
    got = sorted([f.name, f.severity.value] for f in report.findings)
    assert got == strict_json(expected.read_text())["findings"]
    for f in report.findings:
        assert f.fix, f"{f.code} finding has no fix"
        assert f.message, f"{f.code} finding has no message"


def test_unconfirmed_facts_never_make_an_error():
    from fpdoctor.env.rules import cap_severity
    from fpdoctor.env.rules.known import finding_name
    from fpdoctor.report.model import Severity

    assert cap_severity(Severity.ERROR, "unconfirmed") is Severity.WARNING
    assert cap_severity(Severity.ERROR, "confirmed") is Severity.ERROR
    unconfirmed_crash = {"confidence": "unconfirmed", "kind": "crash"}
    assert finding_name(unconfirmed_crash, text=True, unknown=[]) == "known-issue-possible"
    assert catalog.get("known-issue-possible").severity is Severity.INFO
