"""The fix for updates lost to a low-precision dtype, tried: a short what-if run from the same state.

N optimizer steps on the step's own batch, twice from the same weights and optimizer state: once
as the run is (a copy of the optimizer over copies of the weights in their own dtype), once with
fp32 master weights (the same optimizer class over fp32 copies, its state in fp32; each step the
low-precision gradient is cast up, the fp32 copy stepped and cast back into the weights the model
computes with). Each arm reports the loss after its N steps and the share of weights that moved per
step. The user's model runs with stand-in tensors (`torch.nn.utils.stateless`, as the fp32 control
replay does): its parameters, their gradients, its buffers, its optimizer and the RNG are as they
were afterwards; the copies' steps are not seen by torch's global optimizer hooks (a trace's step
count, `fpdoctor watch`). Where the step runs without its loss (replayed from the gradients at the
model's outputs) the loss is not known and the arms are compared by the weights that moved. Cost:
2 x (N + 1) forward+backward passes and 2 x N optimizer steps, once.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor.numerics.updates.measure import LOW_PRECISION, no_global_optimizer_hooks
from fpdoctor.preserve import preserved

WHAT_IF_STEPS = 8
# fp32 master weights helped where the loss after the what-if's steps is this share lower than as it is: less
# is the batch's noise, and the rounding is not what limits the run (a bf16 run that matches fp32)
MATERIAL = 0.005
MOVING = 0.05


@dataclass(frozen=True)
class WhatIf:
    steps: int
    loss_as_is: float  # NaN: the step runs without its loss, which is not known
    loss_fixed: float
    moved_as_is: float  # share of low-precision weights that changed, per step, averaged
    moved_fixed: float  # share of their fp32 master weights that changed, per step, averaged
    seconds: float
    error: str | None = None
    loss_is: str = "the loss"  # what the losses are (a first-order estimate, where the loss function is not known)

    @property
    def helped(self) -> bool:
        """The fix moved more weights and did not leave a higher loss (where the loss is known)."""
        if self.error is not None:
            return False
        if not self.loss_known:
            return self.moved_fixed > self.moved_as_is
        if not math.isfinite(self.loss_fixed):
            return False
        return self.moved_fixed > self.moved_as_is and not self.loss_fixed > self.loss_as_is and not self.immaterial

    @property
    def immaterial(self) -> bool:
        """The low-precision weights move (MOVING of them a step or more) and the loss, known and finite, is
        lower with fp32 masters by less than MATERIAL of it: the rounding costs the run nothing it measures
        over these steps. Weights that do not move at all are a stall whatever the loss says yet."""
        if self.error is not None or not self.loss_known or self.moved_as_is < MOVING:
            return False
        if not (math.isfinite(self.loss_fixed) and math.isfinite(self.loss_as_is)):
            return False
        return self.loss_as_is - MATERIAL * abs(self.loss_as_is) < self.loss_fixed <= self.loss_as_is

    @property
    def loss_known(self) -> bool:
        return not (math.isnan(self.loss_as_is) and math.isnan(self.loss_fixed))


def same_class(optimizer: Any, groups: list[dict[str, Any]]) -> Any:
    """A new optimizer of `optimizer`'s class over `groups` (as torch.optim's constructors take them);
    a constructor of the script's own that takes no groups raises a TypeError that says so."""
    try:
        return type(optimizer)(groups)
    except Exception as exc:
        raise TypeError(
            f"{type(optimizer).__name__}(param_groups) raised {type(exc).__name__}: {exc} (its constructor does not "
            "take parameter groups as torch.optim's do, so no copy of it can step copies of the weights)"
        ) from exc


def copy_optimizer(optimizer: Any, stand_in: dict[int, torch.Tensor]) -> Any:
    """The same optimizer class, hyperparameters and state over other tensors (`stand_in` by the
    id of the original); floating state is cast to each new tensor's dtype by load_state_dict."""
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [stand_in.get(id(p), p) for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    new = same_class(optimizer, groups)
    new.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return new


def _loss_value(loss: Any) -> float:
    if loss is None:  # run without its loss: not known
        return math.nan
    return float(torch.as_tensor(loss).detach().float().mean())


def what_if(
    model: nn.Module,
    optimizer: Any,
    run_step: Callable[[], Any],
    *,
    steps: int = WHAT_IF_STEPS,
    loss_is: str = "the loss",
) -> WhatIf:
    """Both arms from the same state; `run_step()` runs forward and backward of one optimizer step's
    window on `model` and returns its loss (None: not known). Never raises: a failure is in `error`."""
    import time

    from fpdoctor.torchprivate import reparametrized

    start = time.perf_counter()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    saved_grads = [(p, p.grad) for _, p in named]
    results: list[tuple[float, float]] = []
    try:
        for fixed in (False, True):
            # fresh leaves in the weights' own dtype: what the model computes with in both arms
            weights = {n: p.detach().clone().requires_grad_(True) for n, p in named}
            by_id = {id(p): weights[n] for n, p in named}
            masters = {n: w.detach().float() for n, w in weights.items() if w.dtype in LOW_PRECISION} if fixed else {}
            stepped = {id(p): masters.get(n, weights[n]) for n, p in named}
            opt = copy_optimizer(optimizer, stepped)
            low = [weights[n] for n, p in named if p.dtype in LOW_PRECISION]
            moved = 0.0
            # gradients on, whatever the caller runs under (an optimizer's post-hook, say)
            with torch.enable_grad(), preserved(model), reparametrized(model, weights, tie_weights=True):
                for _ in range(steps):
                    for w in by_id.values():
                        w.grad = None
                    for m in masters.values():
                        m.grad = None
                    run_step()
                    for n, m in masters.items():
                        g = weights[n].grad
                        m.grad = None if g is None else g.float()
                    # with masters, what the step keeps is the fp32 copy's change: the low-precision
                    # weights follow once it reaches half their spacing (hundreds of steps, maybe)
                    tracked = [masters[n] for n, p in named if p.dtype in LOW_PRECISION] if fixed else low
                    before = [w.detach().clone() for w in tracked]
                    with no_global_optimizer_hooks():
                        opt.step()
                    with torch.no_grad():
                        for n, m in masters.items():
                            weights[n].copy_(m)
                        changed = sum(int((w != b).sum()) for w, b in zip(tracked, before, strict=True))
                    moved += changed / max(1, sum(w.numel() for w in low))
                loss = run_step()
            results.append((_loss_value(loss), moved / max(1, steps)))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        return WhatIf(steps, math.nan, math.nan, 0.0, 0.0, time.perf_counter() - start, error, loss_is)
    finally:
        for p, g in saved_grads:
            p.grad = g
    (loss_as_is, moved_as_is), (loss_fixed, moved_fixed) = results
    return WhatIf(steps, loss_as_is, loss_fixed, moved_as_is, moved_fixed, time.perf_counter() - start, None, loss_is)


def _hyper_text(optimizer: Any) -> str:
    """The first param group's hyperparameters as keyword arguments, as the user's optimizer has them."""
    group = optimizer.param_groups[0]
    # the class's own defaults (optimizer.defaults holds what the user passed: momentum=0.9 would read as one)
    try:
        signature = dict(inspect.signature(type(optimizer).__init__).parameters)
    except (TypeError, ValueError):
        signature = {}
    defaults = {k: v.default for k, v in signature.items() if v.default is not inspect.Parameter.empty}
    keys = [k for k in ("lr", "betas", "momentum", "dampening", "eps", "weight_decay", "nesterov") if k in group]
    parts = []
    for k in keys:
        value = group[k] if k != "lr" else _created_lr(optimizer)
        value = float(value) if isinstance(value, torch.Tensor) else value
        if k != "lr" and k in defaults and defaults[k] == value and k != "weight_decay":
            continue
        parts.append(f"{k}={value!r}")
    return ", ".join(parts)


def _created_lr(optimizer: Any) -> Any:
    """The learning rate the optimizer was made with, not the one a schedule set for this step (a warm-up's
    first, 1e-3 of it): a torch scheduler keeps it as `initial_lr`, the constructor's as `defaults`."""
    group = optimizer.param_groups[0]
    return group.get("initial_lr", getattr(optimizer, "defaults", {}).get("lr", group["lr"]))


def master_weights_code(optimizer: Any) -> str:
    """fp32 master weights for the user's own optimizer class and settings, as pasteable code."""
    cls = type(optimizer)
    module = "torch.optim" if cls.__module__.startswith("torch.optim") else cls.__module__
    scheduled = optimizer.param_groups[0]["lr"] != _created_lr(optimizer)
    return (
        "params = [p for p in model.parameters() if p.requires_grad]  # bf16/fp16, what the model computes with\n"
        "masters = [p.detach().float().requires_grad_() for p in params]  # fp32 copies: +4 bytes per parameter\n"
        f"optimizer = {module}.{cls.__name__}(masters, {_hyper_text(optimizer)})  # its state in fp32 too\n"
        + (
            "# the learning rate changes during the run (a schedule): build the scheduler, or the code that sets\n"
            "# param_groups' lr, on this optimizer\n"
            if scheduled
            else ""
        )
        + "# each step, in place of optimizer.step() (after loss.backward() and any clip of the gradients):\n"
        "for p, m in zip(params, masters):\n"
        "    m.grad = p.grad.float()\n"
        "    p.grad = None\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)\n"
        "# any update of your own to the weights (a decay by hand, a clamp) goes to m here: on p the copy undoes it\n"
        "with torch.no_grad():\n"
        "    for p, m in zip(params, masters):\n"
        "        p.copy_(m)  # the rounding happens once, here, not inside every update"
    )


def stochastic_rounding_hint(optimizer: Any) -> str:
    """torchao's bf16 optimizer with stochastic rounding, where torchao is installed."""
    import importlib.util

    name = type(optimizer).__name__
    if name not in ("AdamW", "Adam"):
        return "a bf16 optimizer with stochastic rounding (torchao.optim's AdamW, bf16_stochastic_round=True)"
    if importlib.util.find_spec("torchao") is None:
        return (
            f"torchao's {name} with bf16_stochastic_round=True (pip install torchao; "
            f"torchao.optim.{name}(params, ..., bf16_stochastic_round=True))"
        )
    return f"torchao.optim.{name}(model.parameters(), ..., bf16_stochastic_round=True) (torchao is installed)"
