"""A fix at the op, not the module: when compare finds the one op inside a module that overflows,
plan tries that op and what consumes it (up to the softmax) in fp32, verifies it like a module
plan, and gives the edit that does it in the user's own source."""

from __future__ import annotations

import copy
import inspect
import re
import textwrap

import torch

import fpdoctor
from fpdoctor.precision.metrics import flat_sample, rel_error
from tests.precision import factories


def test_the_overflowing_op_alone_is_computed_in_fp32():
    model, x = factories.tempered_attention()
    result = fpdoctor.plan(model, x, candidate="fp16")
    the_plan = result.plan
    # before: all of `attn` (its three projections included) in fp32
    assert the_plan.verified and the_plan.keep_fp32 == []
    (fix,) = the_plan.fp32_ops
    assert (fix.module, fix.op) == ("attn", "aten.bmm.default")
    lines = {n: text for n, text in enumerate(inspect.getsource(factories).splitlines(), 1)}
    assert "scores = self.q(x) @ self.k(x)" in lines[int(fix.location.rpartition(":")[2])]
    assert "torch.softmax(scores" in lines[int(fix.end.rpartition(":")[2])]
    assert the_plan.final_error <= the_plan.target
    summary = dict(result.report.data["summary"])
    assert summary["compute in fp32 in `attn`"].startswith("aten.bmm.default (")
    assert "keeping the whole module in fp32 reaches" in summary["why the op, not all of `attn`"]
    divergence = result.report.by_name("precision-divergence")[0]
    assert divergence.severity.value == "warning" and "The plan computes aten.bmm.default" in divergence.message


def test_apply_plan_runs_the_op_in_fp32_and_the_rest_in_fp16():
    model, x = factories.tempered_attention()
    the_plan = fpdoctor.plan(model, x, candidate="fp16", metric="rel").plan  # judged below by the relative error
    truth = model.double()(x.double())
    applied, _ = factories.tempered_attention()
    fpdoctor.apply_plan(applied, the_plan)
    assert applied.attn.q.weight.dtype == torch.float16  # the projections stay in fp16
    with torch.no_grad():
        out = applied(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert rel_error(flat_sample(out), flat_sample(truth)) <= the_plan.target
    plain, _ = factories.tempered_attention()
    plain.half()
    with torch.no_grad():
        assert not torch.isfinite(plain(x.half())).all()  # without it, fp16 overflows


def test_the_edit_in_the_code_is_the_fix():
    """Apply the code's edit to the attention's own source: the pasted plan then runs fp16 finite."""
    model, x = factories.tempered_attention()
    code = fpdoctor.plan(model, x, candidate="fp16").plan.to_code()
    edits = re.findall(r"#     was: (.*)\n#     now: (.*)", code)
    assert len(edits) == 2, code
    source = textwrap.dedent(inspect.getsource(factories.TemperedAttention))
    for was, now in edits:
        line = next(text for text in source.splitlines() if text.strip().startswith(was.split("  #")[0].strip()))
        source = source.replace(line, line[: len(line) - len(line.lstrip())] + now)
    namespace: dict = {"torch": torch, "nn": torch.nn}
    exec(source, namespace)
    edited = namespace["TemperedAttention"]()
    edited.load_state_dict(model.attn.state_dict())
    model.attn = edited
    pasted = {"model": model}
    exec(code, pasted)
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()


class TwoOverflows(factories.TemperedAttention):
    """Overflows a second time after the softmax: a gain applied and taken back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 1e5 / 1e5


def test_an_op_fix_that_does_not_reach_the_target_is_not_offered():
    model, x = factories.tempered_attention()
    two = TwoOverflows()
    two.load_state_dict(model.attn.state_dict())
    model.attn = two
    the_plan = fpdoctor.plan(model, x, candidate="fp16").plan
    # the product's fix alone leaves the second overflow: verified, only the whole module will do
    assert the_plan.verified and "attn" in the_plan.keep_fp32 and the_plan.fp32_ops == []


class NamedAttention(factories.TemperedAttention):
    """The same attention, its product written on names: the edit casts back to `q.dtype`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        scores = q @ k.transpose(-1, -2)
        return torch.softmax(scores * self.temperature, dim=-1) @ self.v(x)


def test_the_edit_of_a_class_two_modules_share_casts_back_to_the_operands_dtype_and_runs_in_every_dtype():
    """Two attention modules of one class, one overflowing: the edit of the class's lines changes both,
    and one of them may be kept in fp32 whole. The result goes back to the dtype its operand had
    (`.to(q.dtype)`, not `.to(torch.float16)`): the edited model runs in fp32 still, and the plan as
    printed, with the edit in the class, runs fp16 finite where a kept fp32 module reads it too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(NamedAttention(), torch.nn.Linear(64, 64), NamedAttention(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        model[0].q.weight.mul_(150)
        model[0].k.weight.mul_(150)
    x = torch.randn(4, 32, 64)
    the_plan = fpdoctor.plan(model, x, candidate="fp16").plan
    code = the_plan.to_code()
    assert the_plan.verified and the_plan.fp32_ops, code
    edits = re.findall(r"#     was: (.*)\n#     now: (.*)", code)
    assert any(".to(q.dtype)" in now for _, now in edits), code
    source = textwrap.dedent(inspect.getsource(NamedAttention)).replace("(factories.TemperedAttention)", "(Base)")
    for was, now in edits:
        line = next(text for text in source.splitlines() if text.strip().startswith(was.split("  #")[0].strip()))
        source = source.replace(line, line[: len(line) - len(line.lstrip())] + now)
    namespace: dict = {"torch": torch, "nn": torch.nn, "Base": factories.TemperedAttention}
    exec(source, namespace)
    for i in (0, 2):  # the class edited: every module of it
        edited = namespace["NamedAttention"]()
        edited.load_state_dict(model[i].state_dict())
        model[i] = edited
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # in fp32 as before
        pasted = {"model": copy.deepcopy(model)}
        exec(code, pasted)  # the plan as printed, the class edited
        assert torch.isfinite(pasted["model"](x)).all()
        # a module of the edited class kept in fp32 whole reads the edited lines in fp32: no mixed dtypes
        kept = copy.deepcopy(model).half()
        kept[2].float()
        kept[2].register_forward_pre_hook(lambda m, args: tuple(a.float() for a in args))
        kept[2].register_forward_hook(lambda m, args, out: out.half())
        assert torch.isfinite(kept(x.half())).all()
