"""Verdicts a user can act on: evidence before a finding, one severity per code, what was inferred
said so, fixes that paste, and reports that say what they could not see."""

from __future__ import annotations

import copy
import re

import pytest

from fpdoctor import catalog
from fpdoctor.env.doctor import diagnose_env
from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

H100 = ENV_FIXTURES / "facts" / "h100_cu130_single_gpu_live.json"


def _facts(path):
    return strict_json(path.read_text())


def _by_name(report):
    return {f.name: f for f in report.findings}


def _all_inputs():
    paths = ENV_FIXTURES.rglob("*")
    return sorted(p for p in paths if p.suffix in (".txt", ".log", ".json") and ".expected." not in p.name)


# -- a weak symptom never makes a finding on its own (item: known-issue false positives) -----------


def test_a_script_that_prints_loss_nan_is_not_a_hardware_finding(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text('if loss.isnan():\n    print("loss is NaN, giving up")\n    raise SystemExit(1)\n')
    result = cli("env", "--from", str(script), "--format", "json")
    if result.code == 2:
        assert "found neither" in result.err
    else:
        assert [f["name"] for f in strict_json(result.out)["findings"]] == []


def test_a_nan_loss_beside_an_xid_is_a_note(tmp_path, cli):
    log = tmp_path / "train.log"
    log.write_text(
        "step 80 loss nan\n"
        "[Tue Mar 4 02:11:09 2025] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n"
    )
    doc = strict_json(cli("env", "--from", str(log), "--format", "json").out)
    silent = [f for f in doc["findings"] if f["evidence"].get("issue") == "SILENT_BAD_GPU_NAN_AT_SCALE"]
    assert [(f["name"], f["severity"]) for f in silent] == [("known-issue-possible", "info")]
    # its references are links, without the research notes the data keeps beside them
    assert "https://github.com/pytorch/torchtitan/issues/865" in silent[0]["references"]
    assert all(re.fullmatch(r"https://\S+", r) for r in silent[0]["references"])
    assert "fpdoctor health" in silent[0]["fix"]


@pytest.mark.parametrize("symptom", ["Bus error", "Watchdog caught collective operation timeout"])
def test_generic_symptoms_alone_make_no_known_issue(symptom, tmp_path, cli):
    log = tmp_path / "run.log"
    log.write_text(f"torch 2.5.1+cu124\n{symptom}\n")
    doc = strict_json(cli("env", "--from", str(log), "--format", "json").out)
    assert not [f for f in doc["findings"] if f["name"].startswith("known-issue")]


@pytest.mark.parametrize("path", _all_inputs(), ids=lambda p: p.name)
def test_each_code_is_emitted_at_the_severity_rules_lists(path, cli):
    """One source of truth: the severity `fpdoctor rules` lists for the known-issue codes is the one
    every report gives them."""
    result = cli("env", "--from", str(path), "--format", "json")
    assert result.code in (0, 1), result.err
    for f in strict_json(result.out)["findings"]:
        if f["name"].startswith("known-issue"):
            assert f["severity"] == catalog.get(f["name"]).severity.value, f


def test_rules_lists_the_known_issue_severities(cli):
    out = cli("rules").out
    for name, severity in (
        ("known-issue ", "warning"),
        ("known-issue-crash", "error"),
        ("known-issue-possible", "info"),
    ):
        (line,) = [ln for ln in out.splitlines() if re.search(rf"\s{name.strip()}\s", ln)]
        assert severity in line


# -- a real single-GPU H100: summarised environment, each copy once, conditions not shown --------


def test_h100_single_gpu_report_is_short_and_says_what_it_cannot_see(cli):
    result = cli("env", "--from", str(H100), "--format", "json")
    doc = strict_json(result.out)
    summary = dict(doc["data"]["summary"])
    assert len(summary["environment"]) < 400 and "NVIDIA_REQUIRE_CUDA=cuda>=13.0" in summary["environment"]
    for lib in ("libcublas", "libnccl", "libcudart"):
        row = summary[lib]
        assert row.count("/opt/venv/") == 1, row  # the loaded copy is the wheel's: listed once
        assert "(loaded)" in row
    nccl = [f for f in doc["findings"] if f["evidence"].get("issue") == "NCCL_2_28_9_CROSSNODE_CUDAGRAPH"]
    assert [(f["name"], f["severity"]) for f in nccl] == [("known-issue-possible", "info")]
    assert "multi-node" in nccl[0]["message"]
    assert doc["verdict"] == "ok" and result.code == 0


def test_a_version_only_issue_with_every_condition_shown_is_a_warning():
    facts = _facts(H100)
    facts["torch"]["nccl"] = "2.29.2"
    names = _by_name(diagnose_env(facts=facts))
    assert names["known-issue"].evidence["issue"] == "NCCL_2_29_2_HANG"
    assert names["known-issue"].severity.value == "warning"


# -- a CPU-only build in a report whose GPU lines are missing ---------------------------------------

CPU_ONLY_CUT = """\
PyTorch version: 2.0.1+cpu
Is debug build: False
CUDA used to build PyTorch: Could not collect
ROCM used to build PyTorch: N/A

OS: Ubuntu 22.04.2 LTS (x86_64)
Python version: 3.10.12 (main, Jun 11 2023, 05:26:28) [GCC 11.4.0] (64-bit runtime)
Is CUDA available: False
CUDA runtime version: 11.8.89
CUDA_MODULE_LOADING set to: N/A
"""


def test_cpu_only_build_beside_a_cuda_runtime_is_flagged(tmp_path, cli):
    report = tmp_path / "collect_env.txt"
    report.write_text(CPU_ONLY_CUT)
    doc = strict_json(cli("env", "--from", str(report), "--format", "json").out)
    (finding,) = [f for f in doc["findings"] if f["name"] == "cpu-only-build"]
    assert finding["severity"] == "warning"
    assert "11.8.89" in finding["message"] and "GPU" in finding["message"]
    assert "cu118" in finding["fix"]


# -- fixes: a command, or why there is none; the interpreter the input shows; cost of the alternatives


_COMMAND = re.compile(
    r"^(?:#|(?:\S*python3?|'[^']*/python3?') -m pip |export |unset |fpdoctor |nvidia-smi|sudo |conda |rm |"
    r"CUDA_LAUNCH_BLOCKING=1 |torchrun |compute-sanitizer |[A-Z][A-Z0-9_]*=\S* |dmesg |df |grep )"
)


@pytest.mark.parametrize("path", _all_inputs(), ids=lambda p: p.name)
def test_every_fix_line_is_a_command_or_says_why(path, cli):
    doc = strict_json(cli("env", "--from", str(path), "--format", "json").out)
    for f in doc["findings"]:
        assert f["fix"], f["code"]
        for line in f["fix"].splitlines():
            assert _COMMAND.match(line), (f["code"], line)
            assert "the finding gives" not in line


def test_catalogue_fixes_do_not_promise_what_a_finding_lacks():
    for rule in catalog.rules():
        if rule.code.startswith("ENV"):
            assert "the finding gives the index URL" not in rule.fix


def test_no_covering_build_says_why_there_is_no_command():
    facts = _facts(ENV_FIXTURES / "rules" / "ENV004-arch-not-in-build.json")
    facts["gpus"][0].update(name="NVIDIA B300", compute_capability="10.3")
    facts["driver"]["version"] = "470.82.01"  # no official CUDA 12.8+ build runs on it
    facts["torch"]["warnings"] = []
    finding = _by_name(diagnose_env(facts=facts))["arch-not-in-build"]
    assert all(line.startswith("#") or "pip" in line for line in finding.fix.splitlines())
    assert "driver" in finding.fix


def test_fixes_use_the_interpreter_the_input_shows(tmp_path, cli):
    log = tmp_path / "crash.log"
    log.write_text(
        "Traceback (most recent call last):\n"
        '  File "/opt/venv/lib/python3.10/site-packages/torch/nn/modules/linear.py", line 114, in forward\n'
        "RuntimeError: CUDA error: CUBLAS_STATUS_INVALID_VALUE when calling `cublasGemmEx( handle, opa, opb, m,"
        " n, k, &falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_16BF, ldc, compute_type,"
        " CUBLAS_GEMM_DEFAULT_TENSOR_OP)`\n"
    )
    doc = strict_json(cli("env", "--from", str(log), "--format", "json").out)
    fixes = "\n".join(f["fix"] for f in doc["findings"])
    assert "/opt/venv/bin/python -m pip" in fixes and "\npip install" not in "\n" + fixes


def test_the_fix_to_take_comes_first_and_a_torch_change_says_its_cost():
    facts = _facts(ENV_FIXTURES / "rules" / "ENV101-cublas-h20-sigfpe.json")
    facts["python"] = {"version": "3.10.14", "executable": "/opt/venv/bin/python"}
    fix = _by_name(diagnose_env(facts=facts))["cublas-h20-sigfpe"].fix.splitlines()
    assert fix[0].startswith('/opt/venv/bin/python -m pip install "nvidia-cublas-cu12==12.4.5.8"')
    torch_line = next(k for k, line in enumerate(fix) if '"torch==' in line)
    assert "rebuild" in fix[torch_line + 1]


# -- provenance a user can read --------------------------------------------------------------------


def test_confidence_words_are_explained(cli):
    doc = strict_json(cli("env", "--from", str(H100), "--format", "json").out)
    for f in doc["findings"]:
        confidence = f["evidence"].get("confidence")
        if confidence:
            assert "(" in confidence, confidence  # 'reported (several independent user reports agree ...)'
    explained = cli("explain", "ENV104").out
    for word in ("confirmed", "likely", "reported", "inferred", "unconfirmed"):
        assert word in explained


def test_a_capability_from_the_gpu_table_is_said_to_be_inferred(cli):
    doc = strict_json(
        cli("env", "--from", str(ENV_FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt"), "--format", "json").out
    )
    assert "inferred" in dict(doc["data"]["summary"])["GPUs"]


# -- probes say what they cannot see, and what their numbers mean -----------------------------------


def test_probe_lines_are_relative_and_name_their_tolerance():
    from fpdoctor.env.summary import probe_line

    line = probe_line(
        {
            "name": "gemm-bf16",
            "dtype": "bf16",
            "status": "ok",
            "max_abs_err": 0.25,
            "tolerance": 283.0,
            "scale": 398.0,
            "k": 512,
            "u": 2.0**-8,
        }
    )
    assert "0.25" not in line and "of the scale" in line and "k = 512" in line and "2^-8" in line


def test_probes_say_what_they_cannot_catch():
    facts = _facts(ENV_FIXTURES / "rules" / "ENV201-probe-crashed.json")
    report = diagnose_env(facts=facts)
    limits = report.data["not_checked"]["intermittent GPU faults"]
    assert "intermittent" in limits and "fpdoctor health" in limits


# -- Windows on CUDA 13: no driver floor in NVIDIA's table -----------------------------------------


def test_windows_cuda_13_driver_is_reported_as_not_checked():
    facts = copy.deepcopy(_facts(H100))
    facts["os"] = {"system": "Windows", "distro": "Windows 11"}
    report = diagnose_env(facts=facts)
    (key,) = [k for k in report.data["not_checked"] if k.startswith("driver floor")]
    assert "Windows" in report.data["not_checked"][key]


# -- what the rule base cannot judge is said, never passed over ------------------------------------


def test_a_build_missing_from_the_arch_table_is_reported_as_not_checked():
    facts = _facts(H100)
    facts["torch"].update(version="2.15.0+cu130", arch_list=None)
    report = diagnose_env(facts=facts)
    assert "2.15.0" in report.data["not_checked"]["GPU architecture coverage"]


def test_a_cuda_without_a_driver_floor_is_reported_as_not_checked():
    facts = _facts(H100)
    facts["torch"].update(version="2.15.0+cu140", cuda="14.0")
    report = diagnose_env(facts=facts)
    assert "driver floor for CUDA 14.0" in report.data["not_checked"]


def test_a_loaders_duplicate_complaint_in_a_log_is_a_finding(tmp_path, cli):
    log = tmp_path / "bnb.log"
    log.write_text(
        "UserWarning: Found duplicate ['libcudart.so', 'libcudart.so.11.0', 'libcudart.so.12.0'] files in: "
        "{PosixPath('/usr/local/cuda/lib64/libcudart.so'), PosixPath('/opt/conda/lib/libcudart.so')}\n"
    )
    doc = strict_json(cli("env", "--from", str(log), "--format", "json").out)
    assert [(f["name"], f["severity"]) for f in doc["findings"]] == [("duplicate-cuda-library", "warning")]
