"""A small LightningModule whose steps can be made to fail, and a Trainer set up for tests (CPU, fast, quiet)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch", reason="the Lightning callback's tests need lightning (`make test`)")

from fpdoctor.integrations.lightning import FpDoctorCallback, _Hooks  # noqa: E402  (only with Lightning there)
from tests.integrations.common import logged, same  # noqa: E402

__all__ = ["NAN", "FpDoctorCallback", "Net", "Weights", "_Hooks", "data", "logged", "pl", "same", "trainer"]

NAN = float("nan")


class Net(pl.LightningModule):
    """An MLP regression. Faults, each at an optimizer step counted from 1:
    - `nan_data=(step, micro)`: a NaN in that micro-batch's input (deterministic: the replay sees it);
    - `bad_grad=(step, value)`: one gradient value written into net.0.weight's gradient by a hook,
      on that step's first backward only (transient: the replay's backward is not that one);
    - `scale_data=(step, factor)`: the input multiplied (an fp16 overflow under a GradScaler)."""

    def __init__(
        self,
        *,
        nan_data: tuple[int, int] | None = None,
        bad_grad: tuple[int, float] | None = None,
        scale_data: tuple[int, float] | None = None,
        dropout: float = 0.0,
        optimizer: str = "adamw",
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm: list[nn.Module] = [nn.BatchNorm1d(16)] if batch_norm else []
        self.net = nn.Sequential(nn.Linear(8, 16), *norm, nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 1))
        self.nan_data, self.bad_grad, self.scale_data = nan_data, bad_grad, scale_data
        self.optimizer_kind = optimizer
        self.backwards: dict[int, int] = {}
        self.net[0].weight.register_hook(self._grad_hook)

    def _step(self) -> int:
        return int(self.trainer.global_step) + 1

    def _micro(self, batch_idx: int) -> int:
        return batch_idx % self.trainer.accumulate_grad_batches + 1

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        step = self._step()
        self.backwards[step] = self.backwards.get(step, 0) + 1
        if self.bad_grad is not None and self.bad_grad[0] == step and self.backwards[step] == 1:
            grad = grad.clone()
            grad[0, 0] = self.bad_grad[1]
        return grad

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.nan_data is not None and self.nan_data == (self._step(), self._micro(batch_idx)):
            x = x.clone()
            x[0, 0] = NAN
        if self.scale_data is not None and self.scale_data[0] == self._step():
            x = x * self.scale_data[1]
        loss = nn.functional.mse_loss(self.net(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        flags = {"fused": {"fused": True}, "foreach": {"foreach": True}}.get(self.optimizer_kind, {})
        return torch.optim.AdamW(self.parameters(), lr=1e-2, **flags)


class Weights(pl.Callback):
    """The parameters just before each optimizer step, and the optimizer's state step counts."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.before[trainer.global_step + 1] = [p.detach().clone() for p in pl_module.parameters()]


def data(n: int = 96, seed: int = 1, batch_size: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch_size
    )


def trainer(callbacks: list[Any], max_steps: int = 8, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        **kwargs,
    )
