"""A non-finite value the code writes itself (t[i] = inf, t[mask] = v, t[:, 0] = v) is named as
such, with the line that wrote it - not as "an input tensor []" of unknown origin."""

from __future__ import annotations

import math

import pytest
import torch

import fpdoctor


def _through_view(t: torch.Tensor) -> None:
    t.view(-1)[3] = math.inf


def _through_mask(t: torch.Tensor) -> None:
    t[t > 0.5] = math.inf


def _through_slice(t: torch.Tensor) -> None:
    t[:, 0] = math.inf


@pytest.mark.parametrize("write", [_through_view, _through_mask, _through_slice])
def test_a_value_written_by_the_code_is_the_codes_own(write):
    with fpdoctor.trace() as t:
        x = torch.ones(4, 4)
        write(x)
        (x - x).sum()
    (finding,) = t.report.by_name("nonfinite-input")
    assert finding.title == "Your code wrote +inf into a tensor"
    assert finding.evidence["origin"] == "constant" and finding.evidence["kind"] == "+inf"
    assert finding.evidence["location"].endswith(f" in {write.__name__}")
    assert "finfo" in finding.fix
    # and no op is blamed for a NaN it made from that Inf as if from finite inputs
    assert not [f for f in t.report.by_name("nonfinite-produced") if "finite inputs" in f.title]


def test_an_inf_in_the_batch_stays_an_input():
    batch = torch.ones(2, 3)
    batch[0, 0] = math.inf  # written before the trace: the data arrives with it
    with fpdoctor.trace() as t:
        (batch * 2).sum()
    (finding,) = t.report.by_name("nonfinite-input")
    assert finding.evidence["origin"] == "input" and "wrote" not in finding.title


def test_an_in_place_op_shows_what_it_read_not_what_it_wrote():
    with fpdoctor.trace() as t:
        x = torch.full((4,), 3e38)
        x.mul_(10.0)  # overflows float32 in place
        x.sum()
    finding = t.report.by_name("nonfinite-produced")[0]
    assert finding.where["op"] == "aten.mul_.Tensor" and "from finite inputs" in finding.message
    (read,) = finding.evidence["inputs"]
    assert read["max"] == pytest.approx(3e38, rel=1e-6) and read["nonfinite"] is None  # not the +inf it wrote


def test_a_finite_write_into_a_nan_tensor_does_not_make_it_finite():
    """A forward hook writes a NaN into a layer's output; in the backward, autograd's CopySlices
    zeroes that one slot of a gradient that is NaN everywhere else. The gradient stays NaN, so the
    next matmul's NaN came from its input: no op is blamed for NaN "from finite inputs"."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    def poison(module, args, output):
        output = output.clone()
        output[0, 0] = math.nan
        return output

    model[0].register_forward_hook(poison)
    with fpdoctor.trace(model) as t:
        y = model(torch.randn(4, 8))
        ((y - y.mean()) ** 2).sum().backward()  # the mean spreads the NaN over every gradient
    (written,) = t.report.by_name("nonfinite-input")
    assert written.where["phase"] == "forward" and "nan" in written.message
    assert t.report.by_name("nonfinite-produced") == []
