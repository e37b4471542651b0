"""`fpdoctor health`: exit codes, formats, --from inputs, bad input (exit 2, one line), no torch."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from tests.conftest import FIXTURES, run_fpdoctor

HEALTH = FIXTURES / "health"
RULES = HEALTH / "rules"
STATUSES = {"healthy", "problems", "incomplete", "not checked"}


def test_live_facts_only_path(cli):
    """On any machine: exit 1 with an error, else 0 only when every source was read (2: no verdict),
    a status, and never 'healthy' without NVML facts."""
    r = cli("health", "--duration", "0", "--format", "json")
    assert r.code in (0, 1, 2), r.err
    report = json.loads(r.out)
    assert report["command"] == "health" and report["data"]["status"] in STATUSES
    assert r.code == (1 if report["verdict"] == "error" else 0 if report["data"]["complete"] else 2)
    assert (report["data"]["status"] == "healthy") <= (r.code == 0)
    facts = report["data"]["facts"]
    if "NVML" in facts["not_checked"]:
        assert report["data"]["status"] != "healthy"
        assert (
            report["data"]["not_checked"]["NVML"].startswith("NVML not available")
            or "no NVIDIA GPU" in (report["data"]["not_checked"]["NVML"])
        )
    if not facts["kernel_logs"]:
        assert "kernel log" in report["data"]["not_checked"]


def test_text_leads_with_the_verdict_and_the_status(cli):
    r = cli("health", "--duration", "0")
    first, *rest = r.out.splitlines()
    # a machine whose GPUs could not be read leads with NOT CHECKED, never OK
    assert first.split()[0] in ("OK", "WARNING", "ERROR", "NOT", "INCOMPLETE") and "fpdoctor health" in first
    if first.startswith(" OK") or first.startswith("OK"):
        assert not [line for line in rest if line.startswith("status") and "NOT CHECKED" in line]
    assert any(line.startswith("status") for line in rest)


@pytest.mark.parametrize("path", sorted(p.name for p in RULES.iterdir() if not p.name.endswith(".expected.json")))
def test_from_each_rule_fixture(cli, path):
    expected = json.loads((RULES / path).with_suffix(".expected.json").read_text())
    r = cli("health", "--from", str(RULES / path), "--format", "json")
    report = json.loads(r.out)
    worst = {f["severity"] for f in expected["findings"]}
    # each fixture is one source (a log, nvidia-smi -q or facts without a kernel log): without an
    # error there is no verdict on the node
    assert r.code == (1 if "error" in worst else 2)
    assert [f["name"] for f in report["findings"]] == [f["name"] for f in expected["findings"]]


def test_several_from_files_join_the_log_and_the_smi_output(cli, tmp_path):
    smi = tmp_path / "smi.txt"
    smi.write_text(
        "==============NVSMI LOG==============\n\nDriver Version : 570.148.08\n\nAttached GPUs : 1\n"
        "GPU 00000000:00:08.0\n    Product Name : NVIDIA GB200\n"
        "    GPU UUID : GPU-aaaaaaaa-0000-0000-0000-000000000001\n"
        "    Remapped Rows\n        Correctable Error : 0\n        Uncorrectable Error : 0\n        Pending : No\n"
        "        Remapping Failure Occurred : No\n"
    )
    log = tmp_path / "dmesg.txt"
    log.write_text(
        "[  100.000000] NVRM: Xid (PCI:0000:00:08.0): 145, RLW_REMAP Nonfatal XC1 i0 Link 10 (0x00000082 0x00000040 "
        "0x00000000 0x00000000 0x00000000 0x00000000)\n"
    )
    r = cli("health", "--from", str(log), "--from", str(smi), "--format", "json")
    report = json.loads(r.out)
    (f,) = report["findings"]
    # the driver version comes from the nvidia-smi file: the v1 table decodes it to a GPU reset
    assert f["evidence"]["nvlink"][0]["decode"]["table"] == "v1" and f["severity"] == "error"
    assert f["where"] == {"pci": "0000:00:08.0", "index": 0, "uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000001"}
    assert r.code == 1


def test_from_stdin_and_from_a_gzipped_log(tmp_path):
    line = b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.\n"
    proc = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "health", "--from", "-", "--format", "json"],
        input=line,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1 and json.loads(proc.stdout)["findings"][0]["name"] == "gpu-lost"
    gz = tmp_path / "kern.log.gz"
    gz.write_bytes(gzip.compress(line))
    r = run_fpdoctor("health", "--from", str(gz), "--format", "json")
    assert r.code == 1 and json.loads(r.out)["findings"][0]["name"] == "gpu-lost"


def test_a_log_without_nvidia_lines_says_so(cli, tmp_path):
    log = tmp_path / "dmesg.txt"
    log.write_text("[    0.000000] Linux version 6.8.0-45-generic\n[    1.000000] random: crng init done\n")
    r = cli("health", "--from", str(log))
    assert r.code == 2  # nothing but a kernel log: no verdict on the GPUs
    assert "2 lines, no NVIDIA (NVRM) lines" in r.out and "NOT CHECKED" in r.out


def test_the_json_report_reads_back(cli, tmp_path):
    out = tmp_path / "health.json"
    r = cli("health", "--from", str(RULES / "HWR001-xid-error.log"), "-o", str(out))
    assert r.code == 1 and r.out == ""
    again = cli("health", "--from", str(out), "--format", "json")
    first = json.loads(out.read_text())
    assert again.code == 1 and json.loads(again.out)["findings"] == first["findings"]


def _bad(tmp_path, name: str, data: bytes):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--duration", "-1"], "--duration must be zero or more seconds"),
        (["--duration", "nan"], "--duration must be zero or more seconds"),
        (["--duration", "soon"], "invalid float value"),
        (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
        (["--device", "cuda:99", "--duration", "1"], "cuda:99 is not a GPU of this machine"),
        (["--duration", "0", "--device", "cuda"], "needs --duration > 0"),
        (["--from", "/nonexistent/dmesg.txt"], "does not exist"),
        (["--from", "/"], "is a directory"),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(cli, args, words):
    r = cli("health", *args)
    assert r.code == 2 and r.out == ""
    assert len(r.err.strip().splitlines()) == 1 and words in r.err and "Traceback" not in r.err


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("empty.log", b"", "is empty"),
        ("blank.log", b"\n  \n", "is empty"),
        ("binary.bin", bytes(range(256)) * 8, "is binary, not text"),
        (
            "cut.json",
            b'{"schema": "fpdoctor.report/1", "command": "health", "data": {"facts": {"gpus": [',
            "not complete JSON",
        ),
        ("env.json", json.dumps({"gpus": [], "driver": {"version": "550"}}).encode(), "`fpdoctor env` facts"),
        (
            "trace.json",
            json.dumps({"schema": "fpdoctor.report/1", "command": "trace", "data": {}}).encode(),
            "not of `fpdoctor health`",
        ),
        ("list.json", b'[{"a": 1}]', "not fpdoctor health facts"),
        ("badfacts.json", json.dumps({"gpus": [{"index": "zero"}]}).encode(), "malformed health facts"),
        (
            "cut.log",
            b"[ 1843.308145] NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=a, x\n[ 1844.1] NVRM: Xid (PCI:0000:3b",
            "looks cut off",
        ),
        ("cut_lost.log", b"[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n", "looks cut off"),
        (
            "garbled.log",
            b"NVRM: Xid (PCI:0000:3b:00): , pid=1\nNVRM: Xid (PCI:0000:3b:00): 13, pid=1\n",
            "without a readable Xid code",
        ),
        (
            "cut.gz",
            gzip.compress(b"NVRM: Xid (PCI:0000:3b:00): 13, pid=1\n" * 50, mtime=0)[:40],
            "truncated or damaged gzip",
        ),
        ("smi_empty.txt", b"==============NVSMI LOG==============\n\nDriver Version : 550.1\n", "holds no GPU section"),
    ],
)
def test_bad_input_files_are_one_line_and_exit_2(cli, tmp_path, name, data, words):
    r = cli("health", "--from", _bad(tmp_path, name, data))
    assert r.code == 2 and r.out == "", r.out
    assert len(r.err.strip().splitlines()) == 1 and words in r.err and "Traceback" not in r.err


def test_help_says_what_each_device_runs(cli, capsys):
    with pytest.raises(SystemExit):
        cli("health", "--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "cuda (the default) every GPU of this node" in text and "cuda:N that one GPU" in text


def test_from_cannot_be_combined_with_fingerprints(cli):
    r = cli("health", "--from", str(RULES / "HWR001-xid-error.log"), "--duration", "2")
    assert r.code == 2 and "cannot be combined with --from" in r.err


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nsys.stderr.write('MODULES:' + ' '.join(sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    return set(proc.stderr.rsplit("MODULES:", 1)[1].split())


def test_facts_path_and_from_never_import_torch():
    code = (
        "from fpdoctor.cli.main import main\n"
        "main(['health', '--duration', '0', '--format', 'json'])\n"
        f"main(['health', '--from', {str(RULES / 'HWR004-row-remap-pending.txt')!r}, '--format', 'json'])\n"
        f"main(['health', '--from', {str(RULES / 'HWR001-xid-error.log')!r}])\n"
    )
    modules = _modules_after(code)
    assert "torch" not in modules and not any(m.startswith("torch.") for m in modules)


def test_bare_health_on_a_machine_without_nvidia_driver_never_imports_torch():
    """`fpdoctor health` (default duration) has nothing to fingerprint without a driver: no torch."""
    code = (
        "from fpdoctor.health import nvml\n"
        "try:\n    nvml.collect()\n    no_driver = False\n"
        "except nvml.NvmlUnavailable as exc:\n    no_driver = exc.no_driver\n"
        "from fpdoctor.cli.main import main\n"
        "if no_driver:\n    main(['health', '--format', 'json'])\n"
        "print('NO_DRIVER' if no_driver else 'DRIVER')\n"
    )
    probe = f"{code}\nimport sys\nsys.stderr.write('MODULES:' + ' '.join(sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    if "NO_DRIVER" not in proc.stdout:
        pytest.skip("this machine has an NVIDIA driver: fingerprints would run")
    assert "torch" not in set(proc.stderr.rsplit("MODULES:", 1)[1].split())
    assert '"GEMM fingerprints"' in proc.stdout or "fingerprints not run" in proc.stdout
