"""A random draw made in bf16 or fp16 (`torch.rand_like(x)` of a narrow x): its values are the
format's, 0 among them and none near 1, so -log(u) is Inf now and then and a Gumbel noise is capped
at 5.5 in bf16 (a sampler that never explores). The walk upstream reaches the draw, which no re-run
can raise: the check is a fresh fp32 draw of the same shape with the ops after it as they ran, and
the fix (draw in fp32) applied as printed is finite and uncapped."""

from __future__ import annotations

import pytest
import torch

import fpdoctor


def _gumbel(logits: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    u = torch.rand_like(logits, dtype=torch.float32) if fp32 else torch.rand_like(logits)
    return logits + -torch.log(-torch.log(u))  # Gumbel-max sampling by hand


def _exponential(rate: torch.Tensor, *, fp32: bool = False) -> torch.Tensor:
    u = torch.rand_like(rate, dtype=torch.float32) if fp32 else torch.rand_like(rate)
    return -torch.log(u) / rate  # waiting times of a Poisson process


@pytest.mark.parametrize(("sample", "dtype"), [(_gumbel, torch.bfloat16), (_exponential, torch.float16)])
def test_a_draw_in_a_narrow_dtype_is_the_origin_and_drawing_in_fp32_works_as_printed(sample, dtype) -> None:
    torch.manual_seed(0)
    x = (torch.rand(256, 1000) + 0.5).to(dtype)
    with fpdoctor.Trace() as tr:
        sample(x)
    first = tr.report.findings[0]
    assert first.name == "nonfinite-produced" and "a random draw in" in first.title, str(tr.report)
    assert first.fix.startswith("Draw it in fp32: aten.rand_like.default at "), first.fix
    assert first.trial is not None and first.trial.tried and "fresh" in first.trial.on
    torch.manual_seed(0)
    fixed = sample(x, fp32=True)  # as printed
    assert bool(torch.isfinite(fixed).all())
    if sample is _gumbel:  # the noise is no longer capped by bf16's largest value below 1
        assert float((fixed - x.float()).max()) > 8.0
        assert float((sample(x) - x).float()[torch.isfinite(sample(x))].max()) < 6.0


def test_a_draw_in_fp32_cast_down_afterwards_is_not_this_finding() -> None:
    torch.manual_seed(0)
    x = torch.rand(64, 100).to(torch.bfloat16)
    with fpdoctor.Trace() as tr:
        -torch.log(torch.rand(64, 100, dtype=torch.float32)).to(torch.bfloat16) + x
    assert not [f for f in tr.report.findings if "random draw" in f.title], str(tr.report)
