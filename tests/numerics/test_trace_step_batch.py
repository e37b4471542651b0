"""`fpdoctor.trace()` over a framework's training loop names the dataset items of the batch the bad step
read, not of the last batch the DataLoader handed out: Lightning fetches the next batch before the
step where the DataLoader has no length, accelerate's loader (the Hugging Face Trainer's) always does,
and a gradient-accumulation window fetches its micro-batches first. Where the trace cannot tell which
batch the step read, the rows say the items are not known and why, never another batch's.

Items 21 and 41 are all zero (x / ||x|| is 0/0 there): rows 5 and 10 of the second batch in the
Lightning runs, row 5 of the second batch (items 16-31) in the Trainer's, in order."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fpdoctor
from fpdoctor.numerics.observe.loader import LoaderBatches
from tests.integrations.test_loader_rows import (
    BATCHES,
    ZERO,
    Items,
    NormalisedModel,
    Records,
    _rows_named,
    normalised_module,
)

pytestmark = pytest.mark.timeout(60)


def _named(report: Any) -> list[tuple[list[int], list[int] | None, str | None]]:
    return [(n["indices"], n.get("dataset_indices"), n.get("dataset_indices_unknown")) for n in _rows_named(report)]


# -- Lightning -----------------------------------------------------------------------------------------


def _lightning(trace: Any, *, accumulate: int = 1, transfer: Any = None) -> Any:
    from tests.integrations.lit import trainer

    with trace as t:
        trainer([], max_steps=4 // accumulate, accumulate_grad_batches=accumulate).fit(normalised_module(transfer))
    return t.report


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_under_trace_names_the_items_of_the_batch_the_step_read(accumulate):
    """It named items 22 and 42, rows 5 and 10 of the third batch (fetched before the second ran)."""
    (named,) = _named(_lightning(fpdoctor.trace(), accumulate=accumulate))
    assert named == ([5, 10], [21, 41], None)
    assert not ZERO & set(BATCHES[2])


def test_a_deferred_trace_names_the_items_before_the_next_batch_is_handed_out():
    """Results read in batches of ops (how an accelerator runs): the ops of a step are judged before
    the next batch is handed out, with what that step read."""
    (named,) = _named(_lightning(fpdoctor.Trace(immediate=False, sync_every=4096)))
    assert named == ([5, 10], [21, 41], None)


def test_a_batch_changed_by_traced_ops_keeps_its_items():
    """An augmentation in a transfer hook runs under the trace: its ops read the batch, whose rows
    are still the rows of the result."""
    (named,) = _named(_lightning(fpdoctor.trace(), transfer=lambda x: x * 2))
    assert named == ([5, 10], [21, 41], None)


def test_a_batch_rebuilt_outside_the_trace_is_said_unknown_never_the_next_batchs_items():
    """A transfer hook that rebuilds the batch through numpy: no traced op reads the batch handed
    out and no tensor the step reads holds its values, so the items are not known, and why."""
    report = _lightning(fpdoctor.trace(), transfer=lambda x: torch.from_numpy(x.numpy() * 2))
    ((rows, items, why),) = _named(report)
    assert rows == [5, 10] and items is None, (rows, items)
    assert why is not None and "no tensor the step's ops or modules read" in why, why
    message = report.by_name("nonfinite-produced")[0].message
    assert "which dataset items they are is not known" in message, message


# -- the Hugging Face Trainer ----------------------------------------------------------------------------


def _hf(tmp_path: Any, model: nn.Module, dataset: Dataset, accumulate: int = 1) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tests.integrations.hf import arguments, transformers

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

    args = arguments(
        tmp_path, max_steps=4 // accumulate, per_device_train_batch_size=16, remove_unused_columns=False,
        gradient_accumulation_steps=accumulate,
    )  # fmt: skip
    with fpdoctor.trace() as t:
        InOrder(model=model, args=args, train_dataset=dataset).train()
    return t.report


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_hf_trainer_under_trace_names_the_items_of_the_batch_the_step_read(tmp_path, accumulate):
    """It named item 37, row 5 of the third batch (accelerate's loader had fetched it)."""
    (named,) = _named(_hf(tmp_path, NormalisedModel(), Records(), accumulate))
    assert named == ([5], [21], None)


class Tokens(Dataset):
    """Token ids; items 21 and 41 are all padding (id 0)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(1, 64, (12,), generator=torch.Generator().manual_seed(i))
        ids = ids * 0 if i in ZERO else ids
        return {"input_ids": ids, "labels": ids}


class Bag(nn.Module):
    """Called with keyword arguments, as the Trainer calls a model (no global module hook sees
    them); the NaN is made inside, from an embedding of the token ids."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 8, padding_idx=0)
        self.head = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids).sum(1)  # [B, 8]: 0 for an item all padding
        return {"loss": self.head(h / h.norm(dim=1, keepdim=True)).pow(2).mean()}


def test_token_ids_handed_to_an_embedding_name_the_items_of_the_steps_batch(tmp_path):
    """Integer ids are no floating-point value the trace follows, and the model is called with
    keyword arguments: the embedding that is handed the ids says which batch the step reads."""
    (named,) = _named(_hf(tmp_path, Bag(), Tokens()))
    assert named == ([5], [21], None)


class Features(Dataset):
    """Records without labels: the Trainer reads nothing of a window's batches before their steps."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": Items()[i]}


class Alternating(nn.Module):
    """The first micro-batch of a window reaches the layer as it was handed out (the trace sees it
    read); the second is rebuilt through numpy first, outside the trace, and scaled."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.calls += 1
        h = self.lin(x * 1) if self.calls % 2 else torch.from_numpy(x.numpy() * 2)
        return {"loss": (h / h.norm(dim=1, keepdim=True)).pow(2).mean() + self.lin.weight.sum() * 0}


def test_a_micro_batch_that_cannot_be_told_is_never_named_as_the_one_before_it(tmp_path):
    """Two micro-batches a window: batch 0, then batch 1 (items 16-31, item 21 in row 5). What was
    seen of batch 0's call (read, handed to the layer) is not batch 1's: the items are not known."""
    ((rows, items, why),) = _named(_hf(tmp_path, Alternating(), Features(), accumulate=2))
    assert rows == [5] and items is None, (rows, items)
    assert why is not None and "no tensor the step's ops or modules read" in why, why


# -- the matching itself ------------------------------------------------------------------------------


def test_some_of_a_batchs_tensors_find_it_and_a_tie_is_never_broken_by_guess():
    class Pairs(Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return Items()[i], torch.tensor(0.0)  # the same labels in every batch

    with LoaderBatches(recent=8) as follow:
        batches = list(DataLoader(Pairs(), batch_size=8))
        x, y = batches[2]
        assert follow.rows_of((x,), whole=False) == (list(range(16, 24)), None)
        assert follow.rows_of((x.clone(), y), whole=False) == (list(range(16, 24)), None)
        indices, why = follow.rows_of((y,), whole=False)  # the labels alone: every batch holds them
        assert indices is None and why is not None and "several batches" in why
        indices, why = follow.rows_of((x * 2,), whole=False)
        assert indices is None and why is not None and "none of the last 4" in why
        assert follow.rows_of((x,))[0] is None  # whole: the labels are not among the inputs
