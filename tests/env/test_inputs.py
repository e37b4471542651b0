"""What `fpdoctor env --from` accepts: logs as users paste them, several files, standard input,
and input it cannot read (exit 2, one line) or cannot understand (said so, never echoed whole)."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

LOGS = ENV_FIXTURES / "logs"
REPORTS = ENV_FIXTURES / "collect_env"


def _findings(result):
    return [(f["name"], f["severity"]) for f in strict_json(result.out)["findings"]]


# -- a log is a log, whatever its first character ----------------------------------------------


def test_a_timestamped_log_is_read_as_a_log(cli):
    result = cli("env", "--from", str(LOGS / "torchrun_sigfpe_timestamped_reg2rg6.log"), "--format", "json")
    assert result.err == "" and result.code == 0
    assert _findings(result) == [("cublas-h20-sigfpe", "warning")]
    assert strict_json(result.out)["data"]["facts"]["log"]["signals"] == ["SIGFPE"]


@pytest.mark.parametrize("prefix", ["[rank0]: ", "[rank3]:[E625 07:23:25.924327570 ProcessGroupNCCL.cpp:1168] "])
def test_a_rank_prefixed_log_is_read_as_a_log(prefix, tmp_path, cli):
    log = tmp_path / "rank.log"
    lines = ["Fatal Python error: Floating point exception", "", "Current thread 0x00007f9af97d14c0:"]
    log.write_text("".join(f"{prefix}{line}\n" for line in lines))
    result = cli("env", "--from", str(log), "--format", "json")
    assert result.err == "" and ("cublas-h20-sigfpe", "warning") in _findings(result)


def test_json_that_is_cut_short_is_still_named_as_such(tmp_path, cli):
    cut = tmp_path / "facts.json"
    cut.write_text('[{"schema": "fpdoctor.facts/1", "torch": {"version": "2.3')
    result = cli("env", "--from", str(cut))
    assert result.code == 2 and "truncated JSON" in result.err


def test_nvidia_smi_output_alone(cli):
    result = cli("env", "--from", str(LOGS / "nvidia_smi_a100_bitsandbytes89.log"), "--format", "json")
    assert result.code == 0 and result.err == ""
    doc = strict_json(result.out)
    assert doc["findings"] == []
    facts = doc["data"]["facts"]
    assert facts["driver"]["version"] == "525.105.17" and facts["driver"]["cuda"] == "12.0"
    assert [g["name"] for g in facts["gpus"]] == ["NVIDIA A100-SXM...", "NVIDIA A100-SXM..."]


# -- several inputs describing one machine ---------------------------------------------------------


def test_a_report_and_a_log_from_one_machine_are_joined(cli):
    report = REPORTS / "h20_cu121_pytorch133548.txt"
    log = LOGS / "torchrun_sigfpe_timestamped_reg2rg6.log"
    result = cli("env", "--from", str(report), "--from", str(log), "--format", "json")
    assert result.code == 1, result.err
    doc = strict_json(result.out)
    (finding,) = [f for f in doc["findings"] if f["name"] == "cublas-h20-sigfpe"]
    assert finding["severity"] == "error"
    assert any("exitcode: -8" in line for line in finding["evidence"]["matched"])  # the log's line
    assert doc["data"]["facts"]["torch"]["version"] == "2.3.0+cu121"  # the report's facts
    source = dict(doc["data"]["summary"])["source"]
    assert report.name in source and log.name in source


def test_inputs_from_different_machines_are_refused(tmp_path, cli):
    other = tmp_path / "other.txt"
    other.write_text("PyTorch version: 2.5.1+cu124\nCUDA used to build PyTorch: 12.4\n")
    result = cli("env", "--from", str(REPORTS / "h20_cu121_pytorch133548.txt"), "--from", str(other))
    assert result.code == 2 and "different machines" in result.err and len(result.err.splitlines()) == 1


# -- standard input ---------------------------------------------------------------------------------


def test_from_standard_input_in_process(monkeypatch, cli):
    text = (REPORTS / "h20_cu121_pytorch133548.txt").read_text()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    result = cli("env", "--from", "-", "--format", "json")
    assert result.code == 1 and ("cublas-h20-sigfpe", "error") in _findings(result)
    assert dict(strict_json(result.out)["data"]["summary"])["source"].startswith("collect_env standard input")


def test_from_standard_input_in_a_pipe():
    log = (LOGS / "torchrun_sigfpe_timestamped_reg2rg6.log").read_bytes()
    proc = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "env", "--from", "-", "--format", "json"],
        input=log,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert [f["name"] for f in strict_json(proc.stdout.decode())["findings"]] == ["cublas-h20-sigfpe"]


def test_empty_standard_input(monkeypatch, cli):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    result = cli("env", "--from", "-")
    assert result.code == 2 and "standard input is empty" in result.err


# -- input it cannot read: exit 2, one line -------------------------------------------------------


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_facts(depth, tmp_path, cli):
    deep = tmp_path / "deep.json"
    deep.write_text('{"schema": "fpdoctor.facts/1", "env": ' + "[" * depth + "]" * depth + "}")
    result = cli("env", "--from", str(deep))
    assert result.code == 2 and result.out == ""
    assert len(result.err.splitlines()) == 1 and "nested" in result.err


def test_deeply_nested_facts_end_to_end(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text('{"schema": "fpdoctor.facts/1", "torch": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001)
    proc = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "env", "--from", str(deep)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) == 1


def _mutations():
    """Facts with a field of the wrong shape, as a hand-edited or foreign file has them."""
    base = strict_json((ENV_FIXTURES / "rules" / "ENV101-cublas-h20-sigfpe.json").read_text())
    cases = {
        "gpus-not-a-list": {"gpus": "8 x H20"},
        "gpu-not-a-dict": {"gpus": [1, 2]},
        "gpu-name-a-number": {"gpus": [{"name": 7}]},
        "driver-a-string": {"driver": "535.104.05"},
        "torch-a-list": {"torch": ["2.3.0"]},
        "libraries-null-lists": {"libraries": {"wheels": None, "copies": [None], "loaded": "x"}},
        "probes-junk": {"probes": [{"status": "ok", "max_abs_err": "big"}]},
        "texts-numbers": {"texts": [1, 2.5, None]},
        "env-a-list": {"env": ["LD_LIBRARY_PATH=/x"]},
        "origin-a-string": {"origin": "live"},
        "version-a-number": {"torch": {"version": 2.3, "import": "ok"}},
    }
    for name, patch in cases.items():
        yield name, {**base, **patch}


@pytest.mark.parametrize(("name", "facts"), list(_mutations()), ids=[n for n, _ in _mutations()])
def test_facts_of_the_wrong_shape(name, facts, tmp_path, cli):
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(facts))
    result = cli("env", "--from", str(path))
    assert result.code in (0, 1, 2)
    if result.code == 2:
        assert len(result.err.splitlines()) == 1 and "fpdoctor: error:" in result.err
    else:
        assert result.err == ""


# -- values it cannot understand: said so, not checked, shortened ------------------------------


def _report(tmp_path, version: str, driver: str = "535.104.05", cuda: str = "12.1") -> str:
    path = tmp_path / "collect_env.txt"
    path.write_text(
        f"PyTorch version: {version}\nIs debug build: False\nCUDA used to build PyTorch: {cuda}\n"
        "OS: Ubuntu 22.04.4 LTS (x86_64)\nIs CUDA available: True\n"
        f"GPU models and configuration:\nGPU 0: NVIDIA H100 80GB HBM3\n\nNvidia driver version: {driver}\n"
    )
    return str(path)


@pytest.mark.parametrize(
    "case",
    [
        ("torch version", "9" * 5_000_000, "535.104.05", "12.1"),
        ("torch version", "2.x.y+cu12a", "535.104.05", "12.1"),
        ("torch version", "2.3.0+cu12a", "535.104.05", "12.1"),
        ("driver version", "2.3.0+cu121", "5a5.1", "12.1"),
        ("CUDA version", "2.3.0", "535.104.05", "12.x1"),
    ],
    ids=["huge", "letters", "bad-label", "driver", "cuda"],
)
def test_values_that_are_not_versions(case, tmp_path, cli):
    field, version, driver, cuda = case
    result = cli("env", "--from", _report(tmp_path, version, driver, cuda), "--format", "json")
    assert result.code == 0 and result.err == ""
    assert len(result.out) < 50_000  # nothing echoed whole
    doc = strict_json(result.out)
    reasons = doc["data"]["not_checked"]
    (key,) = [k for k in reasons if k.startswith(field)]
    assert "not understood" in reasons[key] and len(reasons[key]) < 300
    text = cli("env", "--from", _report(tmp_path, version, driver, cuda)).out
    assert "not understood" in text and len(text) < 20_000


# -- a CUDA error in a log: what it means, what to run next, exit by the findings ----------------

IMA = "RuntimeError: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    "text",
    [IMA, f"[rank0]: {IMA}", f"\x1b[31m{IMA}\x1b[0m", f"\x1b[1;31m[rank3]:\x1b[0m {IMA}"],
    ids=["plain", "rank-prefix", "ansi", "ansi-and-rank"],
)
def test_a_log_whose_only_line_is_a_cuda_error(text, tmp_path, cli):
    log = tmp_path / "crash.log"
    log.write_text(text + "\n")
    result = cli("env", "--from", str(log), "--format", "json")
    assert result.code == 1 and result.err == ""
    (finding,) = strict_json(result.out)["findings"]
    assert finding["name"] == "cuda-error" and "illegal" in finding["evidence"]["matched"][0]
    assert "asynchronously" in finding["message"]
    assert "CUDA_LAUNCH_BLOCKING=1 python train.py" in finding["fix"] and "fpdoctor run --" in finding["fix"]
    assert finding["fix"].startswith("# the log does not show the command")


@pytest.mark.parametrize("name", ["rank0_ima_fsdp2_bitsandbytes1633.log", "ima_timestamped_regtr33.log"])
def test_cuda_error_logs_as_users_paste_them(name, cli):
    result = cli("env", "--from", str(LOGS / name), "--format", "json")
    assert result.code == 1
    assert _findings(result) == [("cuda-error", "error")]


def test_a_cuda_error_names_the_script_the_traceback_shows(tmp_path, cli):
    log = tmp_path / "crash.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "/home/me/proj/train.py", line 40, in <module>\n    loss.backward()\n'
        "RuntimeError: CUDA error: device-side assert triggered\n"
    )
    (finding,) = strict_json(cli("env", "--from", str(log), "--format", "json").out)["findings"]
    assert "CUDA_LAUNCH_BLOCKING=1 python /home/me/proj/train.py" in finding["fix"]
    assert "out of range" in finding["message"]
    assert "# Run the failing step on the CPU" in finding["fix"]


def test_an_import_failure_in_a_log_is_named_with_its_cause(cli):
    result = cli("env", "--from", str(LOGS / "import_torch_nvjitlink.log"), "--format", "json")
    (finding,) = strict_json(result.out)["findings"]
    assert (finding["name"], finding["severity"]) == ("torch-import-failed", "error")
    assert finding["evidence"]["known_issue"] == "NVJITLINK_SYMBOL_MISMATCH"
    assert "python3 -m pip install -U nvidia-nvjitlink-cu12" in finding["fix"]  # Debian's dist-packages python
