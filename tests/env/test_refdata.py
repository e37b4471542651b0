"""The shipped reference data: corrected facts, and nothing but citations reaching a report."""

from __future__ import annotations

import csv
import json
from importlib import resources
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from fpdoctor.env.doctor import diagnose_env
from fpdoctor.env.refdata import refdata
from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

SHARED = Path("/work/shared/data")
DATA = resources.files("fpdoctor.data")
# Words of research notes that must never reach a user: where a fact was read, not what it is.
INTERNAL = ("index id", "copy id", "search index", "indexed", "review note", "not visible", "NOT visible")


def _csv(name: str) -> list[dict[str, str]]:
    with DATA.joinpath(name).open(encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _arch(torch: str, variant: str, platform: str = "linux-x86_64") -> dict[str, str]:
    (row,) = [
        r
        for r in _csv("torch_cuda_arch.csv")
        if (r["torch_version"], r["cuda_variant"], r["platform"]) == (torch, variant, platform)
    ]
    return row


def test_torch_2_10_cu128_wheels_include_volta():
    row = _arch("2.10", "cu128")
    assert row["sass_targets"].split()[0] == "sm_70" and row["confidence"] == "confirmed"
    assert "182250" in row["source"]
    assert _arch("2.11", "cu128")["sass_targets"].split()[0] == "sm_75"  # Volta leaves cu128 in 2.11


def test_volta_on_torch_2_10_cu128_is_covered():
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV004-arch-not-in-build.json").read_text())
    facts["gpus"] = [{"index": 0, "name": "Tesla V100-SXM2-32GB", "compute_capability": "7.0"}]
    facts["torch"].update(version="2.10.0+cu128", cuda="12.8", arch_list=None, warnings=[])
    assert "arch-not-in-build" not in {f.name for f in diagnose_env(facts=facts).findings}
    facts["torch"].update(version="2.11.0+cu128")
    finding = {f.name: f for f in diagnose_env(facts=facts).findings}["arch-not-in-build"]
    assert "cu126" in finding.fix


def test_volta_fix_text_names_2_7_and_2_11():
    issue = refdata().known_issue("ARCH_NOT_IN_TORCH_BUILD")
    text = "\n".join(issue["fix"])
    assert "Volta on 2.7 and 2.11+" in text and "2.10+" not in text


@pytest.mark.parametrize(
    ("torch", "variant"),
    [("2.11", "cu130"), ("2.12", "cu130"), ("2.12", "cu132"), ("2.14", "cu130"), ("2.14", "cu132")],
)
def test_release_wheels_ship_without_ptx(torch, variant):
    row = _arch(torch, variant)
    assert row["ptx_target"] == "" and "+PTX" not in row["torch_cuda_arch_list"]


def test_ptx_only_matters_where_the_table_says_so():
    ref = refdata()
    assert ref.arch_row(Version("2.11.0"), "cu130").ptx is None
    assert ref.arch_row(Version("2.7.1"), "cu128").ptx == 120  # a 2.7.1+cu128 wheel lists compute_120


def test_torch_2_8_pins_nccl_2_27_3():
    ref = refdata()
    assert ref.bundled_nccl(Version("2.8.0"), "cu128") == Version("2.27.3")
    assert ref.bundled_nccl(Version("2.9.1"), "cu128") == Version("2.27.5")


@pytest.mark.parametrize("toolkit", ["10.1.105", "10.1.168", "10.1.243"])
def test_cuda_10_1_and_its_updates_share_one_driver_floor(toolkit):
    (row,) = [r for r in _csv("cuda_driver_min.csv") if r["cuda_version"] == toolkit]
    assert row["linux_x86_64_min_driver"] == "418.39"


def test_torch_2_4_0_cu124_pins_a_cublas_below_the_h20_fix():
    pinned, _ = refdata().bundled_cublas(Version("2.4.0"), "cu124")
    assert pinned == Version("12.4.2.65") < Version("12.4.5.8")
    fix = "\n".join(refdata().known_issue("H20_CUBLAS_SIGFPE")["fix"])
    assert "torch >= 2.4 cu124" not in fix


def test_h20_on_torch_2_4_0_cu124_is_still_exposed():
    """torch 2.4.0+cu124 is not a fix: its pin (12.4.2.65) is below the first reported fix."""
    facts = strict_json((ENV_FIXTURES / "rules" / "ENV101-cublas-h20-sigfpe.json").read_text())
    facts["torch"].update(version="2.4.0+cu124", cuda="12.4")
    facts["libraries"] = {"wheels": [], "copies": [], "loaded": None}
    finding = {f.name: f for f in diagnose_env(facts=facts).findings}["cublas-h20-sigfpe"]
    assert finding.evidence["cublas"].startswith("12.4.2.65 (inferred from torch 2.4.0+cu124's pin")
    assert "users independently report" in finding.message and "NVIDIA has not stated" in finding.message


def test_data_sources_shown_to_users_are_citations():
    from fpdoctor.env.citations import cite, references

    sources = []
    for name in (
        "torch_cuda_arch.csv",
        "cuda_driver_min.csv",
        "torch_bundled_cuda_libs.csv",
        "gpu_compute_capability.csv",
    ):
        sources += [r["source"] for r in _csv(name)]
    for issue in refdata().known_issues:
        sources += [str(s) for s in issue.get("sources") or []]
    for source in sources:
        text = cite(source)
        assert text and not any(w in text for w in INTERNAL), (source, text)
        for url in references([source]):
            assert url.startswith("https://") and " " not in url and not any(w in url for w in INTERNAL), url


def test_references_are_urls_only():
    from fpdoctor.env.citations import references

    got = references(
        [
            "https://github.com/pytorch/torchtitan/issues/865 (Float8 rowwise NaN at 256 GPUs; a long note)",
            "NVIDIA/nccl#1116 and NCCL 2.19.3 release notes, as cited in NVIDIA/TensorRT-LLM#17006 review thread",
            "stepfun-ai/Step-Video-T2V commits 08d27b2, bacc800 (setup.py)",
            "cuda_driver_min.csv (NVIDIA CUDA release notes tables 2 and 3)",
            "pytorch/pytorch#157517 and #158301 (sm_50/sm_60 removed)",
        ]
    )
    assert got == [
        "https://github.com/pytorch/torchtitan/issues/865",
        "https://github.com/NVIDIA/nccl/issues/1116",
        "https://github.com/NVIDIA/TensorRT-LLM/issues/17006",
        "https://github.com/stepfun-ai/Step-Video-T2V/commit/08d27b2",
        "https://github.com/stepfun-ai/Step-Video-T2V/commit/bacc800",
        "https://github.com/pytorch/pytorch/issues/157517",
        "https://github.com/pytorch/pytorch/issues/158301",
    ]


def _all_inputs() -> list[Path]:
    return sorted(
        p for p in ENV_FIXTURES.rglob("*") if p.suffix in (".txt", ".log", ".json") and ".expected." not in p.name
    )


@pytest.mark.parametrize("path", _all_inputs(), ids=lambda p: p.name)
def test_no_research_note_reaches_a_report(path, cli):
    for fmt in ("text", "json"):
        result = cli("env", "--from", str(path), "--format", fmt)
        assert result.code in (0, 1), result.err
        if fmt == "json":
            doc = strict_json(result.out)
            shown = json.dumps([doc["findings"], doc["data"]["summary"], doc["data"]["not_checked"]])
        else:
            shown = result.out
        assert not any(w in shown for w in INTERNAL), [w for w in INTERNAL if w in shown]


def test_the_curated_copy_of_known_issues_is_in_line():
    """The package copy follows the curated set, except the corrections fpdoctor made on top
    (documented in data/ORIGIN.md)."""
    if not (SHARED / "known_issues.yaml").exists():
        pytest.skip("the curated reference set is not on this machine")
    shared = {i["id"]: i for i in yaml.safe_load((SHARED / "known_issues.yaml").read_text())}
    ours = {i["id"]: i for i in refdata().known_issues}
    assert set(shared) == set(ours)
    corrected = {"H20_CUBLAS_SIGFPE", "ARCH_NOT_IN_TORCH_BUILD"}
    for issue_id in set(shared) - corrected:
        assert shared[issue_id] == ours[issue_id], issue_id
    silent = ours["SILENT_BAD_GPU_NAN_AT_SCALE"]
    assert not any("NOT visible" in str(s) for s in silent["sources"])
