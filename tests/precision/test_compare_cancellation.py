"""A cancellation written by hand in a container's own forward (log(1 - exp(-h)) at small h, a
difference of two close sigmoids): its error grows less than DIVERGENCE_RATIO over what comes in,
as a deep model's can, so the growth alone cannot tell it; compare tries the fix (the lines that
make what the op reads, in fp32) and the check decides. Applied as printed, the fix leaves
nothing to name; a model whose error grows as much by depth alone is not named."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


class Survival(nn.Module):
    """A discrete-time survival head: log P(event in the interval) = log(1 - exp(-hazard))."""

    def __init__(self, fp32_lines: bool = False) -> None:
        super().__init__()
        self.fp32_lines = fp32_lines
        self.enc = nn.Sequential(nn.Linear(32, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU())
        self.rate = nn.Linear(128, 1)
        with torch.no_grad():
            self.rate.weight.mul_(8.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.rate(self.enc(x))
        r = r.float() if self.fp32_lines else r
        h = F.softplus(r).squeeze(-1) * 0.03
        return torch.log(1 - torch.exp(-h)).to(x.dtype)


class Ordinal(nn.Module):
    """A cumulative-link head: log P(y = k) = log(sigmoid(c_k - f) - sigmoid(c_(k-1) - f)), close cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.cuts = nn.Parameter(torch.linspace(-0.3, 0.3, 7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = torch.sigmoid(self.cuts - self.enc(x))
        return torch.log(c[:, 1:] - c[:, :-1])


def _line(fn: object, text: str) -> int:
    import inspect

    lines, first = inspect.getsourcelines(fn)  # type: ignore[arg-type]
    return first + next(k for k, line in enumerate(lines) if text in line)


def test_log_one_minus_exp_in_bf16_is_named_by_its_check_and_the_fix_as_printed_leaves_nothing():
    torch.manual_seed(0)
    model, x = Survival().eval(), torch.randn(512, 32)
    result = fpdoctor.compare(model, x, candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    root = result.rows[-1]
    assert root.propagated < 16 * max(root.input_error or 0.0, root.floor)  # the growth alone is under the ratio
    lines = {int(at.rsplit(":", 1)[1]) for at in finding.evidence["feeding_lines"]}
    assert _line(Survival.forward, "torch.exp(-h)") in lines and _line(Survival.forward, "softplus") in lines
    assert finding.trial is not None and finding.trial.tried and finding.trial.after * 4 <= finding.trial.before
    assert "in fp32" in finding.fix

    torch.manual_seed(0)
    fixed = Survival(fp32_lines=True).eval()  # those lines in fp32, the result cast back
    after = fpdoctor.compare(fixed, x, candidate="bf16")
    assert not after.report.by_name("precision-divergence"), str(after.report)


def test_a_difference_of_close_sigmoids_in_bf16_is_named_with_its_lines_checked():
    torch.manual_seed(0)
    result = fpdoctor.compare(Ordinal().eval(), torch.randn(512, 16), candidate="bf16")
    (finding,) = result.report.by_name("precision-divergence")
    lines = {int(at.rsplit(":", 1)[1]) for at in finding.evidence["feeding_lines"]}
    # the lines in fp32, or the cuts alone (held in fp32, torch's promotion computes the lines in fp32)
    assert _line(Ordinal.forward, "torch.sigmoid") in lines or finding.evidence.get("rounded_buffers") == ["cuts"]
    assert all("fpdoctor" not in at.rsplit(":", 1)[0] for at in finding.evidence["feeding_lines"])
    assert finding.trial is not None and finding.trial.tried and finding.trial.after * 4 <= finding.trial.before
    # the output's format is coarse too, but the candidate's error is far above its rounding: not "at the floor"
    for coarse in result.report.by_name("output-too-coarse"):
        assert "at this floor" not in coarse.message


class Deep(nn.Module):
    """Residual blocks whose own adds are exact enough: error grows with depth, no cancellation."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.sum(-1) / 8


def test_a_model_whose_error_grows_by_depth_is_not_named():
    torch.manual_seed(0)
    result = fpdoctor.compare(Deep().eval(), torch.randn(256, 64), candidate="bf16")
    assert not result.report.by_name("precision-divergence"), str(result.report)
