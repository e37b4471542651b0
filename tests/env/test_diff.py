"""`fpdoctor env --diff A B` / `fpdoctor.diff_env`: only the differences of the table, one at a
time; verdicts on one side first; unknown never a difference; secrets never shown; bad input
exits 2; never imports torch for two files."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import fpdoctor
from fpdoctor.env.diff import diff_env
from fpdoctor.env.differences import TABLE
from tests.conftest import ENV_FIXTURES
from tests.env.strict import strict_json

BASE = ENV_FIXTURES / "facts" / "diff_base_a100_live.json"
COLLECT_ENV = ENV_FIXTURES / "collect_env"


def base() -> dict[str, Any]:
    facts: dict[str, Any] = json.loads(BASE.read_text())
    return facts


def keys(report: fpdoctor.Report) -> list[str]:
    return [d["key"] for d in report.data["differences"]]


def test_the_same_facts_differ_in_nothing():
    report = diff_env(str(BASE), str(BASE))
    assert report.findings == [] and report.exit_code == 0
    assert report.data["left_out"] == 0


FLAGS = sorted(base()["torch"]["precision"])
# a value that differs from the base's, per flag (True <-> False, another precision name)
OTHER = {"float32_matmul_precision": "high", "preferred_blas_library": "_BlasBackend.Cublaslt"}


@pytest.mark.parametrize("flag", FLAGS)
def test_one_flag_differs_only_that_difference_is_listed(flag):
    a, b = base(), base()
    value = a["torch"]["precision"][flag]
    b["torch"]["precision"][flag] = OTHER.get(flag, not value if isinstance(value, bool) else "ieee")
    report = diff_env(a, b)
    [difference] = report.data["differences"]
    assert difference["key"].startswith("flag.") and difference["group"] == "flag"
    assert [f.name for f in report.findings] == ["math-flag-differs"]
    assert report.findings[0].where["fact"] == difference["key"]
    assert report.data["left_out"] == 0
    entry = next(e for e in TABLE if e.key == difference["key"])
    assert report.exit_code == (1 if entry.severity.value == "error" else 0)


def test_every_flag_entry_of_the_table_is_collected():
    flag_entries = {e.key for e in TABLE if e.group == "flag"}
    seen = set()
    for flag in FLAGS:
        a, b = base(), base()
        value = a["torch"]["precision"][flag]
        b["torch"]["precision"][flag] = OTHER.get(flag, not value if isinstance(value, bool) else "ieee")
        seen |= set(keys(diff_env(a, b)))
    assert seen == flag_entries


VARIABLES = [e.key[4:] for e in TABLE if e.group == "variable" and not e.key.endswith("*")] + [
    "CUBLASLT_HEURISTICS_CACHE_CAPACITY"
]


@pytest.mark.parametrize("name", VARIABLES)
def test_one_variable_differs_only_that_difference_is_listed(name):
    a, b = base(), base()
    b["env"][name] = "0"
    report = diff_env(a, b)
    assert keys(report) == [f"env.{name}"]
    [finding] = report.findings
    assert finding.name == "math-variable-differs"
    assert finding.evidence["a"] == "unset" and finding.evidence["b"] == "0"
    assert f"unset {name}" in finding.fix  # make B as A
    assert report.data["left_out"] == 0


def test_variables_that_change_nothing_are_left_out_and_counted():
    a, b = base(), base()
    b["env"] |= {"CUBLASLT_LOG_LEVEL": "5", "NCCL_DEBUG": "INFO", "HOSTNAME": "gpu-node-17"}
    b["os"]["release"] = "6.1.0"
    report = diff_env(a, b)
    assert report.findings == [] and report.exit_code == 0
    assert report.data["left_out"] == 4
    assert ("left out", "4 other differences (hosts, unrelated packages, paths): they change no number") in (
        report.data["summary"]
    )


def test_a100_against_h20_collect_env_reports():
    report = diff_env(
        str(COLLECT_ENV / "a100_cu102_pytorch57922.txt"), str(COLLECT_ENV / "h20_cu121_pytorch133548.txt")
    )
    found = keys(report)
    for key in ("gpu.model", "gpu.capability", "torch.build", "torch.arch_list", "cublas.installed"):
        assert key in found
    verdicts = report.data["verdicts"]
    assert {"side": "B", "verdict": "cublas-h20-sigfpe"}.items() <= verdicts[1].items()
    assert {"side": "A", "verdict": "arch-not-in-build"}.items() <= verdicts[0].items()
    # verdicts on one side only come first, in the findings and in the table
    assert [f.name for f in report.findings[:2]] == ["verdict-on-one-side"] * 2
    assert report.data["table"]["rows"][1][:3] == ["verdict cublas-h20-sigfpe (ENV101)", "-", "fires"]
    build = next(d for d in report.data["differences"] if d["key"] == "torch.build")
    assert (build["a"], build["b"]) == ("CUDA 10.2", "CUDA 12.1")
    cublas = next(d for d in report.data["differences"] if d["key"] == "cublas.installed")
    assert cublas["b"] == "12.1.3.1" and cublas["b_inferred"]
    # inferred on one side: a warning at most, whatever the entry's severity
    assert all(d["severity"] != "error" for d in report.data["differences"] if d["a_inferred"] or d["b_inferred"])
    assert report.exit_code == 1  # the H20 verdict


def test_a_fact_one_input_does_not_show_is_unknown_never_a_difference():
    facts = base()
    facts["env"]["NVIDIA_TF32_OVERRIDE"] = "0"
    report = diff_env(str(COLLECT_ENV / "healthy_a100_cu121_vllm3842.txt"), facts)
    found = keys(report)
    assert not any(k.startswith(("env.", "flag.")) for k in found)
    assert "TF32 matmul (torch.backends.cuda.matmul.allow_tf32)" in report.data["unknown"]["a"]
    assert "NVIDIA_TF32_OVERRIDE" in report.data["unknown"]["a"]
    assert report.data["not_checked"]["NVIDIA_TF32_OVERRIDE"].startswith("not shown by A's input")


def test_secrets_never_appear(tmp_path, cli):
    a, b = base(), base()
    token = "hf_" + "a1B2c3D4e5F6g7H8i9J0kLmNoPqRs"
    a["env"]["HF_TOKEN"] = "hf_" + "z" * 30
    b["env"] |= {"HF_TOKEN": token, "CUBLASLT_SECRET_TOKEN": "s3cr3t-value", "NCCL_ALGO": f"Ring {token}"}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    for fmt in ("text", "json", "markdown", "html"):
        result = cli("env", "--diff", str(pa), str(pb), "--format", fmt, "-v")
        assert result.code == 0, result.err
        assert token not in result.out and "s3cr3t-value" not in result.out
        assert "HF_TOKEN" not in result.out  # not a fact of the table: counted, never shown
        assert "NCCL_ALGO" in result.out


def test_every_output_format(tmp_path, cli):
    a, b = base(), base()
    b["torch"]["precision"]["matmul_allow_tf32"] = True
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    doc = strict_json(cli("env", "--diff", str(pa), str(pb), "--format", "json").out)
    assert doc["command"] == "env --diff" and doc["verdict"] == "error"
    assert [f["code"] for f in doc["findings"]] == ["ENV305"]
    assert doc["data"]["differences"][0]["a"] is False and doc["data"]["differences"][0]["b"] is True
    text = cli("env", "--diff", str(pa), str(pb)).out
    assert "ENV305 math-flag-differs" in text and "torch.backends.cuda.matmul.allow_tf32 = False" in text
    markdown = cli("env", "--diff", str(pa), str(pb), "--format", "markdown").out
    assert "`math-flag-differs`" in markdown and "| fact | A | B | severity |" in markdown
    html = cli("env", "--diff", str(pa), str(pb), "--format", "html").out
    assert "math-flag-differs" in html and "<table" in html
    result = cli("env", "--diff", str(pa), str(pb), "-o", str(tmp_path / "diff.json"))
    assert result.code == 1 and strict_json((tmp_path / "diff.json").read_text())["verdict"] == "error"


def test_the_public_function_reads_a_report_of_env():
    report = fpdoctor.diagnose_env(facts=base()).to_dict()
    changed = base()
    changed["driver"]["version"] = "560.35.03"
    assert keys(fpdoctor.diff_env(report, changed)) == ["driver"]


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: str(tmp / "missing.json"), "no such file"),
        (str, "is a directory"),
        (lambda tmp: _write(tmp / "notes.txt", "shopping list: eggs, milk\n"), "found neither collect_env fields"),
        (lambda tmp: _write(tmp / "other.json", '{"schema": "something/1"}'), "not fpdoctor facts"),
        (lambda tmp: _write(tmp / "cut.json", '{"schema": "fpdoctor.facts/1", "torch": {'), "truncated JSON"),
        (lambda tmp: _write(tmp / "bad.json", json.dumps({**base(), "gpus": {}})), "field 'gpus' has the wrong type"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, cli, make, says):
    bad = make(tmp_path)
    for args in ((bad, str(BASE)), (str(BASE), bad)):
        result = cli("env", "--diff", *args)
        assert result.code == 2 and result.out == ""
        assert says in result.err and len(result.err.strip().splitlines()) == 1, result.err


def test_diff_takes_no_other_input(cli):
    result = cli("env", "--diff", str(BASE), str(BASE), "--from", str(BASE))
    assert result.code == 2 and "--diff A B compares two inputs and takes no --from" in result.err


def _write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_diff_of_two_saved_files_never_imports_torch():
    code = (
        "import sys\nfrom fpdoctor.cli.main import main\n"
        f"code = main(['env', '--diff', {str(BASE)!r}, {str(COLLECT_ENV / 'h20_cu121_pytorch133548.txt')!r},"
        " '--format', 'json'])\n"
        "sys.stderr.write(f'EXIT:{code} TORCH:{\"torch\" in sys.modules}')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert proc.stderr.rsplit("EXIT:", 1)[1] == "1 TORCH:False"
    assert strict_json(proc.stdout)["command"] == "env --diff"


def test_diff_of_two_files_starts_no_torch_child(monkeypatch, cli):
    def refuse(*args: object) -> None:
        raise AssertionError("env --diff of two files started a torch child")

    monkeypatch.setattr("fpdoctor.env.sources.torch_child.spawn", refuse)
    assert cli("env", "--diff", str(BASE), str(BASE)).code == 0


def test_this_machine_against_its_own_saved_facts(tmp_path, cli):
    """`.` is this machine, live: against the facts it just saved, the table finds nothing, and the
    flags a fresh process starts with are part of the facts."""
    saved = tmp_path / "facts.json"
    assert cli("env", "--no-probe", "--save-facts", str(saved), "--format", "json").code in (0, 1)
    facts = json.loads(saved.read_text())
    assert {"matmul_allow_tf32", "fill_uninitialized_memory", "deterministic_algorithms"} <= set(
        facts["torch"]["precision"]
    )
    report = fpdoctor.diff_env(".", str(saved))
    assert keys(report) == [] and report.data["verdicts"] == []
    changed = copy.deepcopy(facts)
    changed["torch"]["precision"]["deterministic_algorithms"] = True
    assert keys(fpdoctor.diff_env(".", changed)) == ["flag.deterministic_algorithms"]
