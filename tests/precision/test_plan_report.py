"""What a plan says: the floor it cannot go below, what it reached or could not, why each module
is kept, and the model as given."""

from __future__ import annotations

import pytest
import torch

import fpdoctor
from fpdoctor.precision.plan.plan import FLOOR_MARGIN
from tests.conftest import ROOT, run_fpdoctor
from tests.precision import factories

ENV = {"PYTHONPATH": str(ROOT)}


def test_a_floor_above_the_tolerance_is_measured_and_the_plan_judged_against_it():
    model, x = factories.ill_conditioned()
    result = fpdoctor.plan(model, x, candidate="fp16")
    the_plan = result.plan
    # rounding the inputs alone costs ~2%, far above 16x the output's noise floor
    assert the_plan.input_floor > 5 * the_plan.tolerance and not the_plan.reachable
    assert the_plan.target == pytest.approx(FLOOR_MARGIN * the_plan.input_floor)
    # before: every module kept and "verified NO"; the attention is what makes fp16 worse than its floor
    assert the_plan.verified and the_plan.keep_fp32 == ["attn"]
    assert the_plan.input_floor <= the_plan.final_error <= the_plan.target < the_plan.baseline_error
    summary = dict(result.report.data["summary"])
    assert summary["input rounding floor"].startswith(f"{the_plan.input_floor:.3g}: the fp32 model fed fp16-rounded")
    assert "out of reach" in summary["target"]
    floor = next(f for f in result.report.findings if f.evidence.get("kind") == "input-rounding")
    assert floor.severity.value == "warning" and "ill-conditioned at fp16" in floor.message
    assert "off by about 2." in floor.message  # what it means for the user, in their units
    assert result.report.verdict == "warning"  # a verified plan: nothing left the user must fix first


def test_a_reachable_tolerance_is_judged_as_asked():
    model, x = factories.overflow_attention()
    the_plan = fpdoctor.plan(model, x, candidate="fp16", tolerance=0.01).plan
    assert the_plan.reachable and the_plan.target == 0.01 and the_plan.verified


def test_a_plan_that_cannot_verify_keeps_nothing_and_says_where_to_look():
    model, x = factories.ill_conditioned_root()  # the sensitive ops are the model's own
    result = fpdoctor.plan(model, x, candidate="fp16")
    the_plan = result.plan
    assert not the_plan.verified and the_plan.keep_fp32 == [] and the_plan.closest == ["value"]
    assert the_plan.to_code().startswith("# no verified plan") and the_plan.to_code().endswith("\n")
    assert the_plan.to_code().count("\n") == 1  # no code to paste
    with pytest.raises(ValueError, match="not verified"):
        fpdoctor.apply_plan(model, the_plan)
    summary = dict(result.report.data["summary"])
    assert summary["keep in fp32"] == "no verified plan"
    assert summary["verified"].startswith("NO: the closest set (1 module(s) in fp32: `value`)")
    assert "model's own forward" in summary["next step"]
    unverified = next(f for f in result.report.findings if f.title.startswith("No keep-in-fp32 set"))
    # the model's own ops: no module set helps, but compare's engine checked a line fix, which is printed
    assert unverified.severity.value == "error" and "cast what they produce back to float16" in unverified.fix
    assert unverified.trial is not None and unverified.trial.tried and unverified.trial.after < unverified.trial.before
    assert all("fpdoctor plan" not in f.fix for f in result.report.findings if f.name == "precision-divergence")


def test_outputs_beyond_fp16s_range_stay_fp32_in_the_plan():
    model, x = factories.overflow_attention()
    with torch.no_grad():
        model.head.weight.mul_(1e5)  # the head's outputs now exceed fp16's range
    the_plan = fpdoctor.plan(model, x, candidate="fp16").plan
    assert the_plan.verified and "head" in the_plan.keep_fp32 and the_plan.fp32_outputs == ["head"]


def test_inputs_beyond_fp16s_range_point_to_bf16():
    model, x = factories.huge_inputs()
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert not result.plan.verified
    step = dict(result.report.data["summary"])["next step"]
    assert "the inputs themselves do not fit fp16" in step and "--candidate bf16" in step
    assert fpdoctor.plan(model, x, candidate="bf16").plan.verified


def test_a_verified_plan_exits_0_and_says_what_it_did_about_each_divergence():
    result = run_fpdoctor(
        "plan", "tests.precision.factories:overflow_attention", "--candidate", "fp16", "--format", "json", env=ENV
    )
    assert result.code == 0, result.err  # before: 1, the divergence the plan fixes counted as an error
    doc = factories.loads_strict(result.out)
    assert doc["verdict"] == "warning" and doc["data"]["plan"]["verified"] is True
    divergence = next(f for f in doc["findings"] if f["where"].get("module") == "attn")
    assert divergence["severity"] == "warning" and "The plan computes aten.bmm.default" in divergence["message"]
    assert "fpdoctor plan" not in divergence["fix"] and "apply_plan" in divergence["fix"]
    summary = dict(doc["data"]["summary"])
    assert "compute in fp32 in `attn`" in summary and "why the op, not all of `attn`" in summary
    # a module compare does not name is kept because the attention amplifies its error: said so
    for name in doc["data"]["plan"]["keep_fp32"]:
        assert f"why `{name}`" in summary


def test_a_module_compare_names_but_the_plan_does_not_keep_is_explained():
    model, x = factories.quiet_divergence()
    assert fpdoctor.compare(model, x, candidate="fp16").first_divergent == "branch"
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert result.plan.verified and result.plan.keep_fp32 == []
    summary = dict(result.report.data["summary"])
    assert summary["why not `branch`"].startswith("compare names it (")
    assert "stays within the target" in summary["why not `branch`"]
    finding = result.report.by_name("precision-divergence")[0]
    assert finding.severity.value == "warning" and "does not need to keep it" in finding.message


def test_a_model_that_does_not_run_as_given_is_said_first():
    model, x = factories.mixed_params()
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert result.plan.verified  # converted to fp16 it is fine
    assert result.report.verdict == "error"  # but as shipped it crashes: that is what the user must hear first
    first = result.report.sorted_findings()[0]
    assert first.name == "dtype-mismatch" and first.where["module"] == "head"
    assert dict(result.report.data["summary"])["model as given"].startswith("does not run: dtype-mismatch at `head`")
    compared = fpdoctor.compare(model, x, candidate="bf16")
    assert compared.report.sorted_findings()[0].name == "dtype-mismatch"


def test_plan_cli_names_the_floor_and_the_unreachable_tolerance():
    result = run_fpdoctor("plan", "tests.precision.factories:ill_conditioned", "--candidate", "half", env=ENV)
    assert result.code == 0, result.err
    assert "input rounding floor" in result.out and "out of reach" in result.out
    assert "keep_in_fp32(model, 'attn', fp32_modules['attn'], back_to=torch.float16)" in result.out
    code = result.out.split("The plan as code (plain torch; fpdoctor.apply_plan(model, plan) does the same):\n")[1]
    assert "fpdoctor" not in code and code.startswith("\nimport copy\n\nimport torch\n")  # only torch needed
