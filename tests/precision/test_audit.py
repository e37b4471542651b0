"""Dtype audit and harmonize."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.casebook import unet
from tests.conftest import load_minilm


def names(report):
    return [f.name for f in report.findings]


def test_uniform_model_is_clean():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    result = fpdoctor.audit(model, torch.randn(3, 4))
    assert result.report.verdict == "ok" and result.dtypes == {"torch.float32": 30}


def test_fp32_norms_in_a_half_model_are_by_design():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)).bfloat16()
    model[1].float()
    assert "mixed-dtype-parameters" not in names(fpdoctor.audit(model).report)


def test_autocast_regions_are_allowed():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bfloat16()

    class Auto(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x)

    report = fpdoctor.audit(Auto(), torch.randn(2, 4)).report
    assert "dtype-mismatch" not in names(report)  # autocast reconciles the operands


def test_unet_time_embed_is_explained_and_harmonized():
    model, inputs = unet.build()
    report = fpdoctor.audit(model, inputs).report
    assert sorted(names(report)) == ["dtype-mismatch", "mixed-dtype-parameters"]
    mismatch = report.by_name("dtype-mismatch")[0]
    assert mismatch.where["module"] == "mid.0" and mismatch.where["op"].startswith("aten.native_group_norm")
    assert mismatch.evidence["entered_at"] == "parameter time_embed.mlp.2.bias"
    assert "model.time_embed.to(torch.float16)" in mismatch.fix
    static = report.by_name("mixed-dtype-parameters")[0]
    assert set(static.evidence["modules"]) == {"time_embed.mlp.0", "time_embed.mlp.2"}
    result = fpdoctor.harmonize(model, "cpu")
    assert result.dtype == torch.float32 and result.changed
    out = model(inputs[0].float(), inputs[1])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert fpdoctor.audit(model, (inputs[0].float(), inputs[1])).report.verdict == "ok"


def test_state_tensor_promoted_by_cat():
    class Prefix(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("prompt", torch.randn(1, 2, 8))  # fp32 buffer, not cast below
            self.proj = nn.Linear(8, 8)

        def forward(self, h):
            both = torch.cat([self.prompt.expand(h.shape[0], -1, -1), h], dim=1)  # promotes to fp32
            return self.proj(both)

    model = Prefix()
    model.proj.half()
    report = fpdoctor.audit(model, torch.randn(3, 4, 8).half()).report
    mismatch = report.by_name("dtype-mismatch")[0]
    assert mismatch.where["module"] == "proj"
    operands = mismatch.evidence["operands"]
    assert any(
        o["origin"] == "a tensor made by aten.cat.default in module `<root>`" or o.get("op") == "aten.cat.default"
        for o in operands
    )
    assert mismatch.evidence["entered_at"] == "buffer prompt"


def test_device_mismatch_static():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    finding = fpdoctor.audit(model).report.by_name("device-mismatch")[0]
    assert finding.severity.value == "warning" and "1.weight (meta)" in finding.message


def test_harmonize_keeps_exceptions_with_boundary_casts():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    result = fpdoctor.harmonize(model, "cpu", dtype=torch.float16, keep_fp32=["1"])
    assert result.kept_fp32 == ["1"] and model[1].weight.dtype == torch.float32
    assert model[0].weight.dtype == torch.float16
    assert model(torch.randn(2, 4).half()).dtype == torch.float16
    with pytest.raises(ValueError, match="do not exist"):
        fpdoctor.harmonize(model, "cpu", keep_fp32=["nope"])


def test_real_minilm_with_one_submodule_cast():
    tokenizer, model = load_minilm()
    model.encoder.layer[2].attention.half()
    batch = dict(tokenizer(["mixed precision, by accident"], return_tensors="pt"))
    report = fpdoctor.audit(model, batch).report
    static = report.by_name("mixed-dtype-parameters")[0]
    assert all(m.startswith("encoder.layer.2.attention") for m in static.evidence["modules"])
    mismatch = report.by_name("dtype-mismatch")[0]
    assert mismatch.where["module"].startswith("encoder.layer.2.attention")
    line = "model.get_submodule('encoder.layer.2.attention').to(torch.float32)"
    assert line in mismatch.fix
    # the fix is Python the user can paste: a numeric path part needs get_submodule
    model = model.float()
    eval(line, {"model": model, "torch": torch})


def test_audit_forward_leaves_running_statistics_and_rng_untouched():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5)).train()
    x, before = torch.randn(16, 8), {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    fpdoctor.audit(model, x)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm ran in training mode
    assert torch.equal(torch.get_rng_state(), rng) and model.training
