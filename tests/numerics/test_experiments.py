"""The experiments at the first NaN/Inf producer decide its cause, and the printed fix was tried.

Each reproduction is a class of real incidents: a cast that rounds integers (positions or
timesteps above what fp16/bf16 hold exactly), a constant that rounds to zero in the compute
dtype, a reduction in fp16, a custom kernel returning a value its own re-run does not, and a
genuine overflow that fp64 has too."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn

import fpdoctor
from fpdoctor.numerics.engine import reruns as experiments
from fpdoctor.numerics.engine.reruns import Window


def _first(t, label: str = "first Inf"):
    found = [f for f in t.report.by_name("nonfinite-produced") if f.evidence.get("first") == label]
    assert found, [f.title for f in t.report.findings]
    return found[0]


def _line(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


# -- a cast that rounds integers -----------------------------------------------------------------
def _positions_through_sin(dtype: torch.dtype, start: int) -> None:
    pos = torch.arange(start, start + 24)
    p = pos.to(dtype)  # the origin: integers above what the dtype holds exactly
    angle = p / 512
    gap = torch.sin(angle[:, None] - angle[None, :])  # 0 where two positions rounded together
    (1 / (gap + torch.eye(24, dtype=dtype))).sum()


@pytest.mark.parametrize(("dtype", "start", "exact"), [(torch.float16, 2040, 2048), (torch.bfloat16, 250, 256)])
def test_a_cast_that_rounds_integers_is_the_origin_not_the_op_that_overflowed(dtype, start, exact):
    with fpdoctor.trace() as t:
        _positions_through_sin(dtype, start)
    finding = _first(t)
    experiment = finding.evidence["experiment"]
    assert finding.where["op"] == "aten.reciprocal.default"
    # raising the precision of the op that showed the Inf, alone, was tried and does not help
    assert experiment["rerun_as_ran"] == "inf again" and experiment["rerun_fp64"] == "inf again"
    assert experiment["verdict"] == "origin"
    assert experiment["origin"]["op"] == "aten._to_copy.default"
    cast_line = _line(_positions_through_sin, "p = pos.to(dtype)")
    assert experiment["origin"]["location"].endswith(f":{cast_line}")
    assert f"integers exactly only up to {exact}" in experiment["cast"]
    assert experiment["fix_checked"]["finite_after"] and experiment["fix_checked"]["precision"] == "fp32"
    assert "the cast aten._to_copy.default" in finding.fix and "Verified" in finding.fix
    assert "sin" not in finding.fix.split("Verified")[0]  # the fix names the cast, not the trig function


# -- a constant that rounds to zero --------------------------------------------------------------
def _pairwise_distance(x: torch.Tensor, eps: float) -> None:
    d2 = ((x[:, None] - x[None]) ** 2).sum(-1)
    dist = torch.sqrt(d2 + eps)  # eps is 0 in the compute dtype: sqrt's backward is 1/0 on the diagonal
    dist.sum().backward()


@pytest.mark.parametrize(("dtype", "eps"), [(torch.float16, 1e-12), (torch.float16, 1e-9), (torch.bfloat16, 1e-45)])
def test_an_eps_that_rounds_to_zero_is_named_with_its_rounded_value(dtype, eps):
    torch.manual_seed(0)
    x = torch.randn(6, 3).to(dtype).requires_grad_()
    with fpdoctor.trace() as t:
        _pairwise_distance(x, eps)
    finding = _first(t)
    experiment = finding.evidence["experiment"]
    assert finding.where["phase"] == "backward"
    assert experiment["verdict"] == "origin" and experiment["origin"]["op"] == "aten.add.Tensor"
    assert experiment["origin"]["location"].endswith(f":{_line(_pairwise_distance, 'torch.sqrt(d2 + eps)')}")
    constant = {k: experiment["constant"][k] for k in ("value", "rounded", "dtype")}
    assert constant == {"value": eps, "rounded": 0.0, "dtype": str(dtype).removeprefix("torch.")}
    assert f"the constant {eps:g}" in finding.fix and experiment["fix_checked"]["finite_after"]
    # the fix that keeps the dtype was tried too: the smallest normal value instead of eps
    assert experiment["constant"]["replacement_checked"] == torch.finfo(dtype).tiny
    assert "finite as it ran" in finding.fix
    # the NaN that the Inf makes later (0 * inf) is traced to the same constant, not to its own op
    nan = _first(t, "first NaN").evidence["experiment"]
    assert nan["verdict"] == "origin" and nan["origin"]["op"] == "aten.add.Tensor" and nan["rerun_fp64"] == "nan again"


# -- a reduction in fp16 -------------------------------------------------------------------------
def test_an_fp16_sum_whose_fp32_accumulation_is_finite_is_its_own_origin_and_the_fix_is_checked():
    x = torch.full((4096,), 8.0, dtype=torch.float16)  # each square 64, the sum 262144 > 65504
    with fpdoctor.trace() as t:
        (x * x).sum() / 4096
    finding = _first(t)
    experiment = finding.evidence["experiment"]
    assert experiment["verdict"] == "origin" and experiment["origin"]["op"] == "aten.sum.default"
    assert experiment["rerun_fp64"] == "finite" and experiment["upstream_ops_tried"] == 0
    assert experiment["fix_checked"] == {
        "precision": "fp32", "absmax_before": math.inf, "absmax_after": 262144.0, "finite_after": True,
    }  # fmt: skip
    assert (
        experiment["rerun_bf16"] == "finite" and "in bf16 the same ops give a finite result" in finding.fix
    )  # the advice names bf16: checked
    assert "dtype=torch.float32" in finding.fix and "262144" not in finding.fix  # 2.62e+05
    assert "max |x| inf -> 2.62e+05" in finding.fix


# -- a custom kernel returning an impossible value ------------------------------------------------
_calls = [0]


@torch.library.custom_op("fpdoctor_test::flaky_double", mutates_args=())
def _flaky_double(x: torch.Tensor) -> torch.Tensor:
    """2x, except that its first call writes an Inf: a kernel that went wrong once."""
    _calls[0] += 1
    y = x * 2
    if _calls[0] == 1:
        y[0] = math.inf
    return y


@_flaky_double.register_fake
def _(x):
    return torch.empty_like(x)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _flaky_double(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@pytest.mark.parametrize("call", [_flaky_double, _Twice.apply], ids=["custom-op", "autograd-function"])
def test_a_custom_op_whose_rerun_is_finite_points_at_the_device_or_library(call):
    _calls[0] = 0
    x = torch.linspace(-3.9, 3.3, 8)
    with fpdoctor.trace() as t:
        call(x).sum()
    finding = _first(t)
    assert finding.where["op"] == "fpdoctor_test.flaky_double.default"
    assert finding.evidence["experiment"]["verdict"] == "device-or-library"
    assert finding.evidence["experiment"]["rerun_as_ran"] == "finite"
    assert "device or the library" in finding.fix and "epsilon" not in finding.fix
    # where the kernel came from: whose code to test (here the test's own definition above)
    assert f"a custom op defined by your code at {__file__}:" in finding.message


def test_a_custom_op_that_always_returns_inf_is_not_blamed_on_the_device():
    @torch.library.custom_op("fpdoctor_test::always_inf", mutates_args=())
    def always_inf(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        y[0] = math.inf
        return y

    with fpdoctor.trace() as t:
        always_inf(torch.ones(4)).sum()
    experiment = _first(t).evidence["experiment"]
    # a custom op's fp64 run is its own kernel again: neither the machine nor "the math" is shown
    assert experiment["rerun_as_ran"] == "inf again" and experiment["verdict"] == "opaque"
    assert "custom op" in _first(t).title and "device" not in _first(t).fix


# -- the math itself -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make", [lambda: torch.exp(torch.tensor([1.0, 1000.0])), lambda: torch.ones(3) / torch.zeros(3)]
)
def test_a_genuine_fp32_overflow_is_the_math_and_no_precision_fix_is_printed(make):
    with fpdoctor.trace() as t:
        make().sum()
    finding = _first(t)
    experiment = finding.evidence["experiment"]
    assert experiment["verdict"] == "the-math" and experiment["rerun_fp64"] == "inf again"
    assert "fp64 too" in finding.title
    assert "keep it in fp32" not in finding.fix and "fp32 will not help" in finding.fix


@pytest.mark.parametrize("op", ["exp", "_softmax", "sum", "mul", "bmm", "_log_softmax", "div"])
def test_advice_that_the_math_experiment_refuted_loses_its_precision_clause(op):
    from fpdoctor.numerics.engine.reruns import _without_precision
    from fpdoctor.numerics.trace.blame import OP_ADVICE

    kept = _without_precision(OP_ADVICE[op] + "; this op ran in torch.float16: keeping it in fp32 is the quickest test")
    assert kept and "fp32" not in kept


# -- what the experiments must never do ----------------------------------------------------------
def test_a_healthy_trace_runs_no_experiment():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with fpdoctor.trace(model) as t:
        model(torch.randn(4, 8)).sum().backward()
    assert t.tracer.experiments == {} and not t.tracer.errors


def test_experiments_change_neither_the_users_tensors_nor_the_rng():
    torch.manual_seed(0)
    x = torch.full((4,), 300.0, dtype=torch.float16)
    acc = torch.zeros(4, dtype=torch.float16)
    with fpdoctor.trace() as t:
        acc.add_(x)  # an in-place op in the chain: re-run on a copy, never on `acc`
        y = torch.nn.functional.dropout(acc, 0.5)  # seeded randomness: never re-run
        z = (acc * acc) * y
        state = torch.get_rng_state()
        z.sum()
    after = torch.get_rng_state()
    assert torch.equal(acc, torch.full((4,), 300.0, dtype=torch.float16))
    assert torch.equal(state, after)
    assert t.tracer.experiments  # they ran


def test_an_input_written_in_place_after_the_op_is_not_taken_for_a_device_fault():
    """Deferred mode (accelerators) learns of the Inf a batch of ops later: by then the input may
    have changed, and a re-run on it must not read as 'the device computed something else'."""
    x = torch.tensor([1.0, 1000.0])
    with fpdoctor.trace() as t:
        t.tracer.immediate = False
        y = torch.exp(x)
        x.mul_(0)  # the input the exp read is gone
        y.sum()
    experiment = _first(t).evidence["experiment"]
    assert experiment["verdict"] != "device-or-library"
    assert "written in place" in experiment["rerun_as_ran"]


def test_the_trace_holds_no_tensor_of_the_block_after_it():
    import gc
    import weakref

    with fpdoctor.trace() as t:
        x = torch.randn(64)
        y = torch.exp(x)
        kept = weakref.ref(y)
        del x, y
    gc.collect()
    assert kept() is None and not t.tracer._window.steps


def test_the_window_keeps_a_bounded_number_of_ops():
    window = Window(size=3)
    for i in range(10):
        window.append((experiments.Record(i, "op", "forward", None, None, False, None, None, None, []), None, (), {}))
    assert sorted(window.by_index()) == [7, 8, 9]


def test_the_sentinels_replay_carries_the_experiment():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = fpdoctor.Sentinel(model, opt)

    def bad(x):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = (out / (out - out)).mean()  # 0/0: in any precision
        loss.backward()
        return loss

    guard.step(bad, torch.randn(4, 8))
    verdict = guard.report.by_name("deterministic-nonfinite")[0]
    experiment = verdict.evidence["experiment"]
    assert experiment["op"] == verdict.where["op"] and experiment["verdict"] == "the-math"
    assert experiment["rerun_as_ran"].endswith(" again") and experiment["rerun_fp64"].endswith(" again")


def test_raise_on_nonfinite_raises_with_the_experiment_already_run():
    pos = torch.arange(2040, 2064)
    with pytest.raises(fpdoctor.NonFiniteError) as caught, fpdoctor.trace(raise_on="nonfinite"):
        p = pos.to(torch.float16)
        1 / (p[:, None] - p[None, :] + torch.eye(24, dtype=torch.float16))
    experiment = caught.value.finding.evidence["experiment"]
    assert experiment["origin"]["op"] == "aten._to_copy.default" and "rounds" in experiment["cast"]


def test_the_window_keeps_a_bounded_number_of_bytes_and_always_the_newest_op():
    def step(i: int, *args):
        return (experiments.Record(i, "op", "forward", None, None, False, None, None, None, []), None, args, {})

    window = Window(size=100, max_bytes=3 * 4096)
    weight = torch.zeros(1 << 20, requires_grad=True)  # a parameter: alive anyway, not counted
    for i in range(10):
        window.append(step(i, torch.zeros(1024), weight))  # 4096 bytes each
    assert sorted(window.by_index()) == [7, 8, 9] and window.bytes == 3 * 4096
    window.append(step(10, torch.zeros(1 << 16)))  # larger than the whole budget: kept alone
    assert sorted(window.by_index()) == [10]
    window.clear()
    assert not window.steps and window.bytes == 0
