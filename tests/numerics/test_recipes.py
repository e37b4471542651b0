"""Recipe diagnoses: Adam's eps in fp16, fp16 autocast without a GradScaler."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fpdoctor


def train(model, opt, *, steps=2, autocast=None, scaler=None, dtype=torch.float32):
    torch.manual_seed(0)
    with fpdoctor.trace(model) as t:
        for _ in range(steps):
            x = torch.randn(8, 16, dtype=dtype)
            ctx = torch.autocast("cpu", dtype=autocast) if autocast else torch.autocast("cpu", enabled=False)
            with ctx:
                loss = model(x).float().pow(2).mean() * 1e-6  # a small loss: small gradients
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            opt.zero_grad()
    return t.report


def names(report):
    return [f.name for f in report.findings]


def net(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adam_default_eps_with_fp16_parameters(cls):
    model = net(torch.float16)
    report = train(model, cls(model.parameters(), lr=1e-3), dtype=torch.float16)
    (f,) = [f for f in report.findings if f.name == "fp16-adam-eps"]
    assert f.code == "NUM009" and f.evidence["eps"] == 1e-8 and f.evidence["eps_in_fp16"] == 0.0
    assert f.evidence["count"] == 4 and f.evidence["dtype"] == "torch.float16"
    assert f.where["phase"] == "optimizer" and "op" not in f.where
    assert f.evidence["optimizer"] == f"torch.optim.{cls.__name__}"
    assert "eps=0.0001" in f.fix and "rounds to 0" in f.message


def test_adam_eps_that_fp16_holds_or_fp32_parameters_are_fine():
    model = net(torch.float16)
    assert "fp16-adam-eps" not in names(
        train(model, torch.optim.Adam(model.parameters(), eps=1e-4), dtype=torch.float16)
    )
    model = net()
    assert "fp16-adam-eps" not in names(train(model, torch.optim.Adam(model.parameters())))
    model = net(torch.float16)
    assert "fp16-adam-eps" not in names(train(model, torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.float16))


def test_fp16_autocast_without_a_grad_scaler():
    model = net()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.float16)
    (f,) = [f for f in report.findings if f.name == "fp16-without-grad-scaler"]
    assert f.code == "NUM010" and f.severity.value == "warning"
    # measured over both steps: gradients of ~1e-7, under fp16's smallest normal
    assert f.evidence["numel"] == 2 * (16 * 16 + 16 + 16 + 1) and f.evidence["share"] > 0.5
    assert f.evidence["count"] == f.evidence["zero"] + f.evidence["subnormal"]
    assert "GradScaler" in f.fix and "%" in f.message
    assert "also made NaN/Inf" not in f.message  # a finite forward: the zeros are the underflow's


class _Norm(nn.Module):
    """A norm by hand whose variance's product overflows fp16: rsqrt(Inf) = 0 zeroes the rows behind it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x - x.mean(-1, keepdim=True)
        return xc * torch.rsqrt((xc * xc * 1e4).mean(-1, keepdim=True) + 1e-5)


def test_zeros_that_a_non_finite_forward_made_are_not_told_as_the_underflow_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), _Norm(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.mul_(20.0)
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.float16)
    (f,) = [f for f in report.findings if f.name == "fp16-without-grad-scaler"]
    assert "also made NaN/Inf (the finding about it comes first)" in f.message, f.message
    assert report.findings[0].name in ("nonfinite-produced", "nonfinite-zeroed"), names(report)


def test_with_a_grad_scaler_or_without_autocast_nothing_is_said():
    model = net()
    scaler = torch.amp.GradScaler("cpu")
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.float16, scaler=scaler)
    assert "fp16-without-grad-scaler" not in names(report)
    # a fused optimizer is stepped by GradScaler.step itself (it takes found_inf), not by _maybe_opt_step
    model = net()
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    report = train(model, fused, autocast=torch.float16, scaler=torch.amp.GradScaler("cpu"))
    assert "fp16-without-grad-scaler" not in names(report)
    model = net()
    assert "fp16-without-grad-scaler" not in names(train(model, torch.optim.SGD(model.parameters(), lr=0.1)))
    model = net()
    report = train(model, torch.optim.SGD(model.parameters(), lr=0.1), autocast=torch.bfloat16)
    assert "fp16-without-grad-scaler" not in names(report)


def test_the_watch_leaves_no_hook_behind():
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    before = len(_global_optimizer_pre_hooks)
    model = net()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert len(_global_optimizer_pre_hooks) == before


def test_an_update_blown_up_by_an_eps_fp16_holds_as_0_puts_the_eps_first():
    """A pure-fp16 regression with AdamW at its default eps: the update divides by ~0 where the second
    moment is small, and blows the weights up at once. The learning rate is not the cause (a 100x
    lower one blows up the same): the eps's finding is first, and its fix as printed trains."""

    def run(eps: float, lr: float = 1e-3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 48), nn.SiLU(), nn.Linear(48, 1)).half()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=eps)
        x = torch.randn(256, 12).half()
        y = x[:, :2].sum(1, keepdim=True) * 0.1
        with fpdoctor.trace(model) as t:
            for _ in range(6):
                loss = (model(x) - y).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
        return t.report, loss.item()

    report, _ = run(1e-8)
    assert names(report)[0] == "fp16-adam-eps", names(report)  # before: update-blew-up, "lower the learning rate"
    (blown,) = report.by_name("update-blew-up")
    assert blown.severity.value == "warning" and blown.evidence["consequence_of"] == "fp16-adam-eps"
    assert run(1e-8, lr=1e-5)[0].by_name("update-blew-up")  # the rate's fix does nothing
    fixed, loss = run(1e-4)  # as printed: eps=0.0001
    assert not fixed.by_name("update-blew-up") and not fixed.by_name("nonfinite-produced") and math.isfinite(loss)


def test_an_fp16_copy_for_evaluation_in_an_fp32_run_is_not_autocast_without_a_scaler():
    """fp32 training with an fp16 copy of the model evaluated each step: its casts are the code's own
    (model.half(), written on its line), not autocast's; before, NUM010 said the forward ran under fp16
    autocast without a GradScaler."""
    import copy

    torch.manual_seed(0)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with fpdoctor.trace(model) as t:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            with torch.no_grad():
                half = copy.deepcopy(model).half()
                half(torch.randn(8, 16).half())
    assert "fp16-without-grad-scaler" not in names(t.report), names(t.report)
    model = net()
    real = train(model, torch.optim.SGD(model.parameters(), lr=0.01), autocast=torch.float16)
    assert "fp16-without-grad-scaler" in names(real)  # autocast's own casts still are
