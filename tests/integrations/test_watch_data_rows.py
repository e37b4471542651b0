"""`fpdoctor watch` on a loss that overflows because one item of the batch is far out of line with the
others (a reading of 1e30): the replay's model outputs were finite, so it said "made after the model, in
the loss code" and listed loss-code causes. The output's rows that stand out are named, and the fix is
the data's; a batch whose rows differ as a healthy one's do keeps the loss-code wording."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fpdoctor


@pytest.mark.parametrize("corrupt", [True, False])
def test_an_output_row_far_out_of_line_is_named_as_the_data(corrupt):
    torch.manual_seed(0)
    x = torch.randn(256, 10)
    y = x[:, :3].sum(1, keepdim=True)
    if corrupt:
        x[77, 4] = 3e25  # the output's row is ~1e25, its square past float32's range
    else:
        y[77] = 1e30  # a target past the range: the model's rows are as any batch's
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with fpdoctor.watch() as w:
        for xb, yb in loader:
            loss = nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break
    replayed = w.report.by_name("deterministic-nonfinite")[0]
    if corrupt:
        assert "row 13 of the 16 along dim 0 of the output stands out" in replayed.message, replayed.message
        assert "Not a precision change" in replayed.fix and "fpdoctor trace" in replayed.fix
    else:
        assert "stands out" not in replayed.message and "in the loss computation" in replayed.message
