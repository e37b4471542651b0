"""Compare records: the format (round trip, safe loading, every malformed field refused), the
judgement of one run against another's record, its size, and the against-report's renderings."""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
import pickle
import stat
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.precision.metrics import SAMPLE, l2_norm
from fpdoctor.precision.profile import DIVERGENCE_RATIO
from fpdoctor.precision.record import against, against_report
from fpdoctor.precision.record.record import (
    CallRecord,
    CompareRecord,
    DecisionRecord,
    RecordError,
    SetRecord,
    Settings,
)
from fpdoctor.report.render import render
from tests.conftest import load_minilm
from tests.env.strict import strict_json
from tests.fixtures.record import machines

PER_CALL = 100 * 2**10  # the bound on a record's size per module call


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(up=nn.Linear(64, 256), act=nn.GELU(), down=nn.Linear(256, 64), head=nn.Linear(64, 8))
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, Any]:
    """A record of the mlp in fp16, and its JSON document."""
    path = str(tmp_path_factory.mktemp("record") / "a.json.gz")
    torch.manual_seed(1)
    fpdoctor.compare(mlp(), torch.randn(16, 64), candidate="fp16", save_reference=path)
    return path, json.loads(gzip.decompress(Path(path).read_bytes()))


# -- the format --------------------------------------------------------------------------------


def test_round_trip_keeps_every_field_and_sample(saved, tmp_path):
    path, _ = saved
    record = CompareRecord.load(path)
    assert record.settings == Settings("fp16", "fp32", "auto", None, None)
    assert record.source == path and record.version == 2 and record.fpdoctor == fpdoctor.__version__
    assert record.machine["device"] == "cpu" and record.machine["torch"] == torch.__version__
    assert set(record.weights) == {"up", "down", "head"}  # modules with weights of their own
    assert [c.module for c in record.sets[0].calls] == ["up", "act", "down", "head", ""]
    assert record.sets[0].inputs["tensors"] == [{"name": "inputs[0]", "shape": [16, 64], "dtype": "float32"}]
    for call in record.sets[0].calls:
        assert call.truth.dtype == torch.float64 and call.candidate.dtype == torch.float32
        assert call.truth.numel() == call.candidate.numel() <= SAMPLE and call.norm == l2_norm(call.truth)
    # written again, read again: the same bytes (gzip without a timestamp) and the same values
    again = tmp_path / "b.json.gz"
    record.save(again)
    assert again.read_bytes() == CompareRecord.from_bytes(record.to_bytes()).to_bytes() == Path(path).read_bytes()
    copy_ = CompareRecord.load(again)
    for x, y in zip(record.sets[0].calls, copy_.sets[0].calls, strict=True):
        assert torch.equal(x.truth, y.truth) and torch.equal(x.candidate, y.candidate)
        assert (x.floor, x.propagated, x.isolated, x.reference) == (y.floor, y.propagated, y.isolated, y.reference)


def test_a_gunzipped_record_reads_too(saved, tmp_path):
    path, _ = saved
    plain = tmp_path / "a.json"
    plain.write_bytes(gzip.decompress(Path(path).read_bytes()))
    assert CompareRecord.load(plain).calls == CompareRecord.load(path).calls


class _Planted:
    """Unpickling it would create a file: the proof that a loader ran pickle."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("wrap", ["pickle", "gzip", "torch.save"])
def test_loading_never_unpickles(tmp_path, wrap):
    marker = tmp_path / "unpickled"
    path = tmp_path / "evil.json.gz"
    if wrap == "torch.save":
        torch.save({"x": _Planted(str(marker))}, path)
    else:
        data = pickle.dumps(_Planted(str(marker)))
        path.write_bytes(gzip.compress(data) if wrap == "gzip" else data)
    with pytest.raises(RecordError) as err:
        CompareRecord.load(path)
    assert not marker.exists()
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert {"pickle": "pickle", "gzip": "not valid JSON", "torch.save": "zip archive"}[wrap] in message


def _b64(values: list[float] | list[int], code: str) -> str:
    import array
    import base64

    return base64.b64encode(array.array(code, values).tobytes()).decode()


def _first_call(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["sets"][0]["calls"][0]


# (what is done to a valid record's JSON document, a fragment of the one-line message)
MALFORMED = {
    "not a record": (lambda d: {"hello": 1}, "JSON but not a compare record"),
    "newer version": (lambda d: d | {"version": 3}, "reads format 2: upgrade fpdoctor"),
    "version text": (lambda d: d | {"version": "1"}, "version is str, not int"),
    "no sets": (lambda d: d | {"sets": []}, "sets is empty"),
    "sets missing": (lambda d: {k: v for k, v in d.items() if k != "sets"}, "sets is missing"),
    "unknown candidate": (
        lambda d: d | {"settings": d["settings"] | {"candidate": "fp12"}},
        "settings.candidate is 'fp12'",
    ),
    "machine nested": (lambda d: d | {"machine": {"gpu": {"name": "x"}}}, "machine.gpu is dict"),
    "weights digest": (lambda d: d | {"weights": {"up": "zz"}}, "not a hex digest"),
    "call not an object": (lambda d: _set_call(d, 3), "calls[0] is int"),
    "bad base64": (lambda d: _set_field(d, "truth", "!!not base64!!"), "truth is not base64"),
    "odd byte count": (lambda d: _set_field(d, "truth", "AAAA"), "holds 3 bytes"),
    "too many values": (lambda d: _set_field(d, "truth", _b64([1.0] * (SAMPLE + 1), "d")), f"1 to {SAMPLE} values"),
    "lengths differ": (lambda d: _set_field(d, "candidate", _b64([1.0], "f")), "fp64 values but 1 candidate"),
    "non-finite truth": (
        lambda d: _set_fields(d, truth=_b64([math.inf], "d"), candidate=_b64([1.0], "f")),
        "truth holds NaN or Inf",
    ),
    "norm mismatch": (lambda d: _set_field(d, "norm", 12345.0), "norm does not match its sample"),
    "negative floor": (lambda d: _set_field(d, "floor", -1.0), "not an error"),
    "zero floor": (lambda d: _set_field(d, "floor", 0), "floor is 0"),
    "leaf not bool": (lambda d: _set_field(d, "leaf", 1), "leaf is int, not bool"),
    "call index bool": (lambda d: _set_field(d, "call", True), "call is bool, not int"),
    "negative count": (lambda d: _set_field(d, "nonfinite", -1), "nonfinite is -1, below 0"),
    "isolated text": (lambda d: _set_field(d, "isolated", "big"), "isolated is 'big'"),
    "decisions missing": (lambda d: _set_decisions(d, None, None), "sets[0].decisions is missing"),
    "decisions not an object": (lambda d: _set_decisions(d, None, 3), "decisions is int, not dict/str"),
    "decided rows": (
        lambda d: _set_decisions(d, "truth_top1", _b64([1] * 3, "i")),
        "decisions.truth_top1 holds 12 bytes, not 16 values of 4 bytes",
    ),
    "class beyond": (
        lambda d: _set_decisions(d, "candidate_top1", _b64([8] * 16, "i")),
        "candidate_top1 holds a class beyond its 8",
    ),
    "kept rows not finite": (
        lambda d: _set_decisions(d, "truth_rows", _b64([math.nan] * 128, "d")),
        "decisions.truth_rows holds NaN or Inf",
    ),
    "floor not a share": (lambda d: _set_decisions(d, "floor_top1", 1.5), "floor_top1 is 1.5, not a share of rows"),
    "duplicate call": (
        lambda d: d | {"sets": [d["sets"][0] | {"calls": [_first_call(d), _first_call(d)]}]},
        "call 0 twice",
    ),
}


def _set_decisions(doc: dict[str, Any], key: str | None, value: Any) -> dict[str, Any]:
    """A field of the first set's decisions; key None: the decisions themselves (value None: removed)."""
    one = doc["sets"][0]
    if key is not None:
        one["decisions"][key] = value
    elif value is None:
        del one["decisions"]
    else:
        one["decisions"] = value
    return doc


def _set_call(doc: dict[str, Any], value: Any) -> dict[str, Any]:
    doc["sets"][0]["calls"][0] = value
    return doc


def _set_field(doc: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    _first_call(doc)[key] = value
    return doc


def _set_fields(doc: dict[str, Any], **values: Any) -> dict[str, Any]:
    _first_call(doc).update(values)
    return doc


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_each_malformed_field_is_refused_with_one_line(saved, case):
    _, doc = saved
    change, fragment = MALFORMED[case]
    bad = change(copy.deepcopy(doc))
    data = gzip.compress(json.dumps(bad).encode())
    with pytest.raises(RecordError) as err:
        CompareRecord.from_bytes(data, "r.json.gz")
    message = str(err.value)
    assert fragment in message and "\n" not in message and message.startswith("r.json.gz")


def test_damaged_files_are_refused_with_one_line(saved):
    path, doc = saved
    good = Path(path).read_bytes()
    nan_literal = gzip.compress(json.dumps(doc).replace('"nonfinite": 0', '"nonfinite": NaN', 1).encode())
    middle = len(good) // 2
    cases = {
        "truncated": (good[: len(good) - 100], "truncated"),
        "corrupt": (
            good[:middle] + bytes(b ^ 0xFF for b in good[middle : middle + 64]) + good[middle + 64 :],
            "corrupt",
        ),
        "trailing": (good + b"garbage", "data after its gzip stream"),
        "empty": (b"", "empty"),
        "text": (b"hello world\n", "not a compare record"),
        "NaN literal": (nan_literal, "not valid JSON"),
        "bad JSON": (b"{not json", "not valid JSON"),
        "deep JSON": (b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}", "nested too deep"),
        # 200 KB that would unpack to 200 MB: stopped at 64 MiB, before it fills the memory
        "gzip bomb": (gzip.compress(b"{" + b" " * (200 * 2**20) + b"}"), "unpacks to more than 64 MiB"),
    }
    for name, (data, fragment) in cases.items():
        with pytest.raises(RecordError) as err:
            CompareRecord.from_bytes(data, "r.json.gz")
        assert fragment in str(err.value) and "\n" not in str(err.value), name


def test_saving_is_atomic_and_honours_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = tmp_path / "a.json.gz"
        fpdoctor.compare(mlp(), torch.randn(4, 64), candidate="bf16", save_reference=path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json.gz"]  # no temporary file left
        path.chmod(0o600)  # an existing file keeps its mode
        fpdoctor.compare(mlp(), torch.randn(4, 64), candidate="bf16", save_reference=path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        fpdoctor.compare(mlp(), torch.randn(4, 64), candidate="bf16", save_reference=os.devnull)  # written through
        assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    finally:
        os.umask(old)


# -- settings ----------------------------------------------------------------------------------


def test_settings_come_from_the_record(saved, tmp_path):
    path, _ = saved
    torch.manual_seed(1)
    x = torch.randn(16, 64)
    result = fpdoctor.compare(mlp(), x, against=path, candidate="half")  # fp16 by another name is fine
    assert result.report.data["summary"][0][0] == "candidate / floor model"
    assert result.report.data["summary"][0][1].startswith("fp16 / fp32: every error is measured against fp64")
    with pytest.raises(ValueError, match=r"the record was made with --candidate fp16, not bf16: omit --candidate"):
        fpdoctor.compare(mlp(), x, against=path, candidate="bf16")
    with pytest.raises(ValueError, match="made with --reference fp32, not fp64"):
        fpdoctor.compare(mlp(), x, against=path, reference="fp64")
    with pytest.raises(ValueError, match="made with the whole model, not --module up"):
        fpdoctor.compare(mlp(), x, against=path, module="up")
    with pytest.raises(ValueError, match="exclude each other"):
        fpdoctor.compare(mlp(), x, against=path, save_reference=tmp_path / "b.json.gz")
    with pytest.raises(ValueError, match="does not exist; create it"):
        fpdoctor.compare(mlp(), x, save_reference=tmp_path / "missing" / "b.json.gz")
    with pytest.raises(TypeError, match="path or a CompareRecord"):
        fpdoctor.compare(mlp(), x, against=42)
    # without a candidate a record is of fp32; a plain compare stays fp16
    made = fpdoctor.compare(mlp(), x, save_reference=tmp_path / "c.json.gz")
    assert CompareRecord.load(tmp_path / "c.json.gz").settings.candidate == "fp32"
    assert made.report.data["record"]["calls"] == 5
    assert fpdoctor.compare(mlp(), x).report.data["summary"][0][1].startswith("fp16 /")


def test_a_submodule_record_names_modules_in_the_whole_model(tmp_path):
    model, x = machines.machine_a()
    path = tmp_path / "attn.json.gz"
    fpdoctor.compare(model, x, candidate="fp16", module="attn", save_reference=path)
    record = CompareRecord.load(path)
    assert record.settings.module == "attn"
    assert {c.module for c in record.sets[0].calls} == {"attn", "attn.q", "attn.k", "attn.v", "attn.out"}
    assert set(record.weights) == {"attn.q", "attn.k", "attn.v", "attn.out"}
    b_model, _ = machines.fp16_accumulate()
    result = fpdoctor.compare(b_model, x, against=record)  # the module comes from the record
    assert [f.where["module"] for f in result.report.by_name("machine-departure")] == ["attn"]


# -- the judgement, in process (the CLI tests run the two machines in two processes) ----------


def test_same_model_same_machine_agrees(tmp_path):
    path = tmp_path / "a.json.gz"
    model, x = machines.machine_a()
    fpdoctor.compare(model, x, candidate="fp16", save_reference=path)
    result = fpdoctor.compare(*machines.machine_a(), against=path)
    assert result.report.verdict == "ok" and not result.report.findings
    sets = result.report.data["against"]["sets"]
    assert sets[0]["judged"] and sets[0]["first_departure"] is None and sets[0]["computation_differs_at"] is None
    assert all(m["same_computation"] and not m["departs"] for m in sets[0]["modules"])
    assert dict(result.report.data["summary"])["B against A"].startswith("no module departs")


def test_several_input_sets_are_each_recorded_and_judged(tmp_path):
    path = tmp_path / "a.json.gz"
    model, sets = machines.several_sets()
    fpdoctor.compare(model, sets, candidate="fp16", save_reference=path)
    record = CompareRecord.load(path)
    assert len(record.sets) == 2 and record.sets[0].inputs["digest"] != record.sets[1].inputs["digest"]
    assert fpdoctor.compare(machines.build(), sets, against=path).report.verdict == "ok"
    fewer = fpdoctor.compare(machines.build(), sets[:1], against=path)
    finding = fewer.report.by_name("reference-inputs-differ")[0]
    assert "the record has 2 input set(s), this run 1" in finding.message and finding.evidence["input_sets"] == [1]
    departing = fpdoctor.compare(machines.build(fp16_accumulate=True), sets, against=path)
    found = departing.report.by_name("machine-departure")
    assert [f.where["module"] for f in found] == ["attn"] and found[0].evidence["input_set"] == 0


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + 0.1 * torch.randn_like(x))


def test_random_draws_of_the_forward_are_part_of_the_inputs(tmp_path):
    path = tmp_path / "a.json.gz"
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 16)
    torch.manual_seed(5)
    fpdoctor.compare(model, x, candidate="bf16", save_reference=path)
    assert CompareRecord.load(path).sets[0].noise is not None
    torch.manual_seed(5)
    assert not fpdoctor.compare(model, x, against=path).report.findings
    torch.manual_seed(6)
    finding = fpdoctor.compare(model, x, against=path).report.by_name("reference-inputs-differ")[0]
    assert "random numbers the forward draws itself differ" in finding.message


def _call(module: str, truth: list[float], cand: list[float], *, leaf: bool = True, **numbers: Any) -> CallRecord:
    t = torch.tensor(truth, dtype=torch.float64)
    c = torch.tensor(cand, dtype=torch.float32)
    values: dict[str, Any] = {"floor": 1e-3, "propagated": 1e-3, "isolated": 1e-3, "reference": 1e-4, "nonfinite": 0}
    values |= numbers
    return CallRecord(module=module, call=0, leaf=leaf, numel=t.numel(), norm=l2_norm(t), truth=t, candidate=c,
                      **values)  # fmt: skip


def _record(calls: list[CallRecord], weights: dict[str, str] | None = None, gpu: str = "A") -> CompareRecord:
    inputs = {"tensors": [{"name": "inputs[0]", "shape": [2], "dtype": "float32"}], "digest": "0123456789ab"}
    return CompareRecord(
        settings=Settings("fp16"),
        machine={"gpu": gpu, "capability": "8.0", "tf32_matmul": gpu == "B"},
        weights=weights or {"a": "00000000", "b": "00000000", "c": "00000000"},
        sets=(SetRecord(inputs, None, tuple(calls)),),
    )


def test_departure_is_judged_against_the_floor_and_the_error_carried_in():
    base = [1.0, 2.0, 3.0]
    norm = l2_norm(torch.tensor(base, dtype=torch.float64))
    limit = DIVERGENCE_RATIO * 1e-3  # floor and propagated are both 1e-3
    near = [1.0, 2.0, 3.0 + 0.5 * limit * norm]
    far = [1.0, 2.0, 3.0 + 4 * limit * norm]
    a = _record([_call("a", base, base), _call("b", base, base), _call("c", base, base)])
    b = _record([_call("a", base, near), _call("b", base, far, isolated=0.1), _call("c", base, far)], gpu="B")
    j = against.judge(a, b)
    rows = j.sets[0].rows
    assert not rows[0].departs and rows[0].ratio == pytest.approx(0.5, rel=1e-3)
    assert rows[1].departs and j.sets[0].departure is rows[1] and j.sets[0].blamed == "b"
    assert j.facts_differ == ["gpu", "tf32_matmul"]
    # deep in a model both runs carry more error: the limit grows with the smaller one
    b2 = _record([_call("a", base, base), _call("b", base, far, propagated=1.0), _call("c", base, base)])
    a2 = _record([_call("a", base, base), _call("b", base, base, propagated=0.5), _call("c", base, base)])
    assert not against.judge(a2, b2).sets[0].rows[1].departs


def test_nonfinite_on_one_side_departs_on_both_does_not():
    base = [1.0, 2.0]
    bad = [math.nan, 2.0]
    a = _record([_call("a", base, base), _call("b", base, bad, nonfinite=1, propagated=math.inf)])
    b = _record([_call("a", base, bad, nonfinite=1, propagated=math.inf), _call("b", base, bad, nonfinite=1)])
    rows = against.judge(a, b).sets[0].rows
    assert rows[0].departs and math.isinf(rows[0].departure)
    assert rows[1].departure is None and not rows[1].departs


def test_a_leaf_departing_through_its_inputs_names_its_container():
    base = [1.0, 2.0]
    bad = [math.inf, 2.0]
    calls_a = [_call("attn.q", base, base), _call("attn.out", base, base), _call("attn", base, base, leaf=False)]
    b_out = _call("attn.out", base, bad, nonfinite=1, propagated=math.inf, isolated=1.1e-3)
    calls_b = [_call("attn.q", base, base), b_out, _call("attn", base, bad, leaf=False, nonfinite=1)]
    j = against.judge(_record(calls_a), _record(calls_b))
    assert j.sets[0].departure.module == "attn.out" and j.sets[0].blamed == "attn"
    # B's copy of the leaf departs by itself too: the leaf is named
    b_out_alone = _call("attn.out", base, bad, nonfinite=1, propagated=math.inf, isolated=math.inf)
    j = against.judge(_record(calls_a), _record([calls_b[0], b_out_alone, calls_b[2]]))
    assert j.sets[0].blamed == "attn.out"


def test_judging_stops_where_the_computations_part():
    base = [1.0, 2.0]
    other = [1.0, 2.0 + 1e-6]
    far = [5.0, 9.0]
    a = _record([_call("a", base, base), _call("b", base, base), _call("c", base, base)])
    b = _record([_call("a", base, base), _call("b", other, other), _call("c", far, far)])
    s = against.judge(a, b).sets[0]
    assert s.parted is s.rows[1] and s.parted_by_weights == [] and s.departure is None
    finding = against_report.findings(against.judge(a, b))
    assert [(f.name, f.where["module"]) for f in finding] == [("reference-computation-differs", "b")]
    # fp64 differing by summation order only (1e-13) is the same computation
    tiny = [1.0, 2.0 * (1 + 1e-13)]
    assert against.judge(a, _record([_call("a", tiny, tiny), *b.sets[0].calls[1:]])).sets[0].rows[0].same_computation
    # changed weights of the module, or of a container around it, explain the parting
    weights = {"a": "00000000", "b": "11111111", "c": "00000000"}
    assert against.judge(a, _record(list(b.sets[0].calls), weights)).sets[0].parted_by_weights == ["b"]
    around = _record(list(a.sets[0].calls), {"": "00000000"})
    assert against.judge(around, _record(list(b.sets[0].calls), {"": "22222222"})).sets[0].parted_by_weights == [""]


def test_modules_only_one_run_has_are_named():
    base = [1.0, 2.0]
    a = _record([_call("a", base, base), _call("b", base, base)])
    b = _record([_call("a", base, base), _call("extra", base, base), _call("b", base, base)])
    findings = against_report.findings(against.judge(a, b))
    structure = [f for f in findings if f.evidence.get("kind") == "structure"]
    assert (
        structure
        and structure[0].evidence["only_b"] == ["extra"]
        and "only machine B runs `extra`" in (structure[0].message)
    )


# -- size ------------------------------------------------------------------------------------------


def test_record_size_is_bounded_per_module_call(tmp_path):
    """A call whose output is below 2 x SAMPLE elements is sampled whole by compare; the record
    keeps at most SAMPLE of its values."""
    torch.manual_seed(0)
    # 129 x 127 = 16383 values; 48 features in, 64 classes out (an output of its input's shape is no logits)
    model = nn.Sequential(nn.Linear(48, 127), nn.GELU(), nn.Linear(127, 64))
    path = tmp_path / "a.json.gz"
    fpdoctor.compare(model, torch.randn(129, 48), candidate="fp32", save_reference=path)
    record = CompareRecord.load(path)
    assert [c.truth.numel() for c in record.sets[0].calls] == [SAMPLE, SAMPLE, SAMPLE, SAMPLE]
    # the output is logits (a Linear to 64 classes): its decisions too, 129 rows of 2 + 5 classes and all
    # 129 x 64 logits whole (fp64 and fp32), as base64
    decisions = record.sets[0].decisions
    assert isinstance(decisions, DecisionRecord) and (decisions.decided, decisions.kept) == (129, 129)
    assert path.stat().st_size <= PER_CALL * record.calls + 4 / 3 * (129 * 7 * 4 + 129 * 64 * 12)


def test_minilm_record_size(tmp_path):
    tokenizer, model = load_minilm()
    text = "Half precision overflows above 65504, and the first NaN is where the doctor looks. " * 3
    batch = dict(tokenizer([text] * 4, return_tensors="pt", padding=True))
    path = tmp_path / "minilm.json.gz"
    result = fpdoctor.compare(model, batch, candidate="fp16", save_reference=path)
    record = CompareRecord.load(path)
    size = path.stat().st_size
    assert record.calls == len(result.rows) > 50
    assert max(c.truth.numel() for c in record.sets[0].calls) == SAMPLE  # the largest outputs reach the cap
    assert size <= PER_CALL * record.calls, (size, record.calls)
    assert size < 12 * 2**20  # README: about 9 MiB for MiniLM's 100 module calls
    assert not fpdoctor.compare(model, batch, against=record).report.findings


# -- renderings ------------------------------------------------------------------------------------


def test_against_report_in_every_format(tmp_path):
    path = tmp_path / "a.json.gz"
    model, x = machines.machine_a()
    fpdoctor.compare(model, x, candidate="fp16", save_reference=path)
    model, x = machines.fp16_accumulate()
    report = fpdoctor.compare(model, x, against=path).report
    doc = strict_json(render(report.to_dict(), "json"))
    departure = next(f for f in doc["findings"] if f["name"] == "machine-departure")
    assert departure["code"] == "NUM011" and departure["where"]["module"] == "attn"
    assert departure["evidence"]["kind"] == "nan" and departure["evidence"]["departure_rel"] == "inf"
    assert departure["evidence"]["departing_module"] == "attn.out" and departure["evidence"]["b_nonfinite"] > 0
    assert doc["data"]["table"]["columns"][1:3] == ["A propagated", "B propagated"]
    assert doc["data"]["against"]["sets"][0]["first_departure"] == "attn"
    text = render(report.to_dict(), "text")
    assert "NUM011 machine-departure" in text and "B against A" in text and "departs first at `attn`" in text
    markdown = render(report.to_dict(), "markdown")
    assert "| module | A propagated | B propagated |" in markdown and "`machine-departure`" in markdown
    page = render(report.to_dict(), "html")
    assert "machine-departure" in page and "B propagated" in page and "<script src=" not in page


def test_environment_differences_stand_beside_the_first_departing_module():
    """Two records whose machine facts differ in one fact: the departure names that fact, from
    `fpdoctor env --diff`'s table, in its message and evidence, and the report's data holds it."""
    base = [1.0, 2.0, 3.0]
    norm = l2_norm(torch.tensor(base, dtype=torch.float64))
    far = [1.0, 2.0, 3.0 + 4 * DIVERGENCE_RATIO * 1e-3 * norm]
    a = _record([_call("a", base, base), _call("b", base, base), _call("c", base, base)], gpu="A")
    b = _record([_call("a", base, base), _call("b", base, far, isolated=0.1), _call("c", base, far)], gpu="A")
    a.machine.update({"tf32_matmul": False, "env:NVIDIA_TF32_OVERRIDE": None})
    b.machine.update({"tf32_matmul": False, "env:NVIDIA_TF32_OVERRIDE": "0"})
    j = against.judge(a, b)
    assert [d["key"] for d in j.env_differences] == ["env.NVIDIA_TF32_OVERRIDE"]
    assert j.env_differences[0]["a"] == "unset" and j.env_differences[0]["b"] == "0"
    assert j.env_differences[0]["severity"] == "error"
    [finding] = against_report.findings(j)
    assert finding.name == "machine-departure" and finding.where["module"] == "b"
    assert "NVIDIA_TF32_OVERRIDE unset / 0 (error)" in finding.message
    assert [d["key"] for d in finding.evidence["env_differences"]] == ["env.NVIDIA_TF32_OVERRIDE"]
    assert "export NVIDIA_TF32_OVERRIDE" not in finding.fix and "unset NVIDIA_TF32_OVERRIDE" in finding.fix
    data = against_report.as_data(j, "a.json")
    assert [d["key"] for d in data["environment"]["differences"]] == ["env.NVIDIA_TF32_OVERRIDE"]
    # a flag differs instead: that one, with the line that sets it
    b.machine.update({"tf32_matmul": True, "env:NVIDIA_TF32_OVERRIDE": None})
    j = against.judge(a, b)
    assert [d["key"] for d in j.env_differences] == ["flag.matmul_tf32"]
    assert "TF32 matmul (torch.backends.cuda.matmul.allow_tf32) false / true (error)" in (
        against_report.findings(j)[0].message
    )
    # records made before the variables were recorded: unknown, never a difference
    for record in (a, b):
        del record.machine["env:NVIDIA_TF32_OVERRIDE"]
    b.machine.update({"tf32_matmul": False})
    assert against.judge(a, b).env_differences == []


def test_a_record_keeps_the_variables_that_change_math(tmp_path, monkeypatch):
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")
    monkeypatch.setenv("CUBLASLT_HEURISTICS_CACHE_CAPACITY", "0")
    monkeypatch.setenv("CUBLASLT_LOG_LEVEL", "5")
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    path = str(tmp_path / "a.json.gz")
    torch.manual_seed(1)
    fpdoctor.compare(mlp(), torch.randn(4, 64), candidate="fp16", save_reference=path)
    recorded = CompareRecord.load(path).machine
    assert recorded["env:NVIDIA_TF32_OVERRIDE"] == "0" and recorded["env:NCCL_ALGO"] is None
    assert recorded["env:CUBLASLT_HEURISTICS_CACHE_CAPACITY"] == "0"
    assert "env:CUBLASLT_LOG_LEVEL" not in recorded  # logging changes no number
