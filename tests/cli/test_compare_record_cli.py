"""`fpdoctor compare --save-reference FILE` on machine A, `--against FILE` on machine B, each in a
process of its own: the record crosses processes as a file, as it crosses machines.

Machine B is emulated on this CPU by factories of the same model (tests/fixtures/record/machines.py):
unchanged, one module's weights or code changed in between, other inputs, or a kernel that
accumulates the attention scores in fp16 and overflows where machine A's does not.
"""

from __future__ import annotations

import gzip
import json
import stat
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_fpdoctor
from tests.env.strict import strict_json

MACHINES = FIXTURES / "record" / "machines.py"
TIMEOUT = 240  # per process: importing torch and one compare of a 12-module model take a few seconds


def spec(factory: str) -> str:
    return f"{MACHINES}:{factory}"


@pytest.fixture(scope="module")
def record(tmp_path_factory) -> str:
    """Machine A's record, made by `fpdoctor compare` in a process of its own."""
    path = tmp_path_factory.mktemp("a") / "a.json.gz"
    made = run_fpdoctor(
        "compare", spec("machine_a"), "--candidate", "fp16", "--save-reference", str(path), "--format", "json",
        timeout=TIMEOUT,
    )  # fmt: skip
    assert made.code == 0, made.err
    doc = strict_json(made.out)
    assert doc["data"]["record"]["path"] == str(path) and doc["data"]["record"]["calls"] == 12
    return str(path)


def against(record: str, factory: str, *extra: str) -> tuple[int, dict]:
    result = run_fpdoctor("compare", spec(factory), "--against", record, "--format", "json", *extra, timeout=TIMEOUT)
    assert result.code in (0, 1), result.err
    return result.code, strict_json(result.out)


def names(doc: dict) -> list[tuple[str, str | None]]:
    return [(f["name"], f["where"].get("module")) for f in doc["findings"]]


def test_unchanged_model_agrees(record):
    code, doc = against(record, "machine_a")
    assert code == 0 and doc["findings"] == []
    summary = dict(doc["data"]["summary"])
    assert summary["candidate / floor model"].startswith("fp16 / fp32")  # the record's settings
    assert summary["B against A"] == "no module departs beyond the noise floor (12 module calls compared)"
    assert doc["data"]["against"]["record"]["source"] == record


def test_weights_changed_in_between_are_named(record):
    code, doc = against(record, "weights_changed")
    assert code == 0 and names(doc) == [("reference-weights-differ", "mlp.2")]
    finding = doc["findings"][0]
    assert (
        finding["evidence"]["modules"] == ["mlp.2"] and "the fp64 outputs part first at `mlp.2`" in finding["message"]
    )
    assert doc["data"]["against"]["sets"][0]["computation_differs_at"] == {"module": "mlp.2", "call": 0}


def test_code_changed_in_between_is_named(record):
    code, doc = against(record, "code_changed")
    assert code == 1 and names(doc) == [("reference-computation-differs", "mlp.1")]
    finding = doc["findings"][0]
    assert "`mlp.1` computes something else than on machine A" in finding["message"]
    assert finding["evidence"]["fp64_rel"] > 1e-6  # GELU's tanh approximation against the exact one


def test_fp16_overflow_on_machine_b_only_names_the_first_departing_module(record):
    code, doc = against(record, "fp16_accumulate")
    assert code == 1
    departure = next(f for f in doc["findings"] if f["name"] == "machine-departure")
    assert departure["where"]["module"] == "attn"
    evidence = departure["evidence"]
    # both machines' errors against fp64, side by side: finite on A, non-finite on B
    assert evidence["a_propagated_rel"] < 1e-2 and evidence["b_propagated_rel"] == "inf"
    assert evidence["a_nonfinite"] == 0 and evidence["b_nonfinite"] > 0 and evidence["kind"] == "nan"
    assert "keep `attn` in fp32 on this machine" in departure["fix"]
    # no mismatch: same inputs, weights and fp64 computation
    assert not [n for n, _ in names(doc) if n.startswith("reference-")]
    rows = {r[0]: r for r in doc["data"]["table"]["rows"]}
    assert rows["attn"][2] == "non-finite" and rows["attn"][5] == "non-finite departs"
    assert not rows["attn.q"][5].endswith("departs")  # before the scores, both machines agree


def test_a_classifier_that_loses_its_decisions_on_machine_b_only_is_an_error(tmp_path):
    """The head's GEMM keeps its running sum in fp16 on B: the relative error is 7.0e-6 on both
    machines, and B picks another class on 28% of the rows, A on none."""
    path = tmp_path / "classifier.json.gz"
    made = run_fpdoctor(
        "compare", spec("classifier_a"), "--candidate", "fp16", "--save-reference", str(path), "--format", "json",
        timeout=TIMEOUT,
    )  # fmt: skip
    assert made.code == 0, made.err
    code, doc = against(str(path), "classifier_fp16_accumulate")
    assert code == 1 and names(doc) == [("decisions-changed", "head")]
    use = doc["findings"][0]["evidence"]["against"]
    assert use["departs"] and use["b"]["top1"] < 0.75 and use["a"]["top1"] == 1.0
    assert doc["data"]["against"]["sets"][0]["first_departure"] is None  # by relative error, no module departs
    assert "its decisions depart from A's" in dict(doc["data"]["summary"])["B against A"]


def test_other_inputs_are_said(record):
    code, doc = against(record, "inputs_changed")
    assert code == 0 and names(doc) == [("reference-inputs-differ", None)]
    message = doc["findings"][0]["message"]
    assert "input set #0: A inputs[0] float32[4, 16, 32] (digest" in message and "not compared" in message
    assert dict(doc["data"]["summary"])["B against A"].startswith("not compared")


def test_a_candidate_other_than_the_record_is_a_usage_error(record, cli):
    result = cli("compare", spec("machine_a"), "--against", record, "--candidate", "bf16")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert "the record was made with --candidate fp16, not bf16: omit --candidate" in result.err
    result = cli("compare", spec("machine_a"), "--against", record, "--fp8-kernel", "fake")
    assert result.code == 2 and "made with --fp8-kernel auto, not fake" in result.err


def test_usage_errors_are_one_line(tmp_path, cli):
    result = cli("compare", spec("machine_a"))
    assert result.code == 2 and "compare needs --candidate" in result.err
    result = cli("compare", spec("machine_a"), "--save-reference", str(tmp_path / "a"), "--against", "x")
    assert result.code == 2 and "not allowed with argument" in result.err
    result = cli("compare", spec("machine_a"), "--save-reference", str(tmp_path / "no" / "a.json.gz"))
    assert result.code == 2 and "does not exist; create it" in result.err
    result = cli("compare", spec("machine_a"), "--save-reference", str(tmp_path))
    assert result.code == 2 and "is a directory" in result.err
    result = cli("compare", spec("machine_a"), "--save-reference", str(tmp_path / "a"), "-o", str(tmp_path / "a"))
    assert result.code == 2 and "name the same file" in result.err
    assert not list(tmp_path.iterdir())  # nothing was written


def _valid(record: str) -> dict:
    return json.loads(gzip.decompress(Path(record).read_bytes()))


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("missing", "no such file"),
        ("directory", "is a directory"),
        ("empty", "is empty"),
        ("text", "is not a compare record"),
        ("pickle", "never unpickles"),
        ("truncated", "truncated"),
        ("foreign JSON", "JSON but not a compare record"),
        ("newer format", "upgrade fpdoctor"),
        ("bad sample", "truth is not base64"),
        ("norm", "norm does not match its sample"),
    ],
)
def test_a_bad_record_is_exit_2_with_one_line(record, tmp_path, cli, case, fragment):
    import pickle

    path = tmp_path / "bad.json.gz"
    doc = _valid(record)
    call = doc["sets"][0]["calls"][0]
    if case == "directory":
        path = tmp_path
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "text":
        path.write_text("PyTorch version: 2.3.0\n")
    elif case == "pickle":
        path.write_bytes(pickle.dumps({"format": "fpdoctor.compare-record"}))
    elif case == "truncated":
        data = Path(record).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "foreign JSON":
        path.write_bytes(gzip.compress(b'{"schema": "fpdoctor.report/1"}'))
    elif case != "missing":
        if case == "newer format":
            doc["version"] = 99
        elif case == "bad sample":
            call["truth"] = "%%%"
        elif case == "norm":
            call["norm"] = call["norm"] * 2 + 1
        path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    # the record is read before the model: a bad file costs no run
    result = cli("compare", "no_such_module:make", "--against", str(path))
    assert result.code == 2, result.err
    assert fragment in result.err and len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err


def test_save_defaults_to_fp32_and_honours_the_umask(tmp_path, cli):
    import os

    path = tmp_path / "a.json.gz"
    old = os.umask(0o022)
    try:
        result = cli("compare", spec("machine_a"), "--save-reference", str(path), "--format", "json")
    finally:
        os.umask(old)
    assert result.code == 0, result.err
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    doc = strict_json(result.out)
    assert dict(doc["data"]["summary"])["candidate / floor model"].startswith("fp32 / fp32")
    assert _valid(str(path))["settings"]["candidate"] == "fp32"


def test_help_text(capsys):
    from fpdoctor.cli.main import main

    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--save-reference FILE" in out and "--against FILE" in out and "97 KiB per module call" in out
