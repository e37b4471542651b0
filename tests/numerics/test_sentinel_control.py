"""The sentinel's control experiment: a bad step that reproduces is replayed again in fp32.

Finite in fp32 only: the precision is the cause. Non-finite in fp32 too: the data or the math.
The control never touches the user's state: weights, dtypes, gradients and autocast objects."""

from __future__ import annotations

import math

import torch
from torch import nn

import fpdoctor


class Amplifier(nn.Module):
    """A Linear whose outputs exceed fp16's 65504 for large inputs: finite in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)
        with torch.no_grad():
            self.fc.weight.fill_(0.5)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x) * 100.0)


def _step(model: nn.Module, opt: torch.optim.Optimizer):
    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    return step


def _run(model: nn.Module, batches: list[torch.Tensor], step=None):
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = fpdoctor.Sentinel(model, opt)
    fn = step or _step(model, opt)
    for x in batches:
        guard.step(fn, x)
    return guard.report


def test_an_fp16_overflow_is_finite_in_fp32_and_blamed_on_the_precision():
    torch.manual_seed(0)
    model = Amplifier().half()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.full((4, 8), 200.0, dtype=torch.float16)  # fc: 800, x100 = 80000 > 65504
    report = _run(model, [x])
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "finite"
    assert "on this step the precision is what fails" in verdict.message
    # the experiment found the op itself is the origin and checked it in fp32: its fix, not the control's
    assert verdict.evidence["experiment"]["verdict"] == "origin"
    assert verdict.fix.startswith("Compute aten.mul.Tensor") and "(checked: max |x| inf -> 8e+04)" in verdict.fix
    # 8e+04 is past fp16's range: cast back after the op, it would overflow again; the fix says to keep it
    assert "kept in fp32 for what reads it: its largest value, 8e+04, is past float16's 65504" in verdict.fix
    # and on the step's loss: the ops from that line down to it re-run with the line in fp32
    assert verdict.trial is not None and verdict.trial.tried and verdict.trial.metric.startswith("the step's loss")
    assert verdict.trial.before == "nan" and math.isfinite(verdict.trial.after)
    # the control put everything back: same tensors, same dtype, same values, no gradient
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float16 and torch.equal(value, before[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_a_bug_that_is_nonfinite_in_fp32_too_is_blamed_on_the_math():
    model = nn.Linear(4, 1).half()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = torch.log(model(x) - model(x)).float().mean()  # log(0) at any precision
        loss.backward()
        return loss

    report = _run(model, [torch.ones(2, 4, dtype=torch.float16)], step=step)
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "nonfinite"
    assert "not the precision" in verdict.message


def test_autocast_overflow_and_the_users_autocast_object_is_left_as_it_was():
    torch.manual_seed(0)
    model = Amplifier()  # fp32 parameters, fp16 compute under autocast
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    region = torch.autocast("cpu", dtype=torch.float16)  # made once, reused every step
    seen: list[bool] = []

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with region:
            seen.append(torch.is_autocast_enabled("cpu"))
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        return loss

    guard = fpdoctor.Sentinel(model, opt, reference_every=0)  # step_fn's calls counted: no reference step
    guard.step(step, torch.full((4, 8), 200.0))
    verdict = guard.report.by_name("deterministic-nonfinite")[0]
    assert verdict.evidence["control_fp32"] == "finite"
    # step, replay at the step's precision, control in fp32
    assert seen == [True, True, False]
    guard.step(step, torch.full((4, 8), 0.01))  # the next real step runs under autocast again
    assert seen[3:] == [True] and region._enabled is True


def test_an_fp32_model_gets_no_control():
    model = nn.Linear(4, 1)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = torch.log(model(x) - model(x)).mean()
        loss.backward()
        return loss

    report = _run(model, [torch.ones(2, 4)], step=step)
    verdict = report.by_name("deterministic-nonfinite")[0]
    assert "control_fp32" not in verdict.evidence


def test_the_control_never_touches_the_users_parameters_or_their_hooks(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = Amplifier().half()
        ddp = nn.parallel.DistributedDataParallel(model)  # world size 1: the control runs
        calls: list[int] = []

        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-6)
        guard = fpdoctor.Sentinel(ddp, opt)

        def step(x):
            opt.zero_grad(set_to_none=True)
            loss = ddp(x).float().pow(2).mean()
            loss.backward()
            return loss

        guard.step(step, torch.full((4, 8), 200.0, dtype=torch.float16))
        assert guard.report.by_name("deterministic-nonfinite")[0].evidence["control_fp32"] == "finite"
        assert all(p.dtype == torch.float16 for p in model.parameters())
        calls.clear()
        guard.step(step, torch.full((4, 8), 0.01, dtype=torch.float16))
        assert calls  # DDP's communication still runs through the user's hook after the control
    finally:
        dist.destroy_process_group()


def test_an_autocast_open_around_the_step_is_off_in_the_control_and_on_after():
    torch.manual_seed(0)
    model = Amplifier()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = fpdoctor.Sentinel(model, opt, reference_every=0)  # step_fn's calls counted: no reference step
    seen: list[bool] = []

    def step(x):
        opt.zero_grad(set_to_none=True)
        seen.append(torch.is_autocast_enabled("cpu"))
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    enter = torch.autocast.__enter__
    with torch.autocast("cpu", dtype=torch.float16):
        guard.step(step, torch.full((4, 8), 200.0))
        assert torch.is_autocast_enabled("cpu")
    assert seen == [True, True, False]
    assert guard.report.by_name("deterministic-nonfinite")[0].evidence["control_fp32"] == "finite"
    assert torch.autocast.__enter__ is enter  # nothing left patched


def test_tied_weights_and_a_scaler_that_unscales_for_clipping():
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8, bias=False)
            self.b = nn.Linear(8, 8, bias=False)
            self.b.weight = self.a.weight  # tied
            with torch.no_grad():
                self.a.weight.fill_(0.5)

        def forward(self, x):
            return self.b(self.a(x) * 100.0)

    model = Tied()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    scaler = torch.amp.GradScaler("cpu")
    guard = fpdoctor.Sentinel(model, opt, scaler=scaler)

    def step(x):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # the standard recipe for clipping under AMP
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return loss

    guard.step(step, torch.full((4, 8), 0.01))
    guard.step(step, torch.full((4, 8), 300.0))  # overflows fp16: replayed, then the control
    guard.step(step, torch.full((4, 8), 0.01))  # the scaler's state was put back: no "unscale_ already called"
    assert model.b.weight is model.a.weight and model.a.weight.dtype == torch.float32
    assert not guard.report.by_name("sentinel-error")


def test_an_optimizer_stepped_in_backward_is_not_replayed():
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}

    def in_backward(p):
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(in_backward)
    guard = fpdoctor.Sentinel(model)
    calls = {"n": 0}

    def step(x):
        calls["n"] += 1
        loss = model(x).mean()
        loss.backward()
        return loss + (float("nan") if calls["n"] == 1 else 0.0)

    before = model.weight.detach().clone()
    guard.step(step, torch.ones(2, 8))
    once = torch.optim.SGD([before.requires_grad_()], lr=0.1)
    before.grad = torch.ones(1, 8)  # d mean(xW^T + b) / dW for x = ones(2, 8)
    once.step()
    assert torch.allclose(model.weight, before)  # one update, as in a plain run: no replay's second one
    assert calls["n"] == 1
    assert "post-accumulate-grad hooks" in guard.report.by_name("sentinel-error")[0].message


class PairwiseDistance(nn.Module):
    """sqrt(d2 + eps) with an eps that is 0 in fp16: sqrt's backward is 1/0 on the diagonal."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        d2 = ((h[:, None] - h[None]) ** 2).sum(-1)
        return torch.sqrt(d2 + 1e-12).sum()  # EPS


def test_the_fix_printed_is_the_experiments_checked_fix_not_the_fp32_controls():
    torch.manual_seed(0)
    model = PairwiseDistance().half()
    report = _run(model, [torch.randn(6, 3, dtype=torch.float16)])
    verdict = report.by_name("deterministic-nonfinite")[0]
    experiment = verdict.evidence["experiment"]
    assert experiment["verdict"] == "origin" and experiment["constant"]["rounded"] == 0.0
    assert experiment["fix_checked"]["finite_after"]
    # the control ran, and is said, but its generic advice is not the fix: the experiment's is
    assert verdict.evidence["control_fp32"] == "finite" and "fp32 and autocast off" in verdict.message
    assert verdict.fix.startswith("Replace the constant 1e-12") and "6.10352e-05" in verdict.fix
    assert verdict.trial is not None and verdict.trial.tried and "replaced by 6.10352e-05" in verdict.trial.changed
    assert "fpdoctor plan" not in verdict.fix
