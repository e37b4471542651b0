"""What a GPU machine showed, read back without one: `make gpu-check` (benchmarks/gpu_check.py)
writes the machine's env facts, health's NVML facts, `nvidia-smi -q` and the kernel log's NVIDIA
lines to $OUT/gpu-check/fixtures/; committed as tests/fixtures/device/NAME/, each folder is read
here by env's and health's `--from` parsers, so what was seen once on a real device stays tested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import FIXTURES

DEVICE = FIXTURES / "device"
# the files a recording may hold, each in the format its reader takes (`env --from`, `health --from`)
ENV_FACTS, HEALTH, SMI, KERNEL_LOG = "env-facts.json", "health.json", "nvidia-smi-q.txt", "kernel.log"
RECORDED = (ENV_FACTS, HEALTH, SMI, KERNEL_LOG)
FOLDERS = sorted(p for p in DEVICE.iterdir() if p.is_dir())


def _recorded(folder: Path, name: str) -> Path:
    path = folder / name
    if not path.exists():
        pytest.skip(f"{folder.name} has no {name} (that part of the check did not write one)")
    return path


def _json(cli, *args: str) -> dict:
    """The report of `fpdoctor ARGS --format json`: exit 0, or 1 for an error-level finding about
    that machine (a result); health also 2 for a verdict one file alone cannot give. A refused
    file exits 2 too, with a line on stderr and no report."""
    result = cli(*args, "--format", "json")
    assert result.code in ((0, 1, 2) if args[0] == "health" else (0, 1)), result.err
    assert result.err == "" and result.out
    return dict(json.loads(result.out))


def test_there_is_a_recording_and_each_holds_only_what_the_check_writes():
    assert FOLDERS, f"{DEVICE} holds no recorded device folder"
    for folder in FOLDERS:
        names = {p.name for p in folder.iterdir()}
        assert names and names <= set(RECORDED), f"{folder.name}: {sorted(names - set(RECORDED))}"


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_env_reads_the_recorded_facts(cli, folder):
    doc = _json(cli, "env", "--from", str(_recorded(folder, ENV_FACTS)))
    facts = doc["data"]["facts"]
    assert facts["gpus"] and all(g.get("name") for g in facts["gpus"])
    assert facts["driver"].get("version")
    torch = facts["torch"]
    if torch.get("import") == "ok" and torch.get("cuda"):  # a CUDA build names the architectures it carries
        assert torch["arch_list"] and all(a.startswith(("sm_", "compute_")) for a in torch["arch_list"])
    assert all(lib.get("library") and lib.get("path") for lib in facts["libraries"].get("loaded") or [])


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_health_reads_the_recorded_nvml_facts(cli, folder):
    facts = _json(cli, "health", "--from", str(_recorded(folder, HEALTH)))["data"]["facts"]
    assert facts["gpus"] and facts["driver"]
    assert all(g.get("name") and g.get("uuid") and g.get("source") == "nvml" for g in facts["gpus"])
    if (folder / ENV_FACTS).exists():  # env and health on one machine saw the same GPUs
        env = json.loads((folder / ENV_FACTS).read_text())
        assert sorted(g["name"] for g in facts["gpus"]) == sorted(g["name"] for g in env["gpus"])


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_health_reads_the_recorded_nvidia_smi(cli, folder):
    path = _recorded(folder, SMI)
    facts = _json(cli, "health", "--from", str(path))["data"]["facts"]
    assert facts["sources"][str(path)].startswith("nvidia-smi -q: ")
    assert facts["gpus"] and all(g.get("pci") and g.get("name") for g in facts["gpus"])


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_health_reads_the_recorded_kernel_log(cli, folder):
    facts = _json(cli, "health", "--from", str(_recorded(folder, KERNEL_LOG)))["data"]["facts"]
    (log,) = facts["kernel_logs"]
    assert log["nvidia_lines"] > 0  # the recorder writes the file only when the log holds NVIDIA lines


@pytest.mark.parametrize("folder", FOLDERS, ids=[p.name for p in FOLDERS])
def test_health_joins_every_recorded_file_of_one_machine(cli, folder):
    paths = [folder / name for name in (HEALTH, SMI, KERNEL_LOG) if (folder / name).exists()]
    if not paths:
        pytest.skip(f"{folder.name} holds nothing health reads")
    facts = _json(cli, "health", *[arg for p in paths for arg in ("--from", str(p))])["data"]["facts"]
    assert set(facts["sources"]) >= {str(p) for p in paths}
    if (folder / HEALTH).exists():  # the GPUs the other files name are NVML's GPUs
        nvml = json.loads((folder / HEALTH).read_text())["data"]["facts"]["gpus"]
        assert {g.get("uuid") for g in facts["gpus"] if g.get("uuid")} == {g["uuid"] for g in nvml}
