from __future__ import annotations

import re

import pytest

from fpdoctor import catalog
from fpdoctor.report.model import Severity

# Environment finding names that must exist (the README and users name them).
REQUIRED_ENV = {
    "driver-too-old",
    "arch-not-in-build",
    "cpu-only-build",
    "duplicate-torch-install",
    "cublas-h20-sigfpe",
    "duplicate-cuda-library",
    "library-shadowed",
    "numpy-abi-mismatch",
    "torch-import-failed",
    "probe-crashed",
}


# The numerics, dtype and training names.
REQUIRED_NUMERICS = {
    "nonfinite-produced",
    "nonfinite-input",
    "overflow-risk",
    "underflow-risk",
    "precision-divergence",
    "fp8-saturation",
    "mixed-dtype-parameters",
    "dtype-mismatch",
    "device-mismatch",
    "nonfinite-loss",
    "nonfinite-gradient",
    "loss-spike",
    "transient-fault-suspected",
    "deterministic-nonfinite",
}


# The hardware and crash names.
REQUIRED_HARDWARE_AND_CRASH = {
    "xid-error",
    "gpu-lost",
    "ecc-uncorrectable",
    "row-remap-pending",
    "row-remap-failure",
    "gpu-throttled",
    "gemm-mismatch",
    "rank-outlier",
    "fatal-signal",
}


def test_required_names_exist():
    names = {r.name for r in catalog.rules()}
    assert names >= REQUIRED_ENV | REQUIRED_NUMERICS | REQUIRED_HARDWARE_AND_CRASH


def test_codes_and_names_are_unique_and_well_formed():
    rules = catalog.rules()
    assert len({r.code for r in rules}) == len(rules)
    assert len({r.name for r in rules}) == len(rules)
    for r in rules:
        assert re.fullmatch(r"[A-Z]{3}\d{3}", r.code)
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", r.name)
        assert r.title and r.what and r.why and r.fix, r.code
        assert isinstance(r.severity, Severity)


def test_lookup_by_code_or_name():
    assert catalog.get("ENV101").name == "cublas-h20-sigfpe"
    assert catalog.get("env101").code == "ENV101"
    assert catalog.get("cublas-h20-sigfpe").code == "ENV101"
    with pytest.raises(catalog.UnknownRuleError):
        catalog.get("ENV999")


def test_make_fills_from_the_catalogue():
    f = catalog.make("driver-too-old", message="m", references=["https://x"])
    assert (f.code, f.severity, f.title) == ("ENV003", Severity.ERROR, catalog.get("ENV003").title)
    assert f.references[0] == "https://x" and len(f.references) == len(set(f.references))


def test_rule_validation():
    with pytest.raises(ValueError):
        catalog.RuleInfo(code="E1", name="x", severity=Severity.ERROR, title="t", what="w", why="y", fix="f")
    with pytest.raises(ValueError):
        catalog.RuleInfo(code="ENV900", name="Bad Name", severity=Severity.ERROR, title="t", what="w", why="y", fix="f")
