"""A bad step's rows named as the dataset items of that step's own batch under the framework
callbacks, whose loops fetch ahead: Lightning fetches the next batch before the step where the
DataLoader has no length, accelerate's loader (the Hugging Face Trainer's) always does, and a
gradient-accumulation window fetches its micro-batches first. The last batch handed out is then
another step's: the callbacks find the replayed step's batch by its values among those handed out,
and where it is not there (changed after the loader), they say the items are not known instead."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

ZERO = {21, 41}  # items that are all zero: x / ||x|| is 0/0 there
BATCHES = [list(range(k, 64, 4)) for k in range(4)]  # 4 batches of 16; items 21 and 41 in the second, rows 5 and 10


class Items(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i)) + 3
        return x * 0 if i in ZERO else x


class Batches(Sampler[list[int]]):
    """Fixed batches and no length: Lightning cannot tell the last batch without fetching ahead."""

    def __init__(self) -> None:
        super().__init__()

    def __iter__(self):
        return iter([list(b) for b in BATCHES])


def _rows_named(report: Any) -> list[dict]:
    """Every 'rows' evidence in a report (as JSON), wherever a finding holds it."""
    found: list[dict] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            if "indices" in value and "of" in value:
                found.append(value)
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(json.loads(json.dumps(report.to_dict(), default=str)))
    return found


def _bad_rows() -> tuple[list[int], list[int]]:
    batch = BATCHES[1]
    rows = [r for r, i in enumerate(batch) if i in ZERO]
    return rows, [batch[r] for r in rows]


# -- Lightning ---------------------------------------------------------------------------------------


def normalised_module(transfer: Any = None) -> Any:
    """The Lightning module the loader tests train: a Linear over x / ||x||, fed the fixed batches
    without a length; `transfer` changes each batch after the loader (on_after_batch_transfer)."""
    from tests.integrations.lit import pl

    class Normalised(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(8, 4)

        def training_step(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.lin(x / x.norm(dim=1, keepdim=True)).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(Items(), batch_sampler=Batches())

        def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return batch if transfer is None else transfer(batch)

    return Normalised()


def _lightning_run(accumulate: int = 1, transfer: Any = None) -> Any:
    from tests.integrations.lit import FpDoctorCallback, trainer

    callback = FpDoctorCallback(reference_every=0)
    fit = trainer(callbacks=[callback], max_steps=4 // accumulate, accumulate_grad_batches=accumulate).fit
    fit(normalised_module(transfer))
    return callback.report


def test_lightning_names_the_items_of_the_step_it_replayed_not_of_the_batch_fetched_after_it():
    report = _lightning_run()
    rows, items = _bad_rows()
    (named,) = _rows_named(report)
    assert named["indices"] == rows and named["dataset_indices"] == items, named
    assert not ZERO & set(BATCHES[2])  # the batch Lightning had fetched before step 2 ran: not these
    message = next(f.message for f in report.findings if f.name == "deterministic-nonfinite")
    assert f"dataset items {items[0]}, {items[1]}" in message, message


def test_under_watch_the_callback_names_its_steps_items_not_the_last_batch_handed_out():
    """`fpdoctor watch` follows the DataLoader too, and its last batch handed out when step 2 runs is
    batch 3 (Lightning fetched it): the callback's replay names step 2's own items (it named items
    22 and 42 of batch 3 before, rows 5 and 10 of the wrong batch)."""
    import fpdoctor

    with fpdoctor.watch(reference_every=0) as w:
        report = _lightning_run()
    rows, items = _bad_rows()
    assert [(n["indices"], n["dataset_indices"]) for n in _rows_named(report)] == [(rows, items)]
    assert [n.get("dataset_indices") for n in _rows_named(w.report)] in ([], [items]), w.report.findings


def test_lightning_under_accumulation_names_the_bad_micro_batch():
    rows, items = _bad_rows()
    report = _lightning_run(accumulate=2)
    (named,) = _rows_named(report)
    assert named["indices"] == rows and named["dataset_indices"] == items, named


def test_a_batch_copied_after_the_loader_is_found_by_its_values():
    """A transfer to the device makes new tensors with the same values (a copy here, on the CPU):
    the step's batch is still found among those handed out."""
    rows, items = _bad_rows()
    (named,) = _rows_named(_lightning_run(transfer=lambda x: x.clone()))
    assert named["indices"] == rows and named["dataset_indices"] == items, named


def test_a_batch_changed_after_the_loader_is_said_unknown_never_another_batchs_items():
    """on_after_batch_transfer scales the batch (an augmentation on the device): no batch handed
    out holds its values, so the rows are named by their place only, and the report says why."""
    report = _lightning_run(transfer=lambda x: x * 2)
    rows, _ = _bad_rows()
    (named,) = _rows_named(report)
    assert named["indices"] == rows and "dataset_indices" not in named, named
    assert "none of the last" in named["dataset_indices_unknown"], named
    message = next(f.message for f in report.findings if f.name == "deterministic-nonfinite")
    assert "which dataset items they are is not known" in message, message


def test_the_dataloader_is_put_back_after_training():
    from torch.utils.data import dataloader

    before = dict(vars(dataloader._BaseDataLoaderIter))
    _lightning_run()
    assert dict(vars(dataloader._BaseDataLoaderIter)) == before


# -- the Hugging Face Trainer ------------------------------------------------------------------------


class Records(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": Items()[i], "labels": torch.tensor(0.0)}


class NormalisedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"loss": self.lin(x / x.norm(dim=1, keepdim=True)).pow(2).mean()}


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_hf_trainer_names_the_items_of_the_step_it_replayed(tmp_path, accumulate):
    """accelerate's loader fetches one batch ahead; with accumulation the Trainer fetches the
    window's micro-batches before the first runs."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.integrations.hf import FpDoctorCallback, arguments, transformers

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    callback = FpDoctorCallback(reference_every=0)
    args = arguments(
        tmp_path, max_steps=4 // accumulate, per_device_train_batch_size=16, remove_unused_columns=False,
        gradient_accumulation_steps=accumulate,
    )  # fmt: skip
    InOrder(model=NormalisedModel(), args=args, train_dataset=Records(), callbacks=[callback]).train()
    # in order: batch 1 holds items 16-31, item 21 in its row 5 (item 41 is in batch 2)
    named = _rows_named(callback.report)
    assert named and named[0]["indices"] == [5] and named[0]["dataset_indices"] == [21], named


def test_batches_that_hold_the_same_values_are_never_told_apart_by_guess():
    from fpdoctor.numerics.observe.loader import LoaderBatches

    class Same(Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.ones(4)

    with LoaderBatches(recent=8) as follow:
        batches = list(DataLoader(Same(), batch_size=8))
        indices, why = follow.rows_of((batches[1],))
        assert indices is None and why is not None and "several batches" in why
        different = follow.rows_of((batches[1] * 2,))
        assert different[0] is None and different[1] is not None and "none of the last 4" in different[1]
    with LoaderBatches(recent=8) as follow:
        loader = DataLoader(Items(), batch_size=16)
        batches = list(loader)
        assert follow.rows_of((batches[2], 7)) == (list(range(32, 48)), None)


def test_each_replayed_steps_own_dataset_items_are_named_not_the_first_steps_alone():
    """Two empty items in two batches make two bad steps of one cause: the finding named the first step's item
    only, and dropping it left the second to fail again."""
    import fpdoctor

    class TwoEmpty(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            x = torch.randn(8, generator=torch.Generator().manual_seed(i)) + 3
            return x * 0 if i in (6, 43) else x  # in the second batch and in the third

    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.01)
    with fpdoctor.watch(reference_every=0) as w:
        for x in DataLoader(TwoEmpty(), batch_size=16):
            opt.zero_grad()
            lin(x / x.norm(dim=1, keepdim=True)).pow(2).mean().backward()
            opt.step()
    found = [f for f in w.report.findings if f.evidence.get("dataset_indices_all")]
    assert found and found[0].evidence["dataset_indices_all"] == [6, 43], [f.evidence for f in w.report.findings]
    assert "The dataset items on those steps: 6, 43." in found[0].message
