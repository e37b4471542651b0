"""compare says why a candidate diverges, not only where: the model's own ops or its rounded inputs
(never "keep the root in fp32")."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from tests.conftest import ROOT, run_fpdoctor
from tests.precision import factories

ENV = {"PYTHONPATH": str(ROOT)}


def test_the_whole_model_is_never_a_module_to_keep():
    model, x = factories.ill_conditioned_root()
    result = fpdoctor.compare(model, x, candidate="fp16")
    finding = result.report.by_name("precision-divergence")[0]
    assert result.first_divergent is None  # before: "" - the root, as if it could be kept in fp32
    assert "keep `` in fp32" not in finding.fix and "whole model is not a keep-in-fp32 candidate" in finding.fix
    assert "the whole model's own ops" in finding.message and "" not in finding.evidence["diverged"]
    assert finding.evidence["diverged"] == ["<root>"]
    # the floor beside it: what rounding the inputs alone costs
    assert 0 < finding.evidence["input_floor_rel"] < finding.evidence["isolated_rel"]
    assert dict(result.report.data["summary"])["first divergent module"].startswith("none: the whole model's own ops")


class Amplifier(nn.Module):
    """Near one-hot attention computed in float64 whatever its input dtype: all its fp16 error
    comes from rounding its inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        h = x.double()
        scores = (h @ h.transpose(-1, -2)) * 0.1  # (batch, tokens, tokens)
        return (torch.softmax(scores, dim=-1) @ (h - h.mean(dim=-2, keepdim=True))).to(x.dtype)


def test_an_error_that_input_rounding_explains_is_named_as_such():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64) + 20
    result = fpdoctor.compare(Amplifier(), x, candidate="fp16")
    finding = result.report.by_name("precision-divergence")[0]
    assert finding.evidence["kind"] == "input-rounding" and finding.where["module"] is None
    assert finding.title == "Rounding the inputs to fp16 already costs more than the noise floor"
    assert "ill-conditioned at fp16" in finding.message and "keep" not in finding.fix.split(";")[0]
    assert result.first_divergent is None
    assert dict(result.report.data["summary"])["first divergent module"].startswith("none: rounding the inputs")


def test_compare_cli_takes_torch_dtype_names_and_names_the_root_plainly():
    result = run_fpdoctor(
        "compare",
        "tests.precision.factories:ill_conditioned_root",
        "--candidate",
        "float16",
        "--format",
        "json",
        env=ENV,
    )
    assert result.code == 1, result.err  # before: exit 2, "unknown candidate 'float16'"
    doc = factories.loads_strict(result.out)
    finding = doc["findings"][0]
    assert "``" not in finding["fix"] and finding["evidence"]["diverged"] == ["<root>"]
