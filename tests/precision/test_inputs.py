"""Several input sets judged (a sampler at several timesteps), and the inputs named in every report."""

from __future__ import annotations

import pytest
import torch

import fpdoctor
from fpdoctor.precision.inputs import describe, input_sets
from tests.conftest import ROOT, run_fpdoctor
from tests.precision import factories


def test_compare_judges_every_set_and_names_the_worst():
    model, sets = factories.sampler()
    result = fpdoctor.compare(model, sets, candidate="fp16")
    # before: a list was taken as one positional argument, and the forward failed
    assert result.input_sets == 3 and result.worst_set == 2  # only t=999 overflows
    assert result.first_divergent == "net.0"
    summary = dict(result.report.data["summary"])
    assert summary["input sets judged"].startswith("3; worst: #2, inputs[0] float32[8, 64], inputs[1] int64[8]")
    assert "first divergent: none" in summary["  set #0"] and "first divergent: net.0" in summary["  set #2"]
    per_set = result.report.data["inputs"]
    assert [s["verdict"] for s in per_set] == ["ok", "ok", "error"]
    assert len({s["digest"] for s in per_set}) == 3
    assert result.report.by_name("precision-divergence")[0].evidence["input_set"] == 2


def test_each_sets_line_gives_its_decisions_not_only_the_worst_sets():
    """A retrieval model judged on short and long inputs: the set with the worst error need not be the one
    whose decisions move most, so each set's line gives its top-1 beside its error."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10)).eval()
    sets = [(torch.randn(40, 16),), (torch.randn(200, 16),)]
    result = fpdoctor.compare(model, sets, candidate="bf16")
    summary = dict(result.report.data["summary"])
    for k in (0, 1):
        assert "; top-1 " in summary[f"  set #{k}"] and "(rounding: " in summary[f"  set #{k}"], summary
        assert 0.0 <= result.report.data["inputs"][k]["top1"] <= 1.0


def test_plan_holds_on_every_set_and_takes_a_generator():
    model, sets = factories.sampler()
    result = fpdoctor.plan(
        model, (s for s in sets), candidate="fp16", metric="rel"
    )  # its logits are NaN: KL by default
    assert result.plan.verified and "net.0" in result.plan.keep_fp32
    summary = dict(result.report.data["summary"])
    assert summary["input sets judged"].startswith("3; worst without exceptions: #2")
    assert summary["  set #2"].startswith("without exceptions non-finite; with the plan ")
    applied, _ = factories.sampler()
    fpdoctor.apply_plan(applied, result.plan)
    for x, t in sets:  # the plan holds at every timestep, on the fp32 inputs the sampler has
        assert torch.isfinite(applied(x, t)).all()


def test_one_set_is_named_by_shapes_dtypes_and_digest():
    model, x = factories.overflow_attention()
    result = fpdoctor.compare(model, x, candidate="bf16")
    assert result.input_sets == 1
    assert result.report.data["inputs"][0]["tensors"] == [
        {"name": "inputs[0]", "shape": [4, 32, 64], "dtype": "float32"}
    ]
    digest = result.report.data["inputs"][0]["digest"]
    assert dict(result.report.data["summary"])["inputs"] == f"inputs[0] float32[4, 32, 64] (digest {digest})"
    assert describe(x.clone())["digest"] == digest and describe(x + 1)["digest"] != digest
    audited = fpdoctor.audit(model, {"x": x}).report
    assert dict(audited.data["summary"])["inputs"].startswith("inputs['x'] float32[4, 32, 64]")


def test_what_counts_as_one_set_or_several():
    x = torch.ones(2)
    assert input_sets(x) == [x]
    assert len(input_sets((x, x))) == 1 and len(input_sets({"a": x})) == 1  # positional / keyword arguments
    assert len(input_sets([x, (x, x)])) == 2 and len(input_sets(iter([x, x, x]))) == 3
    assert input_sets(([x, x],)) == [([x, x],)]  # a model whose one argument is a list
    with pytest.raises(ValueError, match="inputs is an empty list"):
        input_sets([])


def test_the_cli_judges_every_set_the_factory_returns():
    result = run_fpdoctor(
        "compare",
        "tests.precision.factories:sampler",
        "--candidate",
        "fp16",
        "--format",
        "json",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert result.code == 1, result.err
    doc = factories.loads_strict(result.out)
    assert doc["data"]["worst_input_set"] == 2 and len(doc["data"]["inputs"]) == 3
    result = run_fpdoctor(
        "plan", "tests.precision.factories:sampler", "--candidate", "fp16", env={"PYTHONPATH": str(ROOT)}
    )
    assert result.code == 0, result.err
    assert "worst without exceptions: #2" in result.out
