"""One scenario, every front end, the same findings: the step judge decides for `fpdoctor.Sentinel`
(a loop of the user's own), the Lightning callback and the Hugging Face callback alike.

Each scenario is a small MLP whose fault is keyed to an optimizer step (counted from 1) by a clock
each front end drives: a NaN in a batch (deterministic: its replay sees it again), a NaN written into
one gradient on the step's first backward only (transient: its replay does not), a clean run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import fpdoctor

pl = pytest.importorskip("lightning.pytorch", reason="the front-end parity test needs lightning (`make test`)")
transformers = pytest.importorskip("transformers", reason="the front-end parity test needs transformers")
pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate (`make test`)")

from fpdoctor.integrations.hf import FpDoctorCallback as HfCallback  # noqa: E402
from fpdoctor.integrations.lightning import FpDoctorCallback as LightningCallback  # noqa: E402
from tests.integrations.lit import trainer as lightning_trainer  # noqa: E402

STEPS = 6
BATCH = 8
NAN = float("nan")

# scenario -> the findings every front end must give: (name, step)
SCENARIOS: dict[str, dict[str, Any]] = {
    "clean": {"expect": [], "skipped": 0},
    "nan-batch": {"nan_data": 3, "expect": [("nonfinite-loss", 3), ("deterministic-nonfinite", 3)], "skipped": 1},
    "transient-gradient": {
        "bad_grad": 4,
        "expect": [("nonfinite-gradient", 4), ("transient-fault-suspected", 4)],
        "skipped": 1,
    },
}


class Core(nn.Module):
    """An MLP regression whose faults happen at optimizer step `now()`."""

    def __init__(self, now: Callable[[], int], *, nan_data: int | None = None, bad_grad: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.now, self.nan_data, self.bad_grad = now, nan_data, bad_grad
        self.backwards: dict[int, int] = {}
        self.net[0].weight.register_hook(self._grad_hook)

    def _grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        step = self.now()
        self.backwards[step] = self.backwards.get(step, 0) + 1
        if self.bad_grad == step and self.backwards[step] == 1:  # the step's first backward only
            grad = grad.clone()
            grad[0, 0] = NAN
        return grad

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.nan_data == self.now():
            x = x.clone()
            x[0, 0] = NAN
        return nn.functional.mse_loss(self.net(x), y)


def _core(case: dict[str, Any], now: Callable[[], int]) -> Core:
    return Core(now, nan_data=case.get("nan_data"), bad_grad=case.get("bad_grad"))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * BATCH, 8, generator=g), torch.randn(STEPS * BATCH, 1, generator=g)


def _sentinel(case: dict[str, Any]) -> fpdoctor.Report:
    clock = [0]
    core = _core(case, lambda: clock[0])
    opt = torch.optim.AdamW(core.parameters(), lr=1e-2)
    guard = fpdoctor.Sentinel(core, opt)
    x, y = _data()

    def step_fn(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = core.loss(xb, yb)
        loss.backward()
        return loss

    for i in range(STEPS):
        clock[0] = i + 1
        guard.step(step_fn, x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH])
    return guard.report


class _Lit(pl.LightningModule):
    def __init__(self, case: dict[str, Any]) -> None:
        super().__init__()
        self.core = _core(case, lambda: int(self.trainer.global_step) + 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.core.loss(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _lightning(case: dict[str, Any]) -> fpdoctor.Report:
    callback = LightningCallback()
    trainer = lightning_trainer([callback], max_steps=STEPS)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data()), batch_size=BATCH)
    trainer.fit(_Lit(case), loader)
    assert callback.report is not None
    return callback.report


class _Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class _HfModel(nn.Module):
    def __init__(self, case: dict[str, Any], box: list[Any]) -> None:
        super().__init__()
        self.core = _core(case, lambda: box[0].state.global_step + 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": self.core.loss(x, labels)}


def _hf(case: dict[str, Any], tmp_path: Any) -> fpdoctor.Report:
    box: list[Any] = []
    callback = HfCallback()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        learning_rate=1e-2,
        max_grad_norm=0.0,  # no clipping, as in the other loops
    )
    trainer = transformers.Trainer(model=_HfModel(case, box), args=args, train_dataset=_Pairs(), callbacks=[callback])
    box.append(trainer)
    trainer.train()
    assert callback.report is not None
    return callback.report


def _said(report: fpdoctor.Report) -> list[tuple[str, Any]]:
    return sorted((f.name, f.evidence.get("step")) for f in report.findings)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_front_end_gives_the_same_findings(scenario, tmp_path):
    case = SCENARIOS[scenario]
    reports = {"sentinel": _sentinel(case), "lightning": _lightning(case), "hf": _hf(case, tmp_path)}
    expected = sorted(case["expect"])
    for front_end, report in reports.items():
        assert _said(report) == expected, front_end
        assert report.data["steps"] == STEPS, front_end
        assert report.data["skipped_steps"] == case["skipped"], front_end
    verdicts = {name: report.data["verdicts"] for name, report in reports.items()}
    assert verdicts["sentinel"] == verdicts["lightning"] == verdicts["hf"], verdicts
