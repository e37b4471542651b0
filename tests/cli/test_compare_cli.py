"""`fpdoctor compare` and `fpdoctor plan` through the CLI: device A vs device B, usage errors."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import run_fpdoctor
from tests.precision.factories import loads_strict

MODEL = (
    "import torch\n"
    "def make():\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))\n"
    "    return model, torch.randn(16, 64)\n"
)


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "mlp.py"
    path.write_text(MODEL)
    return f"{path}:make"


def test_device_candidate_end_to_end(spec):
    result = run_fpdoctor("compare", spec, "--candidate", "fp32", "--device", "cpu", "--format", "json")
    assert result.code == 0, result.err
    doc = loads_strict(result.out)
    summary = dict(doc["data"]["summary"])
    assert summary["candidate / floor model"].startswith("fp32 on cpu / fp32")
    leaves = [m for m in doc["data"]["modules"] if m["leaf"]]
    assert len(leaves) == 3 and all(m["ratio"] <= 2 for m in leaves)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_unavailable_device_is_a_usage_error(spec, cli):
    result = cli("compare", spec, "--candidate", "fp32", "--device", "cuda")
    assert result.code == 2 and "'cuda' is not available" in result.err and len(result.err.strip().splitlines()) == 1


def test_unknown_device_and_fp32_plan_are_usage_errors(spec, cli):
    result = cli("compare", spec, "--candidate", "fp16", "--device", "gpu0")
    assert result.code == 2 and "unknown device 'gpu0'" in result.err
    result = cli("plan", spec, "--candidate", "fp32")
    assert result.code == 2 and "candidate 'fp32' cannot be used: plan keeps modules in fp32" in result.err


def test_fp8_kernel_option(spec, cli):
    result = run_fpdoctor("compare", spec, "--candidate", "fp8-e4m3", "--fp8-kernel", "scaled_mm", "--format", "json")
    assert result.code == 0, result.err
    doc = loads_strict(result.out)
    assert doc["data"]["fp8_kernel"]["scaled_mm"] == 2
    result = cli("compare", spec, "--candidate", "fp8-e4m3", "--fp8-kernel", "cublas")
    assert result.code == 2 and "unknown fp8 kernel 'cublas'" in result.err
    result = cli("plan", spec, "--candidate", "fp8-e4m3", "--fp8-kernel", "cublas")
    assert result.code == 2 and "unknown fp8 kernel 'cublas'" in result.err


def test_compiled_candidate(spec, cli):
    result = run_fpdoctor("compare", spec, "--candidate", "compiled", "--format", "json")
    assert result.code == 0, result.err
    doc = loads_strict(result.out)
    assert doc["findings"] == [] and [j["module"] for j in doc["data"]["compiled"]] == ["<root>"]
    assert dict(doc["data"]["summary"])["first departing module"] == "none"
    result = cli("compare", spec, "--candidate", "compiled-bf61")
    assert result.code == 2 and "did you mean compiled-bf16?" in result.err
    assert len(result.err.strip().splitlines()) == 1
    result = cli("compare", spec, "--candidate", "compiled", "--module", "0")
    assert result.code == 2 and "takes no module" in result.err and len(result.err.strip().splitlines()) == 1
