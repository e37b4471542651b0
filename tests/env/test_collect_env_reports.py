"""Real collect_env reports from public issue threads, diagnosed with the cause the thread confirmed."""

from __future__ import annotations

import pytest
import yaml

from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

REPORTS = ENV_FIXTURES / "collect_env"
EXPECTED = yaml.safe_load((REPORTS / "expected.yaml").read_text())


def test_every_report_has_an_expectation_and_a_source():
    files = {p.name for p in REPORTS.glob("*.txt")}
    assert files == set(EXPECTED)
    sources = (REPORTS / "SOURCES.md").read_text()
    for name in files:
        assert f"`{name}`" in sources, f"{name} has no issue reference in SOURCES.md"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_report_is_diagnosed(name, cli):
    case = EXPECTED[name]
    result = cli("env", "--from", str(REPORTS / name), "--format", "json")
    doc = strict_json(result.out)
    assert doc["verdict"] == case["verdict"], case["cause"]
    assert result.code == (1 if case["verdict"] == "error" else 0)
    got = {}
    for f in doc["findings"]:
        got.setdefault(f["name"], f["severity"])
    for finding, severity in (case.get("expect") or {}).items():
        assert got.get(finding) == severity, f"{name}: expected {finding} ({severity}), got {got}"
    for finding in case.get("absent", []):
        assert finding not in got, f"{name}: unexpected {finding}"
    fixes = "\n".join(f["fix"] for f in doc["findings"])
    for text in case.get("fix_contains", []):
        assert text in fixes, f"{name}: fix lacks {text!r}"


def test_facts_read_from_the_long_format():
    from fpdoctor.env.parse import parse_text

    facts = parse_text((REPORTS / "h20_cu121_pytorch133548.txt").read_text())
    assert facts["origin"] == {"kind": "collect_env", "format": "pytorch-long"}
    assert facts["torch"]["version"] == "2.3.0+cu121" and facts["torch"]["cuda"] == "12.1"
    assert [g["name"] for g in facts["gpus"]] == ["NVIDIA H20"] * 8
    assert facts["driver"]["version"] == "560.28.03"
    assert facts["torch"]["cuda_available"] is True
    assert "torch arch list (judged from fpdoctor's table of official wheels)" in facts["missing"]


def test_vllm_sectioned_format():
    from fpdoctor.env.parse import parse_text

    facts = parse_text((REPORTS / "healthy_rtx5090_cu128_vllm21745.txt").read_text())
    assert facts["origin"]["format"] == "vllm"
    assert facts["torch"]["version"] == "2.7.1+cu128"
    assert facts["gpus"][0]["name"] == "NVIDIA GeForce RTX 5090"
    assert facts["driver"]["version"] == "575.64.03"


def test_old_short_format_and_pip_lines():
    from fpdoctor.env.parse import parse_text

    facts = parse_text((REPORTS / "old_short_titanv_pytorch9465.txt").read_text())
    assert facts["origin"]["format"] == "pytorch-short"
    assert facts["torch"]["debug"] is False and facts["torch"]["cuda_available"] is True
    assert facts["numpy"] == {"version": "1.14.5"}
    assert facts["torch_installs"]["installs"][0]["version"] == "0.4.0a0+3749c58"
    assert [c["version"] for c in facts["libraries"]["copies"]] == ["7.1.4", "7.1.4"]


def test_quoted_paste():
    from fpdoctor.env.parse import parse_text

    facts = parse_text((REPORTS / "quoted_titanrtx_pytorch40682.txt").read_text())
    assert facts["os"]["system"] == "Windows"
    assert len(facts["gpus"]) == 2 and facts["driver"]["version"] == "442.92"


def test_torch_warning_around_the_report_supplies_the_arch_list():
    from fpdoctor.env.parse import parse_text

    facts = parse_text((REPORTS / "a100_cu102_pytorch57922.txt").read_text())
    assert facts["torch"]["arch_list"][-1] == "compute_37"
    assert facts["gpus"][0]["compute_capability"] == "8.0"


@pytest.mark.parametrize(
    ("log", "finding", "severity"),
    [
        ("sigfpe_linear_streamvln70.log", "cublas-h20-sigfpe", "warning"),
        ("driver_found11000_yuan2_65.log", "driver-too-old", "error"),
        ("driver_found11040_gptsovits83.log", "driver-too-old", "error"),
    ],
)
def test_error_logs(log, finding, severity, cli):
    result = cli("env", "--from", str(ENV_FIXTURES / "logs" / log), "--format", "json")
    doc = strict_json(result.out)
    assert [(f["name"], f["severity"]) for f in doc["findings"]] == [(finding, severity)]
