"""`fpdoctor.health()`: the public function, its result, and what a machine without GPUs gets."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fpdoctor
from fpdoctor.health import HealthResult, InputError, health
from fpdoctor.health.collect import collect_live
from fpdoctor.health.findings import findings
from fpdoctor.health.report import build
from tests.conftest import FIXTURES
from tests.health.fake_nvml import FakeNVML, device

RULES = FIXTURES / "health" / "rules"
CLEAN_DMESG = [
    "[    0.000000] Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115) #45-Ubuntu SMP",
    "[    5.301122] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.159.04  Release Build",
]


def test_public_names():
    assert fpdoctor.health is health
    assert fpdoctor.HealthResult is HealthResult
    result = fpdoctor.health(from_files=str(RULES / "HWR003-ecc-uncorrectable.txt"))
    assert isinstance(result, HealthResult) and result.reporting
    assert [f.name for f in result.report.findings] == ["ecc-uncorrectable"]
    assert result.gpus[0].facts["ecc"]["volatile"]["uncorrected"] == 1


def test_fpdoctor_health_stays_callable_after_a_submodule_import():
    # importing fpdoctor.health.<x> first binds the package to `fpdoctor.health`
    code = (
        "import fpdoctor.health.kernel_log, fpdoctor\n"
        f"r = fpdoctor.health(from_files={str(RULES / 'HWR002-gpu-lost.log')!r})\n"
        "print(sorted(f.name for f in r.report.findings))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "['gpu-lost', 'gpu-lost']"


def test_the_package_and_the_function_both_answer_to_fpdoctor_health():
    # `import fpdoctor.health` (the package, as the import system gives it) and the facade's
    # function, in either order, in a fresh interpreter; the package stays a plain module
    code = (
        "import sys, types\n"
        "import fpdoctor.health\n"
        "from fpdoctor.health import HealthResult, fingerprint\n"
        "import fpdoctor.health.kernel_log\n"
        "assert type(sys.modules['fpdoctor.health']) is types.ModuleType\n"
        "assert fpdoctor.health is sys.modules['fpdoctor.health.api'].health\n"
        "assert callable(fingerprint.run_fingerprints)\n"
        f"r = fpdoctor.health(from_files={str(RULES / 'HWR002-gpu-lost.log')!r})\n"
        "assert isinstance(r, HealthResult)\n"
        "print(sorted(f.name for f in r.report.findings))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "['gpu-lost', 'gpu-lost']"


def test_import_fpdoctor_loads_the_health_package_alone():
    # the facade loads the package to keep `fpdoctor.health` the function: that must cost nothing
    code = "import fpdoctor, sys\nprint(sorted(m for m in sys.modules if m.startswith('fpdoctor.health')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "['fpdoctor.health']"


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "3", True])
def test_bad_duration(bad):
    with pytest.raises(ValueError, match="duration"):
        health(duration=bad)


def test_unusable_file_raises_input_error(tmp_path):
    empty = tmp_path / "x.log"
    empty.write_text("")
    with pytest.raises(InputError, match="is empty"):
        health(from_files=[str(empty)])
    with pytest.raises(ValueError, match="cannot be combined"):
        health(duration=1, from_files=[str(RULES / "HWR002-gpu-lost.log")])


def _live(nvml, readers):
    facts = collect_live(nvml_module=nvml, readers=readers, host="node-1")
    return build(facts, findings(facts))


def test_healthy_only_when_everything_was_read():
    report = _live(FakeNVML([device(), device(bus_id="00000000:53:00.0")]), (("dmesg", lambda: CLEAN_DMESG),))
    assert report.verdict == "ok" and report.data["status"] == "healthy"
    assert report.data["summary"][0][1].startswith("healthy: 2 GPU(s)")
    assert "not_checked" not in report.data
    rows = report.data["table"]["rows"]
    assert [r[-1] for r in rows] == ["ok", "ok"] and rows[0][:2] == ["0 H100 80GB HBM3", "52:00.0"]


def test_unreadable_kernel_log_is_incomplete_not_healthy():
    from fpdoctor.health.kernel_sources import NotReadable

    def denied():
        raise NotReadable("not readable: kernel.dmesg_restrict=1 and this process lacks CAP_SYSLOG")

    def absent():
        raise NotReadable("absent")

    report = _live(FakeNVML([device()]), (("dmesg", denied), ("/var/log/kern.log", absent)))
    assert report.verdict == "warning" and report.data["status"] == "incomplete"  # never a plain ok
    assert report.data["not_checked"]["kernel log"] == (
        "dmesg: not readable: kernel.dmesg_restrict=1 and this process lacks CAP_SYSLOG; /var/log/kern.log: absent"
    )
    assert "Not checked" in str(report) and "dmesg_restrict" in str(report)


def test_no_driver_and_no_log_is_not_checked():
    import pynvml

    from fpdoctor.health.kernel_sources import NotReadable

    def none():
        raise NotReadable("dmesg not found on PATH")

    report = _live(FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), (("dmesg", none),))
    assert report.findings == [] and report.exit_code == 0
    assert report.data["status"] == "not checked" and "NOT CHECKED" in report.data["summary"][0][1]
    assert report.data["not_checked"]["NVML"].startswith("NVML not available")


def _lead(report) -> tuple[str, str]:
    """The banner and the line the text report prints right under it."""
    banner, *rest = [line for line in str(report).splitlines() if line.strip()]
    return banner, rest[0]


def test_the_text_leads_with_not_checked_right_under_the_banner():
    import pynvml

    from fpdoctor.health.kernel_sources import NotReadable

    def none():
        raise NotReadable("dmesg not found on PATH")

    report = _live(FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND), (("dmesg", none),))
    banner, lead = _lead(report)
    assert "no findings" in banner
    assert lead.startswith("status") and "NOT CHECKED: no NVIDIA GPU seen" in lead


def test_the_text_leads_with_incomplete_in_capitals():
    from fpdoctor.health.kernel_sources import NotReadable

    def denied():
        raise NotReadable("not readable")

    report = _live(FakeNVML([device()]), (("dmesg", denied),))
    assert report.data["status"] == "incomplete"
    lead = _lead(report)[1]
    assert lead.startswith("status") and "INCOMPLETE: GPU facts show no problem" in lead


def test_problems_found_still_say_what_was_not_checked():
    report = build(*_with_findings(["[ 100.0] NVRM: Xid (PCI:0000:52:00): 48, pid=1, name=x, DBE"], nvml=None))
    assert report.data["status"] == "problems"
    assert report.data["summary"][0][1] == "problems found on 1 GPU(s): see the findings; NOT CHECKED: NVML"


def test_info_findings_alone_are_notes_not_problems():
    recovered = (
        "[ 100.0] NVRM: Xid (PCI:0000:52:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) "
        "to 0x0 (None)"
    )
    report = build(*_with_findings([*CLEAN_DMESG, recovered], nvml=FakeNVML([device()])))
    assert [f.severity.value for f in report.findings] == ["info"]
    assert report.data["status"] == "healthy"
    assert "problems" not in report.data["summary"][0][1] and report.data["summary"][0][1].endswith("; 1 note below")


def _with_findings(dmesg: list[str], *, nvml: FakeNVML | None):
    import pynvml

    fake = nvml or FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    facts = collect_live(nvml_module=fake, readers=(("dmesg", lambda: dmesg),), host="node-1")
    return facts, findings(facts)


def test_a_fact_not_read_makes_it_incomplete_and_is_listed_once_for_all_gpus():
    import pynvml

    err = pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
    report = _live(
        FakeNVML([device(remapped_rows=err), device(bus_id="00000000:53:00.0", remapped_rows=err)]),
        (("dmesg", lambda: CLEAN_DMESG),),
    )
    assert report.data["status"] == "incomplete"
    assert report.data["not_checked"] == {"remapped rows (GPU 0, 1)": "not read: Insufficient Permissions"}
    assert [r[3] for r in report.data["table"]["rows"]] == ["?", "?"]


def test_fingerprint_rows_join_the_gpu_table():
    from fpdoctor.health.fingerprint import FingerprintResult

    facts = collect_live(nvml_module=FakeNVML([device()]), readers=(("dmesg", lambda: CLEAN_DMESG),), host="n1")
    row = {
        "rank": None,
        "host": "n1",
        "device": "cuda:0",
        "index": 0,
        "pci": "00000000:52:00.0",
        "uuid": "GPU-509665ad-0000-4000-8000-000000000001",
        "name": "NVIDIA H100 80GB HBM3",
        "verdict": "ok",
    }
    other = {**row, "host": "n2", "pci": "00000000:1b:00.0", "uuid": "GPU-other", "rank": 1, "verdict": "outlier"}
    report = build(facts, findings(facts), fingerprints=FingerprintResult(rows=[row, other], notes=["compared 2"]))
    table = report.data["table"]
    assert table["columns"][-2:] == ["GEMM", "state"]
    assert [r[-2] for r in table["rows"]] == ["ok", "outlier"]
    assert table["rows"][1][0].startswith("n2 rank 1:") and table["rows"][1][2] == "-"
    assert ["note", "compared 2"] in report.data["summary"]
    assert ["note", "NVML facts and the kernel log are n1's; for n2 run `fpdoctor health --duration 0` there"] in (
        report.data["summary"]
    )


@pytest.mark.parametrize(("local_rank", "reporting"), [("0", True), ("1", False)])
def test_under_torchrun_without_fingerprints_local_rank_0_reports_its_node(monkeypatch, local_rank, reporting):
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    result = health(duration=0, nvml=FakeNVML([device()]))
    assert result.reporting is reporting and result.gpus[0].name == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("device", [None, "cuda", " CUDA "])
def test_plain_cuda_on_a_machine_without_a_driver_runs_nothing(device):
    import pynvml

    fake = FakeNVML([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    result = health(duration=1, device=device, nvml=fake)
    assert result.fingerprints.rows == []
    assert result.fingerprints.notes == [
        "no NVIDIA driver on this machine: fingerprints not run; --device cpu runs them on the CPU"
    ]


@pytest.mark.parametrize("bad", ["tpu", "cuda:x", "", 0])
def test_bad_device(bad):
    with pytest.raises(ValueError, match=r"^device must be cpu, cuda or cuda:N"):
        health(duration=1, device=bad)


def test_the_same_gpu_in_two_saved_files_is_listed_once():
    """`health -o` JSON and `nvidia-smi -q` of the same node name the same board (same UUID and bus
    id): one GPU, its facts from both, each file a source."""
    node = FIXTURES / "device" / "h100-from-fixtures"
    json_facts, smi_text = str(node / "health.json"), str(node / "nvidia-smi-q.txt")
    alone = health(from_files=[json_facts]).facts.gpus[0]
    for files in ([json_facts, smi_text], [smi_text, json_facts]):
        facts = health(from_files=files).facts
        (gpu,) = facts.gpus
        assert gpu.uuid == alone.uuid and gpu.pci == alone.pci and gpu.serial
        assert set(facts.sources) >= set(files)
    # two different boards at the same bus id on two named hosts stay two
    from fpdoctor.health.collect import _same_gpu
    from fpdoctor.health.model import GpuFacts

    assert not _same_gpu(GpuFacts(pci="0000:52:00.0", host="a"), GpuFacts(pci="0000:52:00.0", host="b"))
    assert _same_gpu(GpuFacts(pci="0000:52:00.0", host="a"), GpuFacts(pci="0000:52:00.0"))
    assert not _same_gpu(GpuFacts(pci="0000:52:00.0", uuid="GPU-1"), GpuFacts(pci="0000:52:00.0", uuid="GPU-2"))


# --- --device cpu, and one exit status for every torchrun rank ----------------------------------


def _cpu_rows(world: int, *, failed: bool = False) -> list[dict]:
    rows = []
    for rank in range(world):
        row = {"rank": rank, "host": "n1", "device": "cpu", "kind": "cpu", "name": "x86_64", "verdict": "ok"}
        if failed:
            row["failure"] = {"kind": "error", "error": "child did not start"}
        rows.append(row)
    return rows


def _facts(*, nvml_error: str, no_driver: bool):
    """Facts without GPU facts (NVML not read) and with a clean kernel log."""
    from fpdoctor.health.model import HealthFacts

    facts = HealthFacts(host="n1", not_checked={"NVML": nvml_error})
    facts.no_driver = nvml_error if no_driver else None
    facts.kernel_logs = [{"source": "dmesg", "lines": 2, "nvidia_lines": 1, "xid_lines": 0}]
    return facts


NO_DRIVER = "NVML not available: libnvidia-ml.so.1 not found (no NVIDIA driver here)"


@pytest.mark.parametrize(
    ("device_asked", "no_driver", "failed", "status"),
    [
        ("cpu", True, False, 0),  # the CPU asked for, and no GPU here whose facts could be missing
        (None, True, False, 2),  # GPUs asked for: none seen is no verdict
        ("cpu", False, False, 2),  # a driver whose NVML cannot be read: its GPUs are not checked
        ("cpu", True, True, 2),  # the CPU's own fingerprint did not run
    ],
)
def test_device_cpu_on_a_machine_without_a_driver_is_judged_by_its_fingerprints(
    device_asked, no_driver, failed, status
):
    from fpdoctor.health.fingerprint import FingerprintResult
    from fpdoctor.health.report import exit_code

    facts = _facts(nvml_error=NO_DRIVER, no_driver=no_driver)
    report = build(facts, [], fingerprints=FingerprintResult(rows=_cpu_rows(1, failed=failed)), device=device_asked)
    assert exit_code(report) == status
    if status == 0:
        assert report.data["status"] == "healthy" and "not_checked" not in report.data
        assert report.data["summary"][0][1].startswith("healthy: the CPU fingerprints show no problem; no GPU")


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_under_torchrun_every_rank_judges_the_merged_facts_and_exits_alike(monkeypatch, rank):
    """Every rank judges rank 0's facts with every rank's fingerprints: the same report and exit status,
    whatever its own facts say."""
    from fpdoctor.health import collect, fingerprint

    own = _facts(nvml_error="NVML not available: Driver/library version mismatch", no_driver=False)
    facts_of_rank_0 = _facts(nvml_error=NO_DRIVER, no_driver=True)

    def run_fingerprints(duration, *, device, share):
        share()  # this rank's own facts, read after the fingerprints; the gather brings rank 0's
        return fingerprint.FingerprintResult(
            rows=_cpu_rows(4), reporting=rank == 0, shared=[facts_of_rank_0, own, own, own]
        )

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setattr(fingerprint, "run_fingerprints", run_fingerprints)
    monkeypatch.setattr(collect, "collect_live", lambda **_: facts_of_rank_0 if rank == 0 else own)
    result = health(duration=1, device="cpu")
    assert result.facts is facts_of_rank_0 and result.reporting is (rank == 0)
    assert result.exit_code == 0 and result.report.data["status"] == "healthy"
