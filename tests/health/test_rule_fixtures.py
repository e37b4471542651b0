"""One fixture and one expected outcome per hardware rule that facts produce (like ruff's per-rule
fixtures), and text goldens of the report.

Regenerate the goldens after an intended change with:
    FPDOCTOR_REGEN_GOLDENS=1 python -m pytest tests/health/test_rule_fixtures.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import fpdoctor
from fpdoctor import catalog
from fpdoctor.health.collect import collect_live
from fpdoctor.health.findings import findings
from fpdoctor.health.report import build
from tests.conftest import FIXTURES
from tests.health.fake_nvml import FakeNVML, device

RULES = FIXTURES / "health" / "rules"
GOLDEN = FIXTURES / "health" / "golden"
# made by fpdoctor.health.fingerprint / ranks from GEMM runs, with their own tests
FROM_FINGERPRINTS = {"gemm-mismatch", "rank-outlier"}
HWR = [r for r in catalog.rules() if r.code.startswith("HWR") and r.name not in FROM_FINGERPRINTS]


def _fixture(rule: catalog.RuleInfo) -> tuple[list[Path], Path]:
    stem = f"{rule.code}-{rule.name}"
    inputs = [p for p in RULES.glob(f"{stem}.*") if not p.name.endswith(".expected.json")]
    return inputs, RULES / f"{stem}.expected.json"


def test_spec_hardware_names_exist():
    names = {r.name for r in catalog.rules()}
    assert names >= {
        "xid-error",
        "gpu-lost",
        "ecc-uncorrectable",
        "row-remap-pending",
        "row-remap-failure",
        "gpu-throttled",
        "gemm-mismatch",
        "rank-outlier",
    }


@pytest.mark.parametrize("rule", HWR, ids=lambda r: r.code)
def test_every_rule_has_a_fixture_and_an_expectation(rule):
    inputs, expected = _fixture(rule)
    assert len(inputs) == 1, f"{rule.code} needs exactly one fixture named {rule.code}-{rule.name}.<log|txt|json>"
    assert expected.exists(), f"{rule.code} needs {expected.name}"
    assert rule.name in {f["name"] for f in json.loads(expected.read_text())["findings"]}


@pytest.mark.parametrize("rule", HWR, ids=lambda r: r.code)
def test_rule_fixture_gives_exactly_the_expected_findings(rule):
    inputs, expected = _fixture(rule)
    want = json.loads(expected.read_text())
    assert want["source"], "every fixture names where its lines come from"
    result = fpdoctor.health(from_files=[str(inputs[0])])
    report = result.report
    assert report.data["status"] == want["status"]
    got = report.to_dict()["findings"]
    assert [(f["name"], f["severity"]) for f in got] == [(f["name"], f["severity"]) for f in want["findings"]]
    for g, w in zip(got, want["findings"], strict=True):
        assert g["where"] == w["where"]
        assert {k: g["evidence"].get(k) for k in w["evidence"]} == w["evidence"]
        assert g["message"] and g["fix"] and g["code"] == catalog.get(g["name"]).code
    json.loads(report.to_json())  # standard JSON


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("FPDOCTOR_REGEN_GOLDENS"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_golden_text_of_an_xid_cascade():
    report = fpdoctor.health(from_files=[str(RULES / "HWR001-xid-error.log")]).report
    _golden("HWR001-xid-error.txt", str(report))


def test_golden_text_of_a_node_with_one_bad_gpu():
    """Two H100s through the fake NVML and a dmesg with an Xid 48 on the second: the verdict first,
    one compact row per GPU."""
    dmesg = [
        "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
        "[    5.301122] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04  Release Build",
        "[ 8812.100000] NVRM: GPU at PCI:0000:53:00: GPU-509665ad-0000-4000-8000-000000000002",
        "[ 8812.100000] NVRM: GPU Board Serial Number: 1654922005678",
        "[ 8812.100001] NVRM: Xid (PCI:0000:53:00): 48, pid=4242, name=pt_main_thread, An uncorrectable double "
        "bit error (DBE) has been detected on GPU in the framebuffer at partition 6, subpartition 0.",
        "[ 8812.100002] NVRM: Xid (PCI:0000:53:00): 45, pid=4242, name=pt_main_thread, Ch 00000008",
    ]
    bad = device(
        bus_id="00000000:53:00.0",
        uuid="GPU-509665ad-0000-4000-8000-000000000002",
        serial=None,
        ecc={
            ("uncorrected", "volatile"): 1,
            ("uncorrected", "aggregate"): 1,
            ("corrected", "volatile"): 0,
            ("corrected", "aggregate"): 0,
        },
        remapped_rows=(0, 1, 1, 0),
        temperature=61,
        clock_reasons=0x4,
    )
    fake = FakeNVML([device(), bad])
    facts = collect_live(nvml_module=fake, readers=(("dmesg", lambda: dmesg),), host="node-17")
    report = build(facts, findings(facts))
    assert report.data["status"] == "problems" and report.exit_code == 1
    names = [(f.name, f.severity.value, f.where.get("index")) for f in report.sorted_findings()]
    assert names == [
        ("xid-error", "error", 1),
        ("xid-error", "error", 1),
        ("ecc-uncorrectable", "error", 1),
        ("row-remap-pending", "error", 1),
    ]
    _golden("node_one_bad_gpu.txt", str(report))
