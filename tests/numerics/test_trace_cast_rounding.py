"""What a narrowing cast did, said in the terms of what it held: uniform noise cast to bf16 (a
Gumbel-softmax written by hand) rounds draws near 1 to exactly 1, where -log(-log(u)) is +inf. The
cast's account said "bfloat16 holds integers exactly only up to 256" of values in [0, 1); it says the
format's precision and how many values became exactly 1 (or 0). Whole numbers keep the integer limit."""

from __future__ import annotations

import torch

import fpdoctor
from fpdoctor.numerics.trace.headroom import _consequence


def _origin(step) -> str:  # type: ignore[no-untyped-def]
    with fpdoctor.Trace() as tr:
        step()
    return tr.report.findings[0].message


def test_noise_cast_to_bf16_is_told_by_the_draws_that_became_1() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, 128).to(torch.bfloat16)

    def gumbel() -> None:
        u = torch.rand(64, 128).to(torch.bfloat16)
        torch.softmax(logits - torch.log(-torch.log(u)), -1)

    message = _origin(gumbel)
    assert "the cast aten._to_copy.default" in message, message
    assert "holds integers" not in message and "bfloat16 keeps 8 significant bits" in message
    assert "value(s) that are not ±1 become exactly ±1" in message


def test_a_range_near_the_max_says_how_much_larger_overflows_to_two_places() -> None:
    assert "values 1.02x larger overflow fp16" in _consequence(0.98, "fp16", False)
