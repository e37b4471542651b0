"""The experiment engine's raising modes (numerics/engine/raising.py) and writes into a tensor: a check
that holds a value in a wider dtype must let the code write into it as the code does (a write into a
copy is lost), and compute each write as the printed fix would (a line off the raised ones reads what
they made cast back)."""

from __future__ import annotations

import inspect

import torch

from fpdoctor.numerics.engine.raising import RaisedLines, RaisedSites


def _accumulate(xs: torch.Tensor) -> torch.Tensor:
    acc = torch.zeros(xs.shape[1], dtype=xs.dtype)
    for x in xs:
        acc += x
    return acc


def test_an_in_place_sum_off_the_raised_lines_runs_as_the_printed_fix_has_it():
    # "line L in fp32, cast back": acc is made in fp32 and cast back, so `acc += x` sums in fp16 and stalls
    # at 32 (0.01 is below half of fp16's spacing there); never the exact 40.97, never a lost write (0)
    start = inspect.getsourcelines(_accumulate)[1]
    xs = torch.full((4096, 4), 0.01).half()
    with torch.no_grad(), RaisedLines({(__file__, start + 1)}, torch.float16) as mode:
        got = _accumulate(xs)
    printed = torch.zeros(4, dtype=torch.float32).half()
    for x in xs:
        printed += x
    assert mode.raised == 1 and torch.equal(got.half(), printed), (got, printed)


def _unsqueezed(x: torch.Tensor) -> torch.Tensor:
    x = x * 2
    x.unsqueeze_(0)
    return x.sum()


def test_an_in_place_op_that_changes_only_a_shape_runs_on_the_tensor_itself():
    start = inspect.getsourcelines(_unsqueezed)[1]
    with torch.no_grad(), RaisedLines({(__file__, start + 2)}, torch.float16):
        assert float(_unsqueezed(torch.ones(3).half())) == 6.0


def _coupling(th: torch.Tensor) -> torch.Tensor:
    nb = torch.zeros_like(th)
    d = th[:-1] - th[1:]
    nb[1:] += d
    nb[1:] += d * 1e-9
    return nb


def test_an_augmented_assignment_into_a_state_held_in_fp64_keeps_it_fp64():
    # Python runs `nb[1:] += d` as a view, an in-place add and a store of the view back: the store keeps
    # what it is given, so the 1e-9 update survives in the fp64 state as it does in the printed fix
    line = f"{__file__}:{inspect.getsourcelines(_coupling)[1] + 1}"
    th = torch.tensor([1.0, 0.5, 0.25, 0.125])
    with RaisedSites([(torch.zeros_like, line)], torch.float32):
        got = _coupling(th)
    printed = torch.zeros_like(th.double())
    d = th[:-1] - th[1:]
    printed[1:] += d
    printed[1:] += d * 1e-9
    assert got.dtype == torch.float64 and torch.equal(got, printed), (got - printed).tolist()
