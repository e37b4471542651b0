"""plan(): planted problems are found at the right module and fixed by a verified plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor
from tests.conftest import run_fpdoctor


class Attention(nn.Module):
    def __init__(self, dim: int = 64, scaled: bool = True) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = dim**-0.5 if scaled else 1.0

    def forward(self, x):
        scores = (self.q(x) * self.scale) @ self.k(x).transpose(-1, -2)  # scaled before the product
        return torch.softmax(scores, dim=-1) @ self.v(x)


class Block(nn.Module):
    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = Attention(scaled=scaled)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def model_with(scaled: bool = True, hot_layer: bool = False):
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(scaled=scaled), nn.LayerNorm(64), nn.Linear(64, 16))
    with torch.no_grad():
        model[1].attn.q.weight.mul_(150)  # large logits: harmless scaled, an fp16 overflow unscaled
        model[1].attn.k.weight.mul_(150)
        if hot_layer:
            model[0].mlp[2].weight.mul_(1e6)
    return model, torch.randn(4, 32, 64)


def test_a_healthy_model_needs_no_exception():
    model, x = model_with()
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert result.plan.keep_fp32 == [] and result.plan.verified


def test_unscaled_attention_is_found_and_fixed():
    model, x = model_with(scaled=False)
    compared = fpdoctor.compare(model, x, candidate="fp16")
    assert compared.first_divergent == "1.attn"
    # the block and the model around it are non-finite too, but only because of 1.attn: the block's
    # own ops (its residual adds) stay at their floor, and its row says where the NaN/Inf starts
    by_name = {r.module: r for r in compared.rows}
    assert not by_name["1"].diverged and by_name["1"].ratio < 4 and by_name["1"].own["op"].startswith("aten.add")
    assert by_name[""].isolated is None and by_name[""].own["judged"] == 0  # a Sequential has no ops of its own
    assert compared.report.by_name("precision-divergence")[0].evidence["count"] == 1
    table = {row[0]: row for row in compared.report.data["table"]["rows"]}
    assert table["1.attn"][4] == "non-finite diverges" and "diverges" not in table["1"][4]
    assert table["1"][6].startswith("Inf/NaN: 1.attn") and table["<root>"][6].startswith("Inf/NaN: 1.attn")
    result = fpdoctor.plan(model, x, candidate="fp16")
    # the overflowing q·kᵀ and its softmax in fp32 (the projections stay fp16), or all of 1.attn
    fixed = result.plan.keep_fp32 + [f.module for f in result.plan.fp32_ops]
    assert result.plan.verified and "1.attn" in fixed
    assert result.plan.baseline_error == float("inf") and result.plan.final_error <= result.plan.tolerance
    fpdoctor.apply_plan(model, result.plan)
    out = model(x.half())
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


def test_a_hot_layer_is_found_and_fixed():
    model, x = model_with(hot_layer=True)
    assert fpdoctor.compare(model, x, candidate="fp16").first_divergent == "0.mlp.2"
    result = fpdoctor.plan(model, x, candidate="fp16")
    assert result.plan.verified and "0.mlp.2" in result.plan.keep_fp32
    # a finding the plan answers names every module it keeps, not only the one that holds it (trial80)
    for f in result.report.findings:
        if " The plan keeps `" in f.message:
            assert all(f"`{k}`" in f.message for k in result.plan.keep_fp32), f.message
    code = result.plan.to_code()
    namespace = {"model": model_with(hot_layer=True)[0]}
    exec(code, namespace)  # the pasteable code does what apply_plan does
    assert torch.isfinite(namespace["model"](x.half())).all()


def test_fp8_plans_go_to_the_users_recipe():
    model, x = model_with()
    result = fpdoctor.plan(model, x, candidate="fp8-e4m3")
    with pytest.raises(ValueError, match="apply the plan in your fp8 recipe"):
        fpdoctor.apply_plan(model, result.plan)
    assert "module_filter_fn" in result.plan.to_code()


def test_the_fp8_filter_keeps_the_linears_inside_a_kept_container():
    """torchao calls module_filter_fn with each Linear's own name (`blocks.0.q`): a plan keeping `blocks.0`
    printed `fqn not in KEEP_HIGH_PRECISION`, which converted every Linear inside it to fp8."""
    from fpdoctor.precision.plan.codegen import fp8_code

    namespace: dict = {}
    exec(fp8_code("fp8-e4m3", ["head", "blocks.0"]), namespace)
    keep = namespace["module_filter_fn"]
    assert not keep(None, "blocks.0.q") and not keep(None, "blocks.0") and not keep(None, "head")
    assert keep(None, "blocks.1.q") and keep(None, "blocks.01.q") and keep(None, "header")


def test_fp16_accumulation_plan_keeps_the_long_reduction_in_fp32():
    def long_sum():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16384, 8), nn.Linear(8, 4))
        with torch.no_grad():
            model[0].weight.fill_(0.01).add_(torch.randn_like(model[0].weight) * 1e-3)
        return model

    x = torch.rand(2, 16384) + 1
    result = fpdoctor.plan(long_sum(), x, candidate="fp16-accumulate")
    assert result.plan.verified and result.plan.keep_fp32 == ["0"]
    code = result.plan.to_code()
    assert "allow_fp16_reduced_precision_reduction = False" in code
    namespace = {"model": long_sum()}
    exec(code, namespace)
    applied = fpdoctor.apply_plan(long_sum(), result.plan)
    for model in (namespace["model"], applied):
        assert model[0].weight.dtype == torch.float32 and model[1].weight.dtype == torch.float16
        assert model(x.half()).dtype == torch.float16


def test_plan_cli(tmp_path):
    path = tmp_path / "hot.py"
    path.write_text(
        "from tests.precision.test_plan import model_with\ndef make():\n    return model_with(scaled=False)\n"
    )
    result = run_fpdoctor(
        "plan",
        f"{path}:make",
        "--candidate",
        "fp16",
        env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])},
    )
    assert result.code == 0, result.err  # the fp16 model diverges, and the verified plan fixes it: a warning
    assert "# 1.attn: aten.bmm.default and what consumes it, up to the softmax, in fp32" in result.out
    assert "yes: KL" in result.out  # its fp16 logits are NaN: judged by their KL, the default there


@pytest.mark.parametrize("candidate", ["fp16-accumulate", "fp8-e4m3"])
def test_plan_runs_simulated_layers_inside_fused_transformer_layers(candidate):
    """nn.TransformerEncoderLayer's fused fast path reads linear1/linear2 weights itself, past the
    simulated layers: plan must run it module by module, as compare does, or it verifies fp16."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 16, 64)
    compared = fpdoctor.compare(model, x, candidate=candidate).rows[-1].propagated
    planned = fpdoctor.plan(model, x, candidate=candidate, tolerance=1.0).plan.baseline_error
    assert planned == pytest.approx(compared, rel=1e-6)
    assert torch.backends.mha.get_fastpath_enabled()  # the user's setting is back


def test_a_compiled_model_is_compared_planned_and_audited_by_its_own_names():
    model, x = model_with(scaled=False)
    compiled = torch.compile(model)
    compared = fpdoctor.compare(compiled, x, candidate="fp16")
    assert compared.first_divergent == "1.attn" and not any("_orig_mod" in r.module for r in compared.rows)
    assert "every run went eagerly" in compared.report.data["not_checked"]["torch.compile"]
    planned = fpdoctor.plan(compiled, x, candidate="fp16")
    fixed = planned.plan.keep_fp32 + [f.module for f in planned.plan.fp32_ops]
    assert planned.plan.verified and "1.attn" in fixed
    assert fpdoctor.apply_plan(compiled, planned.plan) is compiled and model[0].norm.weight.dtype == torch.float16
    audited = fpdoctor.audit(compiled, x.half())
    assert all("_orig_mod" not in str(f.where) for f in audited.report.findings)


def test_one_module_is_compared_alone_with_the_inputs_the_model_gives_it():
    model, x = model_with(scaled=False)
    whole = fpdoctor.compare(model, x, candidate="fp16")
    scoped = fpdoctor.compare(model, x, candidate="fp16", module="1")
    assert scoped.first_divergent == "1.attn" == whole.first_divergent
    assert [r.module for r in scoped.rows] == [r.module for r in whole.rows if r.module.startswith("1")]
    assert dict(scoped.report.data["summary"])["module"].startswith("`1` alone")
    # fed the model's fp32 activations instead of the fp64 run's: the same isolated errors, statistically
    iso = {r.module: r.isolated for r in whole.rows if r.leaf}
    assert all(r.isolated == pytest.approx(iso[r.module], rel=0.3) for r in scoped.rows if r.leaf and r.isolated)
    with pytest.raises(ValueError, match=r"no module 'layers\.9'; its top-level modules: 0, 1, 2, 3"):
        fpdoctor.compare(model, x, candidate="fp16", module="layers.9")


def test_compare_module_cli(tmp_path, cli):
    path = tmp_path / "hot.py"
    path.write_text(
        "from tests.precision.test_plan import model_with\ndef make():\n    return model_with(scaled=False)\n"
    )
    env = {"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])}
    result = run_fpdoctor("compare", f"{path}:make", "--candidate", "fp16", "--module", "1.attn", env=env)
    assert result.code == 1 and "`1.attn` alone" in result.out
    result = run_fpdoctor("compare", f"{path}:make", "--candidate", "fp16", "--module", "nope", env=env)
    assert result.code == 2 and "the model has no module 'nope'" in result.err and "Traceback" not in result.err


def test_harmonize_takes_the_plans_exceptions():
    model, x = model_with(hot_layer=True)
    the_plan = fpdoctor.plan(model, x, candidate="fp16").plan
    assert the_plan.verified and "0.mlp.2" in the_plan.keep_fp32
    result = fpdoctor.harmonize(model, "cpu", dtype=torch.float16, plan=the_plan)
    assert result.kept_fp32 == the_plan.keep_fp32 and model[0].mlp[2].weight.dtype == torch.float32
    out = model(x.half())
    assert torch.isfinite(out).all()
    if the_plan.fp32_outputs:  # an output beyond fp16's range leaves the module in fp32
        assert model[0].mlp[2](torch.randn(2, 32, 256, dtype=torch.float16)).dtype == torch.float32
