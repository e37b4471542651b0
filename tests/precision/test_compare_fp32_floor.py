"""compare --candidate fp32 on the model's own device: a floor model of fp32 would be the candidate
itself, every error its own floor, and the verdict OK whatever the model loses in fp32 (raw Unix
timestamps embedded by sin at hourly frequencies: fp32's spacing there is 128 s). The floor is fp64
by default there, which finds it; an explicit --reference fp32 is refused in one line, exit 2."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor
from fpdoctor.cli.main import main


class Clock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        hours = torch.arange(1, 5, dtype=t.dtype) * 2 * math.pi / 3600  # hourly harmonics
        angle = t[:, None] * hours
        return self.head(torch.cat([angle.sin(), angle.cos()], dim=-1))


def make() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Clock().eval(), 1.7e9 + torch.rand(64) * 86400  # as a data pipeline hands them: fp32


def test_an_fp32_candidate_is_judged_against_an_fp64_floor_by_default():
    model, t = make()
    result = fpdoctor.compare(model, t, candidate="fp32")
    assert result.report.verdict != "ok", [f.title for f in result.report.findings]
    assert dict(result.report.data["summary"])["candidate / floor model"].startswith("fp32 / fp64")


def test_an_fp32_candidate_against_an_fp32_floor_on_one_device_is_refused(capsys):
    assert main(["compare", f"{__file__}:make", "--candidate", "fp32", "--reference", "fp32"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compares the model with itself" in err[0], err


def test_an_output_lost_in_its_units_with_no_module_to_blame_is_never_ok():
    """The same model against fp64: every op is close to exact on what it reads (the product of a
    timestamp and a frequency, its sin), no module diverges by itself, and the output's error is 45%
    of what it varies by: an error judged by the output's use, not OK. Its cause first: the sin reads
    an argument whose fp32 rounding is a large share of a period, and the lines that make it computed
    in fp64 are the checked fix."""
    model, t = make()
    report = fpdoctor.compare(model, t, candidate="fp32", reference="fp64").report
    first, use = report.findings[0], next(f for f in report.findings if f.evidence.get("kind") == "use")
    assert first.evidence["kind"] == "cancellation" and first.evidence["op"] == "aten.sin.default", first.title
    assert "its argument is large" in first.message and "modulo 2*pi" in first.fix, first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after * 1000 < first.trial.before
    assert use.evidence["share_of_spread"] > 0.1 and use.severity.value == "error"


def test_torchs_name_for_fp32_gets_the_fp64_floor_too(capsys):
    """--candidate float32 is fp32: judged against fp64 by default, not refused as fp32 against fp32."""
    code = main(["compare", f"{__file__}:make", "--candidate", "float32", "--format", "json"])
    out = capsys.readouterr()
    assert code == 1 and "compares the model with itself" not in out.err, out.err
    assert '"candidate / floor model"' in out.out and "fp32 / fp64" in out.out
