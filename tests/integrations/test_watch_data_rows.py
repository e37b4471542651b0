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


def _first_replayed(model: nn.Module, batches, loss_of, *, lr: float):
    """Train under `fpdoctor.watch()` until the loss is not finite; the first replay's verdict."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with fpdoctor.watch() as w:
        for a, b in batches:
            loss = loss_of(a, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break
    return w.report.by_name("deterministic-nonfinite")[0]


@pytest.mark.parametrize("corrupt", [True, False])
def test_an_output_row_far_out_of_line_is_named_as_the_data(corrupt):
    torch.manual_seed(0)
    x = torch.randn(256, 10)
    y = x[:, :3].sum(1, keepdim=True)
    if corrupt:
        x[77, 4] = 3e25  # the output's row is ~1e25, its square past float32's range
    else:
        y[77] = 1e30  # a target past the range: the model's rows are as any batch's
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    batches = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    replayed = _first_replayed(model, batches, lambda xb, yb: nn.functional.mse_loss(model(xb), yb), lr=1e-3)
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
    # every row of the first batch masked
    batches = [(x[16 * k : 16 * (k + 1)], torch.zeros(16, 1) if k == 0 else torch.ones(16, 1)) for k in range(4)]
    replayed = _first_replayed(model, batches, lambda xb, keep: ((model(xb) ** 2) * keep).sum() / keep.sum(), lr=1e-6)
    assert "stands out" not in replayed.message and "a mean over an empty selection" in replayed.message
