"""A leaf module the user wrote (no submodules, its own arithmetic in `forward`) is judged op by op as a
container's own code is: `compare` names the op and the line inside it, and where the op only
amplifies the rounding of what it reads, the lines that make it, with a checked fix that works as
printed. Two leaves of the class: a one-pass variance, E[x^2] - E[x]^2, in an instance norm over
readings near 100 (fp16), and a moving average taken as the difference of a cumulative sum over 8192
frames (bf16)."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class InstanceNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x * x).mean(1, keepdim=True) - mean * mean  # one pass
        return (x - mean) / torch.sqrt(var + 1e-5)


class InstanceNormFixed(nn.Module):
    """The fix as printed: the lines that make the variance in fp32, the result cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.float().mean(1, keepdim=True)
        var = ((x.float() * x.float()).mean(1, keepdim=True) - mean * mean).to(x.dtype)
        return (x - mean.to(x.dtype)) / torch.sqrt(var + 1e-5)


class MovingAverage(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.cumsum(x, dim=1)  # the sum
        c = F.pad(c, (0, 0, 32, 0))
        return (c[:, 32:] - c[:, :-32]) / 32  # the difference


class MovingAverageFixed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.cumsum(x.float(), dim=1)
        c = F.pad(c, (0, 0, 32, 0))
        return ((c[:, 32:] - c[:, :-32]) / 32).to(x.dtype)


class Model(nn.Module):
    def __init__(self, leaf: nn.Module) -> None:
        super().__init__()
        self.leaf, self.head = leaf, nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.leaf(x))


def _line(text: str) -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(k + 1 for k, line in enumerate(lines) if text in line)


def _case(kind: str, fp32: bool = False) -> tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(0)
    if kind == "variance":
        leaf: nn.Module = InstanceNormFixed() if fp32 else InstanceNorm()
        return Model(leaf).eval(), 100.0 + 2.0 * torch.randn(16, 256, 8), "fp16"
    leaf = MovingAverageFixed() if fp32 else MovingAverage()
    return Model(leaf).eval(), torch.rand(4, 8192, 8), "bf16"


def test_the_op_and_its_lines_inside_a_leaf_the_user_wrote_are_named_and_the_fix_works_as_printed():
    for kind, first_line in (("variance", "mean = x.mean(1"), ("sum", "# the sum")):
        model, x, candidate = _case(kind)
        result = fpdoctor.compare(model, x, candidate=candidate)
        (finding,) = [f for f in result.report.findings if f.name == "precision-divergence"]
        assert finding.where["module"] == "leaf" and finding.where["op"] == "aten.sub.Tensor", str(result.report)
        line = _line("# one pass" if kind == "variance" else "# the difference")
        assert finding.evidence["own_op_location"] == f"{__file__}:{line}", str(result.report)
        assert "The op inside it that loses most is aten.sub.Tensor" in finding.message
        # the op only amplifies what it reads: the lines that make it, in fp32, checked
        lines = finding.evidence["feeding_lines"]
        assert f"{_line(first_line)}" in str(lines) and f"{line}" in str(lines), lines
        assert finding.trial is not None and finding.trial.tried
        before, after = finding.trial.before, finding.trial.after
        assert isinstance(before, float) and isinstance(after, float) and after * 10 < before

        if kind == "sum":
            fixed, x, _ = _case(kind, fp32=True)  # those lines in fp32, the result cast back, as printed
            now = fpdoctor.compare(fixed, x, candidate=candidate)
            assert now.report.data["modules"][-1]["propagated_rel"] <= 1.2 * after  # as the check said
            assert not now.report.by_name("precision-divergence"), str(now.report)
            continue
        # x - mean on x as fp16 holds it (~100, spacing 1/16) is the inputs' rounding: the variance's lines
        # in fp32 cast back leave it; the fix takes the return line too, on the readings given in fp32
        assert finding.evidence.get("inputs_as_given") and f"{_line('return (x - mean)')}" in str(lines), lines
        assert finding.fix.startswith("Do that computation before the cast: pass the model's inputs in fp32")
        with torch.no_grad():
            exact = model.double()(x.double())
            norm = InstanceNormFixed()
            standardised = (x - x.mean(1, keepdim=True)) / torch.sqrt(x.var(1, unbiased=False, keepdim=True) + 1e-5)
            fixed = model.head.half()(standardised.half()).double()
        assert float((fixed - exact).norm() / exact.norm()) <= 1.2 * after
        cast_back = fpdoctor.compare(Model(norm).eval(), x, candidate=candidate)  # the variance's lines alone
        assert cast_back.report.data["modules"][-1]["propagated_rel"] > 10 * after


class _Quantizer(nn.Module):
    """A VQ codebook lookup whose distances are computed in fp32 already (the fix of a first report
    applied): no op of its own loses anything; the fp16 codebook it reads and returns is the error."""

    def __init__(self, codebook: torch.Tensor) -> None:
        super().__init__()
        self.codebook = nn.Parameter(codebook.clone())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z32, cb = z.to(torch.float32), self.codebook.to(torch.float32)
        d = ((z32 * z32).sum(1, keepdim=True) + (cb * cb).sum(1) - 2 * z32 @ cb.t()).to(self.codebook.dtype)
        return self.codebook[d.argmin(1)]


def test_a_leaf_whose_own_ops_lose_nothing_is_not_told_its_worst_op_loses_most() -> None:
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(48, 256), nn.GELU(), nn.Linear(256, 64))
    with torch.no_grad():
        enc[2].bias.fill_(3.0)  # latents that share a large mean
        z = enc(torch.randn(8192, 48))
        codes = z[torch.randperm(8192)[:512]] + 0.05 * torch.randn(512, 64)
    model = nn.Sequential(enc, _Quantizer(codes), nn.Linear(64, 48)).eval()
    torch.manual_seed(1)
    result = fpdoctor.compare(model, torch.randn(1024, 48), candidate="fp16")
    found = [f for f in result.report.findings if f.name == "precision-divergence" and f.where.get("module") == "1"]
    for f in found:
        assert "loses most" not in f.message and "None of its own ops loses anything" in f.message, f.message
    # its inputs rounded to fp16 move what the exact lookup picks: that error is its floor, measured
    (row,) = [r for r in result.report.data["modules"] if r["module"] == "1"]
    floor = result.report.data["conditioned_floors"]["1"]
    assert floor == row["floor_rel"] and (row["isolated_rel"] <= 4 * floor or found)


class HalfFixedNorm(nn.Module):
    """A standardisation whose mean and variance are made in fp32 and cast back before `x - mean`: the
    cancellation is left, on the line whose result a Conv1d reads."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = xf.mean(-1, keepdim=True)
        var = (xf * xf).mean(-1, keepdim=True) - mean * mean
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        return (x - mean) / torch.sqrt(var + 1e-5)  # the conv reads this


def test_lines_whose_result_a_conv_reads_are_checked_in_fp32_not_left_untried():
    """Raising the lines up to a leaf's return handed its fp32 result to a Conv1d, which checks its
    input's dtype against its weight's before any op runs: the check failed and the fix went untried
    ("the lines that make its inputs were not found"). A module now reads a raised result in the
    candidate's dtype, as the fix casts it back, and the fix is checked."""
    torch.manual_seed(0)
    model = nn.Sequential(HalfFixedNorm(), nn.Conv1d(3, 16, 5, padding=2), nn.GELU(), nn.AdaptiveAvgPool1d(1))
    t = torch.linspace(0, 1, 128)
    wave = 2.5 * torch.sin(30 * t + 6 * torch.rand(8, 3, 1))  # mains voltage near 230 V, per window
    x = 230.0 + 3.0 * torch.randn(8, 3, 1) + wave + 0.3 * torch.randn(8, 3, 128)
    result = fpdoctor.compare(model.eval(), x, candidate="fp16")
    (finding,) = result.report.by_name("precision-divergence")
    assert finding.trial is not None and finding.trial.tried, finding.trial
    assert f"{_line('# the conv reads this')}" in str(finding.evidence["feeding_lines"])


class InstanceNormInFp32(nn.Module):
    """Every line of the standardisation in fp32 from the fp16 readings, the result cast back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        mean = xf.mean(1, keepdim=True)
        var = (xf * xf).mean(1, keepdim=True) - mean * mean
        return ((xf - mean) / torch.sqrt(var + 1e-5)).to(x.dtype)


def test_an_error_its_inputs_rounding_forces_does_not_outlive_the_fix():
    """After the fix, the standardisation computes in fp32 and none of its ops loses anything; what
    is left is the readings' own rounding to fp16 (~100, spacing 1/16), which the exact function on
    them makes too. compare said NUM006, 100x the floor, on fixed code: the leaf's floor now holds
    what the exact module makes of its rounded inputs, and the report says so."""
    model, x, candidate = _case("variance")
    fixed = Model(InstanceNormInFp32()).eval()
    fixed.load_state_dict(model.state_dict())
    result = fpdoctor.compare(fixed, x, candidate=candidate)
    assert not result.report.by_name("precision-divergence"), str(result.report)
    floors = result.report.data["conditioned_floors"]
    assert set(floors) == {"leaf"} and floors["leaf"] > 0.005  # ~2%: the readings' rounding, amplified
    said = dict(result.report.data["summary"])["floor from the inputs' rounding"]
    assert said.startswith("`leaf` ") and "amplifies the rounding of what it reads" in said


class OnePass(nn.Module):
    """A norm by hand with a one-pass variance, after a layer whose outputs share an offset near 50: in
    fp16 the variance cancels to below 0 (NaN); its lines in fp32 with the mean cast back leave x - mean
    on the mean fp16 holds. `fixed`: the fix as printed, every line of it in fp32."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        self.fixed = fixed
        self.gain = nn.Parameter(torch.ones(96))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:
            xf = x.float()
            mean = xf.mean(-1, keepdim=True)
            var = (xf**2).mean(-1, keepdim=True) - mean**2
            return ((xf - mean) / torch.sqrt(var + 1e-5) * self.gain.float()).to(x.dtype)
        mean = x.mean(-1, keepdim=True)
        var = (x**2).mean(-1, keepdim=True) - mean**2
        return (x - mean) / torch.sqrt(var + 1e-5) * self.gain


def _one_pass(fixed: bool = False) -> nn.Module:
    torch.manual_seed(3)
    stem = nn.Linear(24, 96)
    with torch.no_grad():
        stem.bias.fill_(50.0)
    return nn.Sequential(stem, OnePass(fixed), nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 8)).eval()


def test_a_one_pass_variance_after_an_offset_gets_every_line_of_the_norm_and_the_fix_as_printed_is_ok() -> None:
    x = torch.randn(512, 24)
    report = fpdoctor.compare(_one_pass(), x, candidate="fp16").report
    first = report.findings[0]
    lines = first.evidence.get("feeding_lines") or []
    returned = inspect.getsourcelines(OnePass.forward)
    at = returned[1] + next(k for k, line in enumerate(returned[0]) if "return (x - mean)" in line)
    assert any(str(at) == str(line).rpartition(":")[2] for line in lines) or f"-{at} " in first.fix, first.fix
    fixed = fpdoctor.compare(_one_pass(fixed=True), x, candidate="fp16").report
    assert not [f for f in fixed.findings if f.severity in ("error", "warning")], str(fixed)
