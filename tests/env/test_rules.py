"""Rule behaviour at the edges that the per-rule fixtures do not cover."""

from __future__ import annotations

import copy

import pytest

from fpdoctor.env.doctor import diagnose_env
from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json


@pytest.fixture
def h20_facts():
    return strict_json((ENV_FIXTURES / "rules" / "ENV101-cublas-h20-sigfpe.json").read_text())


def _names(facts):
    return {f.name: f for f in diagnose_env(facts=copy.deepcopy(facts)).findings}


def test_h200_is_not_h20(h20_facts):
    for gpu in h20_facts["gpus"]:
        gpu["name"] = "NVIDIA H200"
    assert "cublas-h20-sigfpe" not in _names(h20_facts)


def test_h20_with_fixed_cublas_is_fine(h20_facts):
    for item in h20_facts["libraries"]["loaded"] + h20_facts["libraries"]["copies"] + h20_facts["libraries"]["wheels"]:
        item["version"] = "12.4.5.8"
    assert "cublas-h20-sigfpe" not in _names(h20_facts)


def test_h20_with_conflicting_cublas_12_3_only_warns(h20_facts):
    for item in h20_facts["libraries"]["loaded"]:
        item["version"] = "12.3.4.1"
    assert _names(h20_facts)["cublas-h20-sigfpe"].severity.value == "warning"


def test_h20_on_a_cuda_11_build_is_the_reported_workaround(h20_facts):
    h20_facts["torch"].update(version="2.3.1+cu118", cuda="11.8")
    h20_facts["libraries"] = {"wheels": [], "copies": [], "loaded": []}
    assert "cublas-h20-sigfpe" not in _names(h20_facts)


def test_h20_without_library_facts_infers_from_the_build(h20_facts):
    h20_facts["torch"].update(version="2.2.0+cu121")  # not in the pinned-cuBLAS table
    h20_facts["libraries"] = {"wheels": [], "copies": [], "loaded": None}
    finding = _names(h20_facts)["cublas-h20-sigfpe"]
    assert "inferred from the CUDA 12.1 build" in finding.evidence["cublas"]


def test_ptx_only_coverage_is_a_warning():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV004-arch-not-in-build.json").read_text())
    facts["torch"].update(
        version="2.7.0+cu128", cuda="12.8", arch_list=["sm_75", "sm_80", "sm_86", "sm_90", "compute_90"]
    )
    facts["torch"]["warnings"] = []
    finding = _names(facts)["arch-not-in-build"]
    assert finding.severity.value == "warning" and "PTX JIT" in finding.message


def test_sass_of_the_same_major_covers_newer_minors():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV004-arch-not-in-build.json").read_text())
    facts["gpus"][0].update(name="NVIDIA GeForce RTX 4090", compute_capability="8.9")
    facts["torch"]["warnings"] = []
    assert "arch-not-in-build" not in _names(facts)  # sm_86 SASS runs on sm_89


def test_driver_below_the_exact_toolkit_but_above_the_family_floor_is_a_note():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV002-cpu-only-build.json").read_text())
    facts["torch"].update(version="2.5.1+cu124", cuda="12.4", cuda_available=True)
    facts["driver"]["version"] = "535.104.05"  # CUDA 12.4 shipped with 550.54.14
    finding = _names(facts)["driver-too-old"]
    assert finding.severity.value == "info"


def test_healthy_live_facts_give_no_findings():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV201-probe-crashed.json").read_text())
    facts["probes"] = []
    assert _names(facts) == {}


def test_an_import_failure_names_its_known_cause_once():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV001-torch-import-failed.json").read_text())
    facts["torch"]["error"] = (
        "ImportError: /x/libcusparse.so.12: undefined symbol: __nvJitLink_12_4, version libnvJitLink.so.12"
    )
    findings = diagnose_env(facts=facts).findings
    assert [f.name for f in findings] == ["torch-import-failed"]
    assert findings[0].evidence["known_issue"] == "NVJITLINK_SYMBOL_MISMATCH"


def test_a_failing_rule_is_reported_not_raised(monkeypatch):
    from fpdoctor.env import rules

    def broken(ctx):
        raise RuntimeError("boom")

    monkeypatch.setattr(rules, "all_rules", lambda: [broken])
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV201-probe-crashed.json").read_text())
    report = diagnose_env(facts=facts)
    assert report.findings == []
    assert "boom" in report.data["not_checked"]["rule broken"]


def test_the_callers_facts_are_read_not_changed():
    """diagnose_env(facts=...) works on its own copy: probe results, texts and the reasons a rule
    was not checked do not land in the caller's dict, so the same facts diagnose the same twice."""
    from fpdoctor.env import rules

    def broken(ctx):
        raise RuntimeError("boom")

    facts = strict_json((ENV_FIXTURES / "rules" / "ENV201-probe-crashed.json").read_text())
    facts.pop("probes", None)
    before = copy.deepcopy(facts)
    spec = {"name": "raises", "dtype": "fp32", "shape": [-1, 4, 4], "device": "cpu"}  # a negative dimension
    first = diagnose_env(facts=facts, probe=True, probe_specs=[spec])
    assert facts == before
    assert "probe raises" in first.data["not_checked"]
    with pytest.MonkeyPatch.context() as mp:
        every = rules.all_rules()
        mp.setattr(rules, "all_rules", lambda: [*every, broken])
        diagnose_env(facts=facts)
    assert facts == before
    again = diagnose_env(facts=facts, probe=True, probe_specs=[spec])
    assert again.to_dict() == first.to_dict()


def _judged_inputs():
    """Every facts file and text the env tests read, and the facts of the three rules that say
    what they could not judge (a Windows CUDA 13 driver, a build missing from the arch table, a CUDA
    without a driver floor)."""
    from fpdoctor.env.parse import load

    paths = sorted(p for p in ENV_FIXTURES.rglob("*") if p.suffix in (".txt", ".log", ".json"))
    cases = {p.name: load(str(p)) for p in paths if ".expected." not in p.name}
    h100 = strict_json((ENV_FIXTURES / "facts" / "h100_cu130_single_gpu_live.json").read_text())
    cases["windows cuda 13"] = {**copy.deepcopy(h100), "os": {"system": "Windows", "distro": "Windows 11"}}
    unknown_build = copy.deepcopy(h100)
    unknown_build["torch"].update(version="2.15.0+cu130", arch_list=None)
    cases["build missing from the arch table"] = unknown_build
    no_floor = copy.deepcopy(h100)
    no_floor["torch"].update(version="2.15.0+cu140", cuda="14.0")
    cases["cuda without a driver floor"] = no_floor
    return cases


def test_the_rules_read_the_facts_and_never_write_them(monkeypatch):
    """What a rule could not judge comes back beside its findings; the facts stay as they came,
    a failing rule included."""
    from fpdoctor.env import rules
    from fpdoctor.env.facts import Facts

    def broken(ctx):
        raise RuntimeError("boom")

    every = rules.all_rules()
    monkeypatch.setattr(rules, "all_rules", lambda: [*every, broken])
    said: dict[str, str] = {}
    for name, raw in _judged_inputs().items():
        before = copy.deepcopy(raw)
        judged = rules.evaluate(Facts(raw))
        assert raw == before, name
        assert "boom" in judged.not_checked["rule broken"], name
        said.update(judged.not_checked)
    assert {"driver floor for CUDA 13.x on Windows", "GPU architecture coverage", "driver floor for CUDA 14.0"} <= set(
        said
    )
