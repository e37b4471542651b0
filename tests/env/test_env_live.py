"""`fpdoctor env` on this machine, end to end through the CLI."""

from __future__ import annotations

import pytest

from tests.conftest import run_fpdoctor
from tests.env.strict import strict_json

SECRETS = {
    "HF_TOKEN": "hf_plantedSecretValue0123456789",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYplantedKEY",
    "WANDB_API_KEY": "0123456789abcdefplantedwandbkey0123456789",
    "PIP_EXTRA_INDEX_URL": "https://deploy:Planted-Pa55word@pypi.internal.example/simple",
    "NCCL_SOCKET_IFNAME": "eth0",
}
SECRET_VALUES = [
    "hf_plantedSecretValue0123456789",
    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYplantedKEY",
    "0123456789abcdefplantedwandbkey0123456789",
    "Planted-Pa55word",
    "deploy:",
]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def live_json():
    result = run_fpdoctor("env", "--format", "json", env=SECRETS)
    return result, strict_json(result.out)


def test_live_run_on_this_machine(live_json):
    import torch

    result, doc = live_json
    # The exit status follows the verdict: a GPU machine may well have error-level findings (an old
    # driver, a probe that fails on a faulty GPU), which is the doctor working, not failing.
    assert result.code == (1 if doc["verdict"] == "error" else 0), doc["findings"]
    facts = doc["data"]["facts"]
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["import"] == "ok"
    if facts["torch"]["stage"] == "done":  # the check's own child got through CUDA start-up, as this process did
        assert facts["torch"]["cuda_available"] == torch.cuda.is_available()
    not_checked = doc["data"]["not_checked"]
    if facts["gpus"]:  # found by the first source that works, each named
        assert all(g["name"] and g["source"] in ("nvml", "nvidia-smi") for g in facts["gpus"]), facts["gpus"]
    else:  # no driver: each GPU source says why it was not checked instead of failing
        assert "gpus (nvml)" in not_checked and "gpus (nvidia-smi)" in not_checked
    # probes run by default where torch (in the check's child) sees a GPU, and only there
    assert bool(facts["probes"]) == bool(facts["torch"].get("cuda_available"))
    assert facts["env"]["NCCL_SOCKET_IFNAME"] == "eth0"


def test_live_run_on_a_machine_without_gpus_is_clean(live_json):
    """This environment on a CPU machine: nothing to warn about, nothing probed."""
    result, doc = live_json
    if doc["data"]["facts"]["gpus"]:
        pytest.skip("this machine has NVIDIA GPUs: their findings depend on the machine")
    assert result.code == 0 and doc["verdict"] == "ok", doc["findings"]
    assert doc["data"]["facts"]["probes"] == []


def test_secrets_never_leave_in_any_format(tmp_path, live_json):
    outputs = [live_json[0].out]
    for fmt in ("text", "markdown", "html"):
        outputs.append(run_fpdoctor("env", "--no-probe", "--format", fmt, env=SECRETS).out)
    facts_file = tmp_path / "facts.json"
    run_fpdoctor("env", "--save-facts", str(facts_file), "-o", str(tmp_path / "r.txt"), env=SECRETS)
    outputs.append(facts_file.read_text())
    log = tmp_path / "train.log"
    log.write_text(
        "torch 2.3.1+cu121\n"
        + "\n".join(f"{k}={v}" for k, v in SECRETS.items())
        + "\nFatal Python error: Floating point exception\n"
    )
    for fmt in ("text", "json", "markdown", "html"):
        outputs.append(run_fpdoctor("env", "--from", str(log), "--format", fmt).out)
    for out in outputs:
        assert out
        for secret in SECRET_VALUES:
            assert secret not in out


def test_saved_facts_diagnose_the_same(tmp_path):
    facts_file = tmp_path / "facts.json"
    first = run_fpdoctor("env", "--save-facts", str(facts_file), "--format", "json")
    again = run_fpdoctor("env", "--from", str(facts_file), "--format", "json")
    a, b = strict_json(first.out), strict_json(again.out)
    assert again.code == first.code
    assert [f["code"] for f in a["findings"]] == [f["code"] for f in b["findings"]]
    assert b["data"]["facts"]["origin"]["collected_as"] == "live"


@pytest.mark.skipif(_cuda(), reason="with a GPU the probes run on it (test_gpu_probes_when_asked)")
def test_cpu_probes_when_asked(cli):
    result = cli("env", "--probe", "--format", "json")
    doc = strict_json(result.out)
    probes = doc["data"]["facts"]["probes"]
    assert [p["dtype"] for p in probes] == ["fp32", "bf16", "fp16"]
    assert all(p["status"] == "ok" for p in probes) and result.code == 0


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_gpu_probes_when_asked(cli):
    result = cli("env", "--probe", "--format", "json")
    doc = strict_json(result.out)
    probes = doc["data"]["facts"]["probes"]
    assert [p["dtype"] for p in probes][:4] == ["fp32", "tf32", "bf16", "fp16"]
    assert {"h20-linear-bf16", "h20-gemm-fp16"} <= {p["name"] for p in probes}
    # each probe has an outcome; a failing one is a finding (a faulty GPU is what they are for)
    assert all(p["device"] == "cuda" and p["status"] in ("ok", "wrong", "crashed", "timeout", "error") for p in probes)
    assert result.code == (1 if doc["verdict"] == "error" else 0)


def test_output_file_is_written(tmp_path, cli):
    out = tmp_path / "report.md"
    result = cli("env", "--from", str(tmp_path / ".." / tmp_path.name / "x"), "-o", str(out))
    assert result.code == 2  # missing input: nothing written
    assert not out.exists()
