"""A regression output too coarse for its targets, named by the front ends that run the user's whole
step: the Lightning callback (training_step computes the loss) and the Sentinel (step_fn does).

Outlet temperatures near 300 K that vary by 0.5, predicted under bf16 autocast: the last Linear's
output is bf16, whose spacing near 300 is 2, so the loss is computed on values rounded by as much as
they vary. The reference step runs the forward in fp32 and finds the gradients departing at the
backward (the rounded output's gradient is mostly rounding); the cause, the output's format, is named
ahead of that departure, from the outputs the front end keeps on the steps the check is due (hooks on
the model for that step alone). The same script in fp32, and with standardised targets, names nothing.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fpdoctor
from fpdoctor.torchprivate import global_forward_hook_tables
from tests.integrations.lit import FpDoctorCallback, pl, trainer

STEPS = 12


def _readings(offset: float, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = offset + 0.3 * torch.tanh(x[:, :1] - 0.5 * x[:, 1:2]) + 0.2 * torch.sin(x[:, 2:3])
    return x, y


class _Exchanger(nn.Module):
    def __init__(self, offset: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.head.bias.fill_(offset)  # starts at the mean temperature, as a user would

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class _Lit(pl.LightningModule):
    """The network held as an attribute, called through the module's own forward (`self(x)`); with `copies`,
    training_step also refreshes a copy of it every step (a target network), as some recipes do."""

    def __init__(self, offset: float, copies: bool = False, through: str = "self", anchor: bool = False) -> None:
        super().__init__()
        self.model = _Exchanger(offset)
        self.copies, self.through, self.anchor = copies, through, anchor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x) if self.through == "self" else self.model(x)  # `self.model(x)`: the module's forward unused
        loss = nn.functional.mse_loss(out, y)
        if self.anchor:  # a penalty at a fixed input: one value on every row by construction
            loss = loss + 1e-3 * self(torch.full_like(x, 0.5)).float().pow(2).mean()
        if self.copies:
            copy.deepcopy(self.model)  # during the forward's window: nothing of the callback's on the modules
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def _fit(offset: float, precision: str, **kwargs: bool) -> tuple[_Lit, fpdoctor.Report]:
    module = _Lit(offset, **kwargs)
    callback = FpDoctorCallback()
    x, y = _readings(offset)
    trainer([callback], max_steps=STEPS, precision=precision).fit(
        module, DataLoader(TensorDataset(x, y), batch_size=64)
    )
    return module, callback.report


def _hooks(model: nn.Module) -> int:
    """Forward hooks on the model's modules and in torch's global tables."""
    tables = global_forward_hook_tables(nn.modules.module) or ({}, {})
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) + sum(map(len, tables))


def test_the_lightning_callback_names_the_output_format_ahead_of_the_departure_it_causes():
    module, report = _fit(300.0, "bf16-mixed", copies=True)
    names = [f.name for f in report.sorted_findings()]
    assert names[0] == "output-too-coarse-in-training", names
    found = report.by_name("output-too-coarse-in-training")[0]
    share = found.evidence["share_of_spread"]  # None: every row one value of bf16
    assert found.evidence["dtype"] == "bfloat16" and (share is None or share >= 0.5), found.evidence
    assert "output in fp32" in found.fix
    departed = [f for f in report.findings if f.name.endswith("from-reference")]
    if departed and departed[0].where["step"] < found.where["step"]:  # found first: the consequence, said to be one
        assert "where they part" in found.message and "{" not in found.message, found.message
    else:  # the reference step ran the forward in fp32: it does not replay from the output's gradient
        assert "replays" not in found.message and "runs the forward in fp32" in found.message, found.message
    assert _hooks(module) == 0  # the hooks were on for the checked steps alone


def test_the_lightning_callback_is_quiet_on_the_same_targets_in_fp32_and_on_standardised_targets_in_bf16():
    for offset, precision in ((300.0, "32-true"), (0.0, "bf16-mixed")):
        _, report = _fit(offset, precision)
        assert not report.by_name("output-too-coarse-in-training"), (offset, precision, report.findings)


def _guarded(
    offset: float, autocast: bool, *, accumulate: int = 1, calls: int = STEPS
) -> tuple[nn.Module, fpdoctor.Report, list[float]]:
    model = _Exchanger(offset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    guard = fpdoctor.Sentinel(model, optimizer, accumulate=accumulate)
    x, y = _readings(offset)
    losses = []

    def step_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        if accumulate == 1:
            optimizer.zero_grad()
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with ctx:
            out = model(xb)
        copy.deepcopy(model)  # a target network refreshed in the step: nothing of the Sentinel's on the model
        loss = nn.functional.mse_loss(out.float(), yb)
        loss.backward()
        return loss

    for i in range(calls):
        rows = slice(64 * (i % 8), 64 * (i % 8 + 1))
        losses.append(float(guard.step(step_fn, x[rows], y[rows]).detach()))
    guard.flush()
    return model, guard.report, losses


def test_the_sentinel_names_the_output_format_and_leaves_the_model_as_it_was():
    model, report, _ = _guarded(300.0, autocast=True)
    names = [f.name for f in report.sorted_findings()]
    assert "output-too-coarse-in-training" in names, names
    if "gradients-depart-from-reference" in names:  # ahead of the departure it explains
        assert names.index("output-too-coarse-in-training") < names.index("gradients-depart-from-reference"), names
    found = report.by_name("output-too-coarse-in-training")[0]
    assert found.evidence["step"] == 8 and "replays" not in found.message
    assert _hooks(model) == 0


def test_the_sentinel_is_quiet_in_fp32_and_its_losses_are_a_plain_loops():
    _, report, guarded = _guarded(300.0, autocast=False)
    assert not report.by_name("output-too-coarse-in-training"), report.findings
    model = _Exchanger(300.0)  # the same loop without the Sentinel: the hooks changed no number
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = _readings(300.0)
    plain = []
    for i in range(STEPS):
        rows = slice(64 * (i % 8), 64 * (i % 8 + 1))
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        plain.append(float(loss))
    assert guarded == plain


def test_a_window_the_sentinel_never_ends_leaves_no_hook_anywhere():
    """accumulate=2 over 7 micro-batches: step 4's window is left open (an epoch whose length is not a
    multiple of N); the hooks were on for each step_fn call alone."""
    model, _, _ = _guarded(300.0, autocast=True, accumulate=2, calls=7)
    assert _hooks(model) == 0
    copy.deepcopy(model)


def test_the_lightning_callback_reads_a_network_called_as_an_attribute_and_not_a_fixed_anchor():
    module, report = _fit(300.0, "bf16-mixed", through="model")
    assert report.sorted_findings()[0].name == "output-too-coarse-in-training", report.findings
    assert _hooks(module) == 0
    _, report = _fit(0.0, "bf16-mixed", anchor=True)  # standardised targets, a call on a constant input beside
    assert not report.by_name("output-too-coarse-in-training"), report.findings
