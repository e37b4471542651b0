"""compare --against judges an output of logits by what it decides, as compare does: the record
keeps, per row, the fp64 output's class and the candidate's best classes, and whole rows for KL
(record.DecisionRecord); machine B's candidate is judged against A's fp64 output beside A's own.

Machine A and machine B are two runs of tests/fixtures/record/machines.py's classifier, the record
crossing between them as a file: on B the head's GEMM keeps its running sum in fp16, which keeps
the relative error at 7.0e-6, as A's, and changes 28% of the rows' classes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

import fpdoctor
from fpdoctor.precision.record import against, against_report, record, recording
from fpdoctor.precision.record.record import CompareRecord, DecisionRecord, SetRecord
from fpdoctor.report.model import Report
from tests.fixtures.record import machines
from tests.precision.test_record import _call, _record


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Machine A's record of the classifier in fp16."""
    path = tmp_path_factory.mktemp("a") / "a.json.gz"
    result = fpdoctor.compare(*machines.classifier_a(), candidate="fp16", save_reference=path)
    assert result.report.verdict == "ok"  # A's kernel keeps every row's decision
    return path


def _departures(result: fpdoctor.CompareResult) -> list[dict]:
    return [m for m in result.report.data["against"]["sets"][0]["modules"] if m["departs"]]


def test_the_record_keeps_each_rows_decision(made):
    rec = CompareRecord.load(made)
    assert rec.version == record.VERSION == 2
    d = rec.sets[0].decisions
    assert isinstance(d, DecisionRecord) and d.source == "logits of `head` (Linear 256 -> 100)"
    assert (d.rows, d.classes, d.decided, d.kept) == (1024, 100, 1024, 1024)  # 1024 x 100 <= KEPT_VALUES
    model, x = machines.classifier_a()
    with torch.no_grad():
        exact = model.double()(x.double())
    assert torch.equal(d.truth_top1, exact.argmax(-1).to(torch.int32))
    assert torch.equal(d.truth_rows, exact)
    assert d.candidate_topk.shape == (1024, 5) and torch.equal(d.candidate_topk[:, 0], d.candidate_top1)
    assert d.floor_top1 == 1.0 and 0 < d.floor_kl < 1e-9


def test_machine_b_that_keeps_its_error_but_loses_top1_is_never_ok(made):
    result = fpdoctor.compare(*machines.classifier_fp16_accumulate(), against=made)
    report = result.report
    # by relative error alone, B is A: no module departs, the output's error is 7.0e-6
    assert not _departures(result) and not report.by_name("machine-departure")
    assert result.rows[-1].propagated < 1e-5
    assert report.verdict == "error"
    (finding,) = report.by_name("decisions-changed")
    use = finding.evidence["against"]
    assert use["changed"] and use["departs"]
    assert use["b"]["top1"] == pytest.approx(0.718, abs=1e-3) and use["a"]["top1"] == use["b"]["floor_top1"] == 1.0
    assert use["b"]["kl"] > 1e5 * use["a"]["floor_kl"]
    assert "Against the record's fp64 output (machine A)" in finding.message and "A's run keeps them" in finding.message
    summary = dict(report.data["summary"])
    assert (
        "its decisions depart from A's: top-1 agreement with A's fp64 output 71.8% here, 100.0% in A's run"
        in (summary["B against A"])
    )
    line = summary["decisions against A's fp64"]
    assert line.startswith(
        "logits of `head` (Linear 256 -> 100): this machine's top-1 agreement 71.8%, A's run 100.0% (rounding A's "
        "fp64 output to fp16: 100.0%); top-5 99.1% / 100.0% over 1024 rows of 100; KL 0.00148 / "
    )
    # A's own KL is fp16's rounding of fp64 logits: its third digit moves with the CPU's kernels
    assert float(line.split("KL 0.00148 / ")[1].split(" ")[0]) == pytest.approx(2.7e-9, rel=0.05), line
    assert report.data["against"]["sets"][0]["decisions"] == use
    # the same figures as this run's own compare against its own fp64: the two fp64 outputs agree
    assert use["b"]["top1"] == report.data["decisions"]["top1"]


def test_machine_a_against_its_own_record_decides_the_same(made):
    result = fpdoctor.compare(*machines.classifier_a(), against=made)
    assert result.report.verdict == "ok" and not result.report.findings
    use = result.report.data["against"]["sets"][0]["decisions"]
    assert use["b"] == use["a"] and not use["changed"] and not use["departs"]
    assert dict(result.report.data["summary"])["B against A"].startswith("no module departs")


def test_without_this_runs_own_finding_the_record_alone_makes_it(made, tmp_path):
    """This run's compare judges its own fp64 too; where it did not find the decisions changed,
    the judgement against the record adds the finding, its fix untried here."""
    mine = tmp_path / "b.json.gz"
    b = fpdoctor.compare(*machines.classifier_fp16_accumulate(), candidate="fp16", save_reference=mine)
    j = against.judge(CompareRecord.load(made), CompareRecord.load(mine))
    report = Report(command="compare", findings=[f for f in b.report.findings if f.name != "decisions-changed"],
                    data=b.report.data)  # fmt: skip
    against_report.apply(report, j, source=str(made))
    (finding,) = report.by_name("decisions-changed")
    assert finding.where["module"] == "head" and finding.severity == "error"
    assert finding.message.startswith("In fp16, this machine's output's top-1 class differs from the record's fp64")
    assert finding.trial is not None and not finding.trial.tried
    assert finding.evidence["decisions"]["top1"] == pytest.approx(0.718, abs=1e-3)


def _older(path: Path, target: Path) -> Path:
    """The record as fpdoctor wrote it before decisions were kept: format 1, no `decisions`."""
    doc = json.loads(gzip.decompress(path.read_bytes()))
    doc["version"] = 1
    for s in doc["sets"]:
        del s["decisions"]
    target.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return target


def test_an_older_record_still_judges_and_says_why_decisions_are_not(made, tmp_path):
    old = _older(made, tmp_path / "old.json.gz")
    rec = CompareRecord.load(old)
    assert rec.version == 1 and rec.sets[0].decisions is None
    same = fpdoctor.compare(*machines.classifier_a(), against=old)
    assert same.report.verdict == "ok"
    why = same.report.data["against"]["sets"][0]["decisions_not_judged"]
    assert why.startswith("the record is of format 1 (made by fpdoctor") and "make the record again" in why
    assert dict(same.report.data["summary"])["decisions against A's fp64"] == f"not judged: {why}"
    # modules are judged as before, and this run's own compare still judges the decisions
    b = fpdoctor.compare(*machines.classifier_fp16_accumulate(), against=old)
    assert b.report.data["against"]["sets"][0]["judged"] and not _departures(b)
    (finding,) = b.report.by_name("decisions-changed")
    assert b.report.verdict == "error" and "against" not in finding.evidence


def test_decisions_are_bounded_and_read_back(monkeypatch):
    """DECIDED_ROWS rows (evenly spread, first and last) and KEPT_VALUES logits whole, at most."""
    monkeypatch.setattr(record, "DECIDED_ROWS", 8)
    monkeypatch.setattr(record, "KEPT_VALUES", 18)  # 3 rows of 6 classes
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(4, 5, 6, generator=g, dtype=torch.float64)  # 20 rows
    cand = (truth + 0.3 * torch.randn(4, 5, 6, generator=g, dtype=torch.float64)).half()
    d = recording.decision_record("logits of `head` (Linear 3 -> 6)", truth, cand, "fp16")
    assert isinstance(d, DecisionRecord) and (d.rows, d.classes, d.decided, d.kept) == (20, 6, 8, 3)
    rows = torch.tensor([0, 2, 5, 8, 10, 13, 16, 19])  # 8 of 20, integer arithmetic
    assert torch.equal(record.spread(20, 8), rows)
    assert torch.equal(d.truth_top1, truth.reshape(20, 6)[rows].argmax(-1).int())
    assert torch.equal(d.candidate_top1, cand.reshape(20, 6)[rows].double().argmax(-1).int())
    assert torch.equal(d.truth_rows, truth.reshape(20, 6)[rows[[0, 3, 7]]])  # 3 of the 8, spread the same way
    again = CompareRecord.from_bytes(_record([_call("head", [1.0, 2.0], [1.0, 2.0])]).to_bytes())  # no decisions
    assert again.sets[0].decisions is None
    base = _record([_call("head", [1.0, 2.0], [1.0, 2.0])])
    doc = CompareRecord(base.settings, base.machine, base.weights, (SetRecord(base.sets[0].inputs, None,
                        base.sets[0].calls, d),))  # fmt: skip
    read = CompareRecord.from_bytes(doc.to_bytes()).sets[0].decisions
    assert isinstance(read, DecisionRecord)
    for name in ("truth_top1", "candidate_top1", "candidate_topk", "truth_rows", "candidate_rows"):
        assert torch.equal(getattr(read, name), getattr(d, name)), name
    assert (read.floor_top1, read.floor_kl) == (d.floor_top1, d.floor_kl)
    nan = recording.decision_record("logits", truth, cand.masked_fill(cand > 2, float("nan")), "fp16")
    assert nan == "the candidate's logits hold NaN or Inf"


def test_the_default_bound_on_a_large_output():
    assert (record.decided_rows(10**6), record.kept_rows(10**6, 1000)) == (2**15, 131)
    assert record.kept_rows(4, 200_000) == 1  # one row at least, when a row alone is longer
