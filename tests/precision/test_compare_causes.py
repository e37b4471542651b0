"""compare says why a candidate diverges, not only where: the model's own ops or its rounded inputs
(never "keep the root in fp32")."""

from __future__ import annotations

import torch
from torch import nn

import fpdoctor
from tests.conftest import ROOT, run_fpdoctor
from tests.precision import factories

ENV = {"PYTHONPATH": str(ROOT)}
FACTORIES = ROOT / "tests" / "precision" / "factories.py"


def test_the_whole_model_is_never_a_module_to_keep():
    model, x = factories.ill_conditioned_root()
    result = fpdoctor.compare(model, x, candidate="fp16")
    finding = result.report.by_name("precision-divergence")[0]
    assert result.first_divergent is None  # before: "" - the root, as if it could be kept in fp32
    assert "keep `` in fp32" not in finding.fix
    # its softmax is as wrong run exactly on fp16 inputs: the scores feeding it, made in fp32, are the fix
    assert "not the cause" in finding.message and finding.trial is not None and finding.trial.tried
    assert "in fp32" in finding.fix and finding.trial.after * 4 <= finding.trial.before
    assert "the whole model's own ops" in finding.message and "" not in finding.evidence["diverged"]
    assert finding.evidence["diverged"] == ["<root>"]
    # the floor beside it: what rounding the inputs alone costs
    assert 0 < finding.evidence["input_floor_rel"] < finding.evidence["isolated_rel"]
    first = dict(result.report.data["summary"])["first divergent module"]
    assert first.startswith("no submodule: the whole model's own"), first


class Amplifier(nn.Module):
    """Near one-hot attention computed in float64 whatever its input dtype: all its fp16 error
    comes from rounding its inputs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, tokens, dim)
        h = x.double()
        scores = (h @ h.transpose(-1, -2)) * 0.1  # (batch, tokens, tokens)
        return (torch.softmax(scores, dim=-1) @ (h - h.mean(dim=-2, keepdim=True))).to(x.dtype)


def test_an_error_that_input_rounding_explains_is_named_with_its_checked_fix():
    """Rounding the inputs explains the error; the lines that read them, computed in fp32 from the
    inputs as given, are checked to remove it: that is the fix printed (before: "the model is
    ill-conditioned at fp16", with no fix tried)."""
    torch.manual_seed(0)
    x = torch.randn(4, 32, 64) + 20
    result = fpdoctor.compare(Amplifier(), x, candidate="fp16")
    finding = result.report.by_name("precision-divergence")[0]
    assert finding.evidence["inputs_as_given"] and finding.where["module"] == ""
    assert finding.evidence["input_floor_rel"] > 0
    assert finding.fix.startswith("Do that computation before the cast: pass the model's inputs in fp32")
    assert finding.trial is not None and finding.trial.tried and finding.trial.after * 4 <= finding.trial.before
    assert result.first_divergent is None and "keep" not in finding.fix.split(";")[0]


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


def test_an_op_that_overflows_inside_a_module_is_named():
    model, x = factories.overflow_attention()
    finding = fpdoctor.compare(model, x, candidate="fp16").report.by_name("precision-divergence")[0]
    assert finding.where["module"] == "attn"
    # before: out_of_range False and nothing else: the attention's output fits, its scores do not
    assert finding.evidence["out_of_range"] is False and finding.evidence["overflow_inside"] is True
    assert finding.where["op"] == finding.evidence["overflow_op"] == "aten.bmm.default"
    assert 65504 < finding.evidence["overflow_absmax"] < 1e6 and finding.evidence["overflow_limit"] == 65504
    line = next(i for i, text in enumerate(FACTORIES.read_text().splitlines(), 1) if "scores = self.q(x)" in text)
    assert finding.evidence["overflow_location"].endswith(f"factories.py:{line}")
    assert "inside it aten.bmm.default overflows: its values reach" in finding.message
    assert "(inside `attn`, where aten.bmm.default overflows) in fp32" in finding.fix and "bf16" in finding.fix


def running_var_beyond_fp16():
    """BatchNorm fed raw values (std ~400): its running_var exceeds 65504 and becomes Inf in fp16."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 4)).eval()
    x = torch.randn(32, 16) * 400 + 100
    with torch.no_grad():
        model[0].running_var.copy_(x.var(0))
        model[0].running_mean.copy_(x.mean(0))
    return model, x


def test_a_buffer_beyond_the_format_is_named_as_the_cause():
    model, x = running_var_beyond_fp16()
    result = fpdoctor.compare(model, x, candidate="fp16")
    finding = result.report.by_name("precision-divergence")[0]
    assert finding.where["module"] == "0"
    assert "buffer 0.running_var holds values up to" in finding.message and "above fp16's max 65504" in finding.message
    misfit = finding.evidence["misfits"][0]
    assert misfit["tensor"] == "0.running_var" and misfit["overflow"] == 16 and misfit["limit"] == 65504
    assert misfit["max"] > 65504
    assert "keep `0` in fp32" in finding.fix
    assert "parameters/buffers that do not fit fp16" in dict(result.report.data["summary"])
    assert fpdoctor.compare(model, x, candidate="bf16").report.data.get("misfits") is None  # bf16 holds it


def test_a_weight_below_the_smallest_subnormal_is_named_as_the_cause():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    with torch.no_grad():
        model[0].weight.mul_(1e-7)  # all of it below fp16's smallest subnormal (6e-8)
    finding = fpdoctor.compare(model, torch.randn(8, 16) * 1e4, candidate="fp16").report.by_name(
        "precision-divergence"
    )[0]
    assert finding.where["module"] == "0"
    misfit = finding.evidence["misfits"][0]
    assert misfit["tensor"] == "0.weight" and misfit["flush_share"] == 1.0
    assert "below fp16's smallest subnormal" in finding.message and "they become 0" in finding.message


class Rescale(nn.Module):
    """Divides by a gain measured on the raw data; the gain exceeds fp16's range."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("gain", torch.full((64,), 1.2e5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.gain


def test_audit_names_a_tensor_that_would_break_when_cast_and_one_already_broken():
    model = nn.Sequential(Rescale(), nn.Linear(64, 256).half(), nn.GELU(), nn.Linear(256, 8).half())
    static = fpdoctor.audit(model).report.by_name("mixed-dtype-parameters")[0]
    assert "Casting them to torch.float16 would break the model" in static.message
    assert "buffer 0.gain holds values up to 1.2e+05, above fp16's max 65504" in static.message
    assert "keep_fp32=['0']" in static.fix and "model[0]" not in static.fix
    broken, _ = running_var_beyond_fp16()
    broken.half()  # its running_var is Inf now
    finding = fpdoctor.audit(broken).report.by_name("nonfinite-input")[0]
    assert finding.where["module"] == "0" and finding.severity.value == "error"
    assert "buffer 0.running_var (torch.float16) holds 16 Inf of 16" in finding.message
    assert "fp16's max is 65504" in finding.message


class LogPrice(nn.Module):
    """A regressor of log-prices whose forward returns the price: exp of values near 11 passes fp16's max."""

    def __init__(self, exp_in_fp32: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reg = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 1))
        with torch.no_grad():
            self.reg[2].bias.fill_(11.0)
        self.exp_in_fp32 = exp_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exp_in_fp32:  # the fix as printed: operands .float(), no cast back
            return torch.exp(self.reg(x).float())
        return torch.exp(self.reg(x))


def test_an_own_op_past_the_range_is_not_fixed_by_a_cast_back():
    """Was "lose precision ... the result cast back", which is Inf again; applied as printed now, finite."""
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    first = fpdoctor.compare(LogPrice(), x, candidate="fp16").report.findings[0]
    assert first.name == "precision-divergence" and "past fp16's range" in first.title, first.title
    assert "no cast back" in first.fix and "the result cast back" not in first.fix, first.fix
    with torch.no_grad():
        assert not torch.isfinite(LogPrice().half()(x.half())).all()
        assert torch.isfinite(LogPrice(exp_in_fp32=True).half()(x.half())).all()


def test_near_zeros_flushed_beside_large_values_are_negligible_but_a_tensor_of_them_is_not():
    """A DFT table's cos(pi/2)-like entries (6e-17) flush to 0 in fp16 beside entries near 1: they change the
    table less than its rounding does, so a divergence never names them as what breaks the model (the entry
    stays, for a log of them). A weight all that small is named."""
    from fpdoctor.precision.fit import candidate_format, misfits, negligible

    cos = torch.cos(torch.pi * torch.arange(64.0)[:, None] * torch.arange(64.0)[None] / 32)
    cos[cos.abs() < 0.1] = 6e-17  # the zeros of the table as a float computation leaves them: 5% of its values
    table = nn.Module()
    table.register_buffer("cos", cos)
    fmt = candidate_format("fp16")
    assert fmt is not None
    assert [(e["tensor"], negligible(e)) for e in misfits(table, fmt)] == [("cos", True)]
    table.register_buffer("tiny", 1e-9 * torch.randn(64, 64))
    assert [(e["tensor"], negligible(e)) for e in misfits(table, fmt)] == [("cos", True), ("tiny", False)]
