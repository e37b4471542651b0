"""A log that reads what an exp two lines up underflowed: a kernel density estimate's log-density
of readings far from every centre, in fp16 (exp(-0.5 z^2) is 0 past z of about 5.6). The log's line
in fp32 still takes the log of 0; the lines that make the kernel in fp32, from the inputs as the
candidate gets them, give it back. compare says so, and does not send the user to pass the inputs
unrounded (their rounding is no part of it); the fix as printed leaves no error."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import fpdoctor


class Density(nn.Module):
    """log p(x) of a Gaussian kernel density estimate over fixed centres."""

    def __init__(self, fixed: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("centres", torch.randn(64, generator=g).half().float())
        self.bandwidth, self.fixed = 0.25, fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed:  # the printed fix: the kernel and the log in fp32, the result cast back
            z = (x.float()[:, None] - self.centres.float()) / self.bandwidth
            kernel = torch.exp(-0.5 * z * z)
            return torch.log(kernel.mean(-1)).to(x.dtype)
        z = (x[:, None] - self.centres) / self.bandwidth
        kernel = torch.exp(-0.5 * z * z)
        return torch.log(kernel.mean(-1))


def test_a_log_of_an_underflowed_exp_names_the_lines_that_make_it_not_the_inputs():
    g = torch.Generator().manual_seed(1)
    x = (
        torch.cat([torch.randn(200, generator=g), 4.5 + 0.5 * torch.rand(56, generator=g)]).half().float()
    )  # outliers last
    result = fpdoctor.compare(Density(), x, candidate="fp16")
    first = result.report.findings[0]
    lines, start = inspect.getsourcelines(Density.forward)
    z = start + max(k for k, line in enumerate(lines) if "z = (x[:, None]" in line)
    assert first.name == "nonfinite-produced", [(f.code, f.title) for f in result.report.findings]
    assert first.trial is not None and first.trial.tried, first.trial
    assert f"{__file__}:{z + 1}" in first.evidence["feeding_lines"], first.evidence  # the exp's line
    assert "pass the model's inputs in fp32" not in first.fix and not first.evidence.get("inputs_as_given"), first.fix
    fixed = fpdoctor.compare(Density(fixed=True), x, candidate="fp16")
    assert not [f for f in fixed.report.findings if f.severity == "error"], fixed.report.findings
