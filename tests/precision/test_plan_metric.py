"""plan --metric kl|top1|rel: the plan's target, its what-if ranking and its check in one metric.

On the classifier and the language model whose bf16 run keeps 55 dB SQNR and loses top-1 (built in
test_compare_decisions.py), a plan judged by the relative error keeps nothing: the error is within 16x
its floor. Judged by KL or top-1 it names the modules that give the decisions back (the features'
last leaf and the logits' layer, fp32 between them), checks them in the same metric, and applied as
printed (apply_plan, or the code it writes) the decisions come back.
"""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

import fpdoctor
from fpdoctor.precision.plan.metric import metric as plan_metric
from tests.conftest import run_fpdoctor
from tests.precision.test_compare_decisions import _classifier, _lm, _top1

ROOT = str(pathlib.Path(__file__).resolve().parents[2])
CASES = [
    pytest.param(_classifier, ["body.1", "head"], id="classifier"),
    pytest.param(_lm, ["lm_head", "norm"], id="language-model"),
]


def _exact(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double() if x.is_floating_point() else x)


@pytest.mark.parametrize("metric", ["kl", "top1"])
@pytest.mark.parametrize(("make", "expected"), CASES)
def test_a_decisions_plan_names_the_modules_that_give_the_decisions_back_checked_and_applied(make, expected, metric):
    model, x = make()
    result = fpdoctor.plan(model, x, candidate="bf16", metric=metric)
    the_plan = result.plan
    assert the_plan.metric == metric and the_plan.verified, str(result.report)
    assert sorted(the_plan.keep_fp32) == expected
    assert the_plan.final_error <= the_plan.target < the_plan.baseline_error
    # the what-ifs are ranked by the metric, and the pair leads them
    what_if = result.report.data["what_if"]
    assert what_if == sorted(what_if, key=lambda w: w["value"]) and sorted(what_if[0]["modules"]) == sorted(
        the_plan.keep_fp32
    )
    # compare's decisions finding, under the plan: a warning, checked by top-1 on the plan's own runs
    (decisions,) = result.report.by_name("decisions-changed")
    assert decisions.severity == "warning" and decisions.trial is not None and decisions.trial.tried
    assert decisions.trial.metric == "top-1 agreement with fp64"
    before, after = (float(str(v).rstrip("%")) for v in (decisions.trial.before, decisions.trial.after))
    assert before < 90 and after > 98
    # every other fix the plan prints is checked in the plan's metric
    for f in result.report.by_name("precision-divergence"):
        assert f.trial is not None and f.trial.metric == plan_metric(metric).title

    exact = _exact(model, x)
    applied = fpdoctor.apply_plan(copy.deepcopy(model), the_plan)
    assert _top1(applied, x, exact) > 0.98
    pasted = copy.deepcopy(model)
    exec(the_plan.to_code(), {"model": pasted})
    assert _top1(pasted, x, exact) > 0.98
    plain = copy.deepcopy(model).to(torch.bfloat16)
    assert _top1(plain, x.to(torch.bfloat16) if x.is_floating_point() else x, exact) < 0.9


def test_the_default_is_kl_where_compare_finds_the_decisions_changed() -> None:
    model, x = _classifier()
    result = fpdoctor.plan(model, x, candidate="bf16")
    assert result.plan.metric == "kl" and sorted(result.plan.keep_fp32) == ["body.1", "head"]
    assert (
        "the default where compare finds the logits' decisions changed"
        in dict(result.report.data["summary"])["plan metric"]
    )
    healthy, y = _classifier(offset=0.0)  # logits whose decisions hold: the relative error, as before
    assert fpdoctor.plan(healthy, y, candidate="bf16").plan.metric == "rel"
    # a tolerance without a metric is a relative error, as it always was
    assert fpdoctor.plan(model, x, candidate="bf16", tolerance=0.1).plan.metric == "rel"


def test_rel_keeps_todays_plan_and_leaves_the_decisions_finding_an_error() -> None:
    model, x = _classifier()
    result = fpdoctor.plan(model, x, candidate="bf16", metric="rel")
    assert result.plan.metric == "rel" and result.plan.verified and result.plan.keep_fp32 == []
    (decisions,) = result.report.by_name("decisions-changed")
    assert decisions.severity == "error" and result.report.exit_code == 1
    assert "what_if" in result.report.data and result.report.data["what_if"] == []


def test_a_decisions_metric_needs_logits_and_a_tolerance_in_its_units() -> None:
    encoder = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)).eval()
    with pytest.raises(ValueError, match="not logits"):
        fpdoctor.plan(encoder, torch.randn(8, 16), candidate="bf16", metric="kl")
    model, x = _classifier()
    with pytest.raises(ValueError, match="between 0 and 1"):
        fpdoctor.plan(model, x, candidate="bf16", metric="top1", tolerance=2.0)
    with pytest.raises(ValueError, match="one of kl, top1, rel"):
        fpdoctor.plan(model, x, candidate="bf16", metric="f1")


def test_plan_cli_metric_top1_and_bad_values(tmp_path) -> None:
    env = {"PYTHONPATH": ROOT}
    spec = "tests.precision.test_compare_decisions:_classifier"
    result = run_fpdoctor("plan", spec, "--candidate", "bf16", "--metric", "top1", "--format", "json", env=env)
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["data"]["plan"]["metric"] == "top1" and sorted(report["data"]["plan"]["keep_fp32"]) == [
        "body.1",
        "head",
    ]
    for args in (["--metric", "f1"], ["--metric", "top1", "--tolerance", "5"]):
        bad = run_fpdoctor("plan", spec, "--candidate", "bf16", *args, env=env)
        assert bad.code == 2 and len(bad.err.strip().splitlines()) == 1 and "Traceback" not in bad.err, bad.err
    tiny = tmp_path / "tiny.py"
    tiny.write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), "
        "torch.randn(4, 8)\n"
    )
    bad = run_fpdoctor("plan", f"{tiny}:make", "--candidate", "bf16", "--metric", "kl", env=env)
    assert bad.code == 2 and "not logits" in bad.err and len(bad.err.strip().splitlines()) == 1, bad.err


class _Sharpened(torch.nn.Module):
    """A retrieval scorer with a learned temperature that ended up tiny (logits of ~1e3, margins of ~1): a
    KL target read from its floor (256x the KL of its logits rounded to fp16) is several nats, which a
    run that flips a quarter of its decisions meets. Keeping `score` (the logits' layer) in fp32 is the fix."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU())
        self.score = torch.nn.Linear(48, 20)
        self.log_tau = torch.nn.Parameter(torch.tensor(-6.9))  # tau ~ 1e-3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x)) / self.log_tau.exp()


def test_a_kl_plan_never_verifies_a_run_that_flips_decisions_compare_calls_changed():
    torch.manual_seed(0)
    model, x = _Sharpened().eval(), torch.randn(512, 24)
    with torch.no_grad():
        model.score.bias.fill_(2.0)  # a shared offset: the logits are large (~2000), their margins ~10
        model.score.weight.mul_(0.01)
    result = fpdoctor.plan(model, x, candidate="fp16", metric="kl")
    summary = dict(result.report.data["summary"])
    # before: "keep in fp32 nothing; verified yes: KL 0.1 (target KL <= 9 nats); top-1 agreement 75%"
    assert result.plan.verified and result.plan.keep_fp32 == ["score"], summary
    assert "every set's top-1 within compare's decisions rule" in summary["target"]
    kept = fpdoctor.apply_plan(copy.deepcopy(model), result.plan)
    with torch.no_grad():
        exact = _exact(model, x)
        agree = float((kept(x.half()).double().argmax(-1) == exact.argmax(-1)).double().mean())
    assert agree >= 0.99, agree


def test_a_kl_target_at_its_least_says_so_not_256x_a_floor_it_is_not():
    """fp8's GEMMs return fp32 logits: their KL floor is ~1e-14, and the target printed as '256x the KL of
    the exact output rounded' read 1e-6, a bound no multiple of that floor gives."""
    model, x = _classifier()
    result = fpdoctor.plan(model, x, candidate="fp8-e4m3", metric="kl")
    target = dict(result.report.data["summary"])["target"]
    assert target.startswith("KL <= 1e-06 nats: the least KL a plan chases"), target
