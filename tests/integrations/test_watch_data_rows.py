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


def test_a_nan_of_the_loss_codes_own_beside_an_output_row_out_of_line_keeps_the_loss_code_wording():
    """0/0 of a masked mean whose mask is empty, in a batch that also holds a row far out of line (finite):
    the NaN is the loss code's, whatever the row; only an overflow (Inf) is put to the row."""
    torch.manual_seed(0)
    x = torch.randn(64, 10)
    x[5, 2] = 5e4
    model = nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with fpdoctor.watch() as w:
        for step in range(4):
            xb = x[16 * step : 16 * (step + 1)]
            keep = torch.zeros(16, 1) if step == 0 else torch.ones(16, 1)  # every row of the first batch masked
            loss = ((model(xb) ** 2) * keep).sum() / keep.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break
    replayed = w.report.by_name("deterministic-nonfinite")[0]
    assert "stands out" not in replayed.message and "a mean over an empty selection" in replayed.message
