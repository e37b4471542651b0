"""A gradient that reaches the optimizer non-finite from a backward the trace does not see op by op
(a torch.compile'd graph's) is one finding that says so, not one 'check the data pipeline' per
parameter: the op that made the NaN is the trace's first finding, or the eager trace's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fpdoctor


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_gradients_made_non_finite_in_a_compiled_backward_are_one_finding_that_says_where() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fpdoctor.Trace() as tr:
        for step in range(3):
            p = compiled(torch.randn(8, 8)).softmax(-1)
            loss = -(p * torch.log(p * (step < 2))).sum()  # log(0) on the last step
            opt.zero_grad()
            loss.backward()
            opt.step()
    inputs = [f for f in tr.report.findings if f.name == "nonfinite-input"]
    assert len(inputs) <= 1, [f.message[:120] for f in inputs]  # before: one per parameter, 4
    for f in inputs:
        assert f.evidence["origin"] == "gradient" and "TORCH_COMPILE_DISABLE=1" in f.fix, f.fix
        assert "data pipeline" not in f.fix
