"""The code a plan hands over is plain torch, and the applied model takes the inputs the user has."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

import fpdoctor
from tests.precision import factories


def imports(code: str) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add((node.module or "").split(".")[0])
    return found


@pytest.fixture(scope="module")
def overflow_plan():
    model, x = factories.overflow_attention()
    return fpdoctor.plan(model, x, candidate="fp16").plan


@pytest.fixture(scope="module")
def kept_plan():
    model, x = factories.ill_conditioned()
    return fpdoctor.plan(model, x, candidate="fp16").plan


def test_the_code_needs_only_torch_and_does_what_apply_plan_does(kept_plan):
    assert kept_plan.verified and kept_plan.keep_fp32 == ["attn"] and not kept_plan.fp32_ops
    code = kept_plan.to_code()
    assert imports(code) == {"copy", "torch"} and "fpdoctor" not in code  # the standard library and torch
    model, x = factories.ill_conditioned()
    namespace = {"model": model}
    exec(code, namespace)
    applied, _ = factories.ill_conditioned()
    fpdoctor.apply_plan(applied, kept_plan)
    with torch.no_grad():
        pasted, planned = model(x), applied(x)  # the fp32 inputs the user has
    assert pasted.dtype == planned.dtype == torch.float16 and torch.isfinite(pasted).all()
    assert torch.equal(pasted, planned)
    assert model.attn.value.weight.dtype == torch.float32 and model.head.weight.dtype == torch.float16


def test_nothing_kept_means_no_keep_function_and_no_fpdoctor_import():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    the_plan = fpdoctor.plan(model, x, candidate="bf16").plan
    assert the_plan.verified and the_plan.keep_fp32 == []
    code = the_plan.to_code()
    assert imports(code) == {"torch"} and "def keep_in_fp32" not in code and "register_forward_hook" not in code
    namespace = {"model": model}
    exec(code, namespace)
    assert model(x).dtype == torch.bfloat16  # the boundary cast takes the fp32 inputs


def test_the_applied_model_takes_the_original_fp32_inputs(overflow_plan):
    model, x = factories.overflow_attention()
    fpdoctor.apply_plan(model, overflow_plan)
    out = model(x)  # before: "mat1 and mat2 must have the same dtype"
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert torch.equal(model(x.half()), out)  # inputs already in fp16 are taken as they are
    fpdoctor.apply_plan(model, overflow_plan)  # applying twice adds no second cast
    assert torch.equal(model(x), out)


def test_keep_in_fp32_stays_public():
    from fpdoctor.precision.audit.boundary import keep_in_fp32

    assert fpdoctor.keep_in_fp32 is keep_in_fp32
    assert "keep_in_fp32" in fpdoctor.__all__


def test_the_code_casts_nested_and_named_outputs():
    """A kept module that returns a tuple, a dict or a named tuple gets its outputs cast back in kind."""
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")

    class Splits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            y = self.lin(x)
            return Pair(y, {"rest": (y * 2, torch.arange(3))})

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.split = Splits()
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            pair = self.split(x)
            return self.out(pair.a + pair.b["rest"][0])

    from fpdoctor.precision.plan.plan import Plan

    the_plan = Plan(
        candidate="fp16", keep_fp32=["split"], fp32_outputs=[], verified=True, final_error=0.0, tolerance=1.0,
        baseline_error=1.0,
    )  # fmt: skip
    model, x = Model(), torch.randn(4, 8)
    namespace = {"model": model}
    exec(the_plan.to_code(), namespace)
    pair = model.split(x.half())
    assert isinstance(pair, Pair) and pair.a.dtype == torch.float16
    assert pair.b["rest"][0].dtype == torch.float16 and pair.b["rest"][1].dtype == torch.int64
    assert model(x).dtype == torch.float16


def test_harmonize_after_apply_plan_moves_the_input_cast_along():
    from fpdoctor.precision.plan.plan import Plan

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    the_plan = Plan(
        candidate="fp16", keep_fp32=[], fp32_outputs=[], verified=True, final_error=0.0, tolerance=1.0,
        baseline_error=0.0,
    )  # fmt: skip
    fpdoctor.apply_plan(model, the_plan)
    fpdoctor.harmonize(model, "cpu", dtype=torch.bfloat16)
    out = model(torch.randn(2, 8))  # the fp32 inputs, cast to bf16 now, not to the plan's fp16
    assert out.dtype == torch.bfloat16
