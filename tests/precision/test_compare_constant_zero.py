"""An epsilon the candidate's format holds as 0: a masked mean or variance over frames, padded rows
all masked, divided by count + 1e-10 (or count.clamp(min=1e-9)) in fp16: 0/0 for those rows. compare
names the division at its line, says which constant is 0 in fp16, and checks both fixes: the lines
in fp32 (where the constant is not 0), and the format's own smallest normal written there instead;
the second, applied as printed, is OK. Two forms: statistics pooling with an eps variable, a
bag-of-words mean with the literal in a clamp."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class StatsPool(nn.Module):
    """x-vector statistics pooling over valid frames; `tiny`: the eps the fix prints."""

    def __init__(self, tiny: bool = False, d: int = 64) -> None:
        super().__init__()
        self.tiny = tiny
        self.frame = nn.Sequential(nn.Linear(40, d), nn.ReLU())
        self.out = nn.Linear(2 * d, 16)

    def forward(self, feats: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.frame(feats)
        w = valid.unsqueeze(-1).to(h.dtype)
        eps = torch.finfo(h.dtype).tiny if self.tiny else 1e-10
        mu = (h * w).sum(1) / (w.sum(1) + eps)
        var = ((h - mu[:, None]) ** 2 * w).sum(1) / (w.sum(1) + eps)
        return self.out(torch.cat([mu, var.clamp_min(0).sqrt()], -1))


class BagOfWords(nn.Module):
    def __init__(self, tiny: bool = False, d: int = 64) -> None:
        super().__init__()
        self.tiny = tiny
        self.emb, self.head = nn.Embedding(500, d), nn.Linear(d, 4)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(self.emb.weight.dtype)
        low = torch.finfo(m.dtype).tiny if self.tiny else 1e-9
        return self.head((self.emb(ids) * m).sum(1) / m.sum(1).clamp(min=low))


def _frames() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([50, 0, 31, 12, 0, 50, 7, 44])
    return torch.randn(8, 50, 40, generator=g), (torch.arange(50)[None] < lengths[:, None]).float()


def _words() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([20, 0, 3, 17, 0, 9])
    return torch.randint(0, 500, (6, 20), generator=g), (torch.arange(20)[None] < lengths[:, None]).float()


@pytest.mark.parametrize(
    ("model", "inputs", "constant"), [(StatsPool, _frames, "1e-10"), (BagOfWords, _words, "1e-09")]
)
def test_an_eps_the_format_holds_as_zero_is_named_and_both_fixes_are_checked(model, inputs, constant) -> None:
    torch.manual_seed(0)
    plain, x = model().eval(), inputs()
    result = fpdoctor.compare(plain, x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced" and first.trial is not None and first.trial.tried, str(result.report)
    # the literal leads: named, its value in fp16, the replacement checked; the line in fp32 beside it, checked too
    assert first.fix.startswith(f"replace the constant {constant} at "), first.fix
    assert "(it is 0 in fp16) with torch.finfo(" in first.fix and "checked: the output is finite again" in first.fix
    assert f"its constant {constant} is 0 in fp16" in first.fix and "every op on" in first.fix
    assert "(checked too: the output is finite" in first.fix
    assert first.trial.changed.startswith(f"the constant {constant} at ")

    fixed = model(tiny=True).eval()
    fixed.load_state_dict(plain.state_dict())
    assert fpdoctor.compare(fixed, x, candidate="fp16").report.verdict == "ok"


class Normalised(nn.Module):
    """Rows divided by their norm (or standard deviation) plus an eps fp16 holds as 0; empty rows (a
    document with no word left, a silent frame) are 0 / 0 there. `eps`: the constant as written."""

    def __init__(self, by: str = "norm", eps: float = 1e-8) -> None:
        super().__init__()
        self.by, self.eps = by, eps
        self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.norm(dim=-1, keepdim=True) if self.by == "norm" else x.std(-1, keepdim=True)
        return self.head((x - (0 if self.by == "norm" else x.mean(-1, keepdim=True))) / (size + self.eps))


@pytest.mark.parametrize(("by", "eps"), [("norm", 1e-8), ("std", 2e-8)])
def test_a_division_by_a_size_plus_an_eps_fp16_holds_as_zero_is_the_constant_not_an_overflow(by, eps) -> None:
    """0 / (0 + 1e-8) in fp16 is NaN: no value passes fp16's range, so the finding is the op that made
    NaN from finite inputs (NUM001), not a divergence that "overflows"; its fix is the constant replaced
    by a value fp16 holds, checked, and the model written with it as printed compares OK."""
    torch.manual_seed(0)
    x = torch.poisson(torch.full((64, 64), 0.3))
    x[::7] = 0.0  # empty rows
    plain = Normalised(by, eps).eval()
    result = fpdoctor.compare(plain, x, candidate="fp16")
    first = result.report.findings[0]
    assert first.name == "nonfinite-produced", [(f.name, f.message) for f in result.report.findings]
    assert "overflows" not in first.message and "beyond fp16's max" not in first.message
    assert first.fix.startswith(f"replace the constant {eps:g}") or first.fix.startswith("replace the constant 1e-")
    assert "with torch.finfo(torch.float16).tiny (6.1e-05" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after < 0.01
    fixed = Normalised(by, torch.finfo(torch.float16).tiny).eval()  # the constant as the fix prints it
    fixed.load_state_dict(plain.state_dict())
    assert fpdoctor.compare(fixed, x, candidate="fp16").report.verdict == "ok"
