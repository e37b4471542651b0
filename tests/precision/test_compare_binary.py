"""An output of probabilities a sigmoid made, one per row, decided at 0.5 (a fraud score, a detector's
flag): judged by the decisions it makes, as logits are. Calibrated to cut at its median, bf16 holds
scores near 0.5 in steps of 0.002 and 5% of the decisions flip with a relative error of 0.2%: rounding
the exact output alone flips them, so the output's format is the cause (output-too-coarse), and the
head kept in fp32 returning fp32 gives them back, checked. An output in [0, 1] that no sigmoid made
(a clamp of a regression) decides nothing here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


class Squeezed(nn.Module):
    """torch.sigmoid of the head's output, squeezed: the model's own op makes the probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.body(x))).squeeze(-1)


def _calibrated(model: nn.Module, head: nn.Linear, x: torch.Tensor) -> nn.Module:
    """The head's bias set so that the cut at 0.5 falls at the median score, as a calibrated model's does."""
    with torch.no_grad():
        scores: list[torch.Tensor] = []
        handle = head.register_forward_hook(lambda m, a, out: scores.append(out))
        model(x)
        handle.remove()
        head.bias -= scores[0].median()
    return model


def _squeezed() -> tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(0)
    model, x = Squeezed().eval(), torch.randn(2048, 32)
    return _calibrated(model, model.head, x), x, "head"


def _sequential() -> tuple[nn.Module, torch.Tensor, str]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1), nn.Sigmoid()).eval()
    x = torch.randn(2048, 32)
    return _calibrated(model, model[2], x), x, "2"


@pytest.mark.parametrize("make", [_squeezed, _sequential])
def test_a_sigmoids_decisions_that_bf16_flips_are_named_with_the_head_kept_in_fp32(make: object) -> None:
    model, x, head = make()  # type: ignore[operator]
    report = fpdoctor.compare(model, x, candidate="bf16").report
    decided = report.data["decisions"]
    assert decided["source"].startswith("probabilities of a sigmoid"), decided
    assert decided["top1"] < 0.99 and decided["floor_top1"] < 0.99  # rounding the exact output flips them too
    (found,) = [f for f in report.findings if f.name == "output-too-coarse"]
    assert f"keep `{head}` in fp32, returning fp32" in found.fix, found.fix
    assert found.trial is not None and found.trial.tried and float(str(found.trial.after).rstrip("%")) > 99.0


def test_an_output_in_zero_one_that_no_sigmoid_made_decides_nothing() -> None:
    torch.manual_seed(0)

    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(32, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.head(x) * 0.01 + 0.5).clamp(0, 1).squeeze(-1)

    report = fpdoctor.compare(Clamped().eval(), torch.randn(512, 32), candidate="bf16").report
    assert "decisions" not in report.data


class Fixed(Squeezed):
    """The fix as printed: the head in fp32 returning fp32, so the sigmoid returns fp32 probabilities
    (compare casts the model itself: the forward keeps its head in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head.float()(self.body(x).float())).squeeze(-1)


def test_the_fix_as_printed_gets_an_ok_not_the_floor_of_a_format_it_no_longer_returns() -> None:
    broken, x, _ = _squeezed()
    model = Fixed().eval()
    model.load_state_dict(broken.state_dict())  # the same calibrated weights
    report = fpdoctor.compare(model, x, candidate="bf16").report
    assert report.data["decisions"]["top1"] > 0.99
    assert not [f.name for f in report.findings if f.severity in ("error", "warning")], report.findings
