"""A NaN made in some rows of a batch names those rows as dataset items, where a DataLoader built
the batch: the items a user can open (`dataset[i]`), whatever the shuffling, the workers or the epoch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

import fpdoctor
from fpdoctor.numerics.observe import loader

ZERO = {13, 40}  # items that are all zero: x / ||x|| is 0/0 there


class Items(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i)) + 3
        return x * 0 if i in ZERO else x


def normalise(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def _loader(**kwargs) -> DataLoader:
    return DataLoader(Items(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7), **kwargs)


def _expected() -> tuple[list[int], list[int]]:
    """The rows and dataset items of the first batch that holds a zero item, from a plain loader's
    own order (its sampler draws after the loader's seed, so the loader is iterated, not the sampler)."""

    class Named(Items):
        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            return super().__getitem__(i), i

    plain = DataLoader(Named(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(7))
    for _, batch in plain:
        rows = [r for r, i in enumerate(batch.tolist()) if i in ZERO]
        if rows:
            return rows, [int(batch[r]) for r in rows]
    raise AssertionError("no zero item sampled")


def _rows(report) -> dict:
    first = report.by_name("nonfinite-produced")[0]
    return first.evidence["experiment"]["rows"]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_bad_rows_are_named_as_the_dataset_items_the_sampler_chose(workers):
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    loader = _loader(num_workers=workers)
    with fpdoctor.trace(model) as t:
        for x in loader:
            model(normalise(x)).sum().backward()
    rows, items = _expected()
    found = _rows(t.report)
    assert found["indices"] == rows and found["dataset_indices"] == items
    message = t.report.by_name("nonfinite-produced")[0].message
    assert f"dataset item {items[0]}" in message or f"dataset items {items[0]}" in message


def test_an_epoch_cut_short_does_not_shift_the_next_epochs_items():
    """Persistent workers prefetch the rest of a broken-off epoch; a new epoch drops it."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    loader = DataLoader(Items(), batch_size=16, shuffle=False, num_workers=2, persistent_workers=True)
    for _ in loader:  # an epoch cut short, outside the trace
        break
    batches = list(loader.batch_sampler)
    with fpdoctor.trace(model) as t:
        for epoch in range(2):
            for step, x in enumerate(loader):
                if epoch == 0 and step == 0:
                    break  # prefetched batches are left behind
                model(normalise(x)).sum().backward()
    first_bad = next(b for b in batches if ZERO & set(b))
    found = _rows(t.report)
    assert found["dataset_indices"] == [i for i in first_bad if i in ZERO]


def test_an_iterable_dataset_names_rows_only():
    class Stream(IterableDataset):
        def __iter__(self):
            for i in range(32):
                yield Items()[i]

    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    with fpdoctor.trace(model) as t:
        for x in DataLoader(Stream(), batch_size=16):
            model(normalise(x)).sum().backward()
    found = _rows(t.report)
    assert found["indices"] == [13] and "dataset_indices" not in found


def test_the_dataloader_is_left_as_it_was():
    from torch.utils.data import dataloader

    before = dict(vars(dataloader._BaseDataLoaderIter))
    loader = _loader()
    with fpdoctor.trace():
        assert vars(dataloader._BaseDataLoaderIter)["__next__"] is not before["__next__"]
        it = iter(loader)
        next(it)
    assert dict(vars(dataloader._BaseDataLoaderIter)) == before
    assert not [name for name in vars(it) if "fpdoctor" in name]
    # the batches are the batches a plain loader gives
    plain = [b.clone() for b in _loader()]
    with fpdoctor.trace():
        traced = list(_loader())
    assert all(torch.equal(a, b) for a, b in zip(plain, traced, strict=True))


def test_a_watched_run_names_the_bad_items_of_the_step_it_replayed():
    """The replay of a bad step is traced inside the watch: it reads the batch that step was given."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with fpdoctor.watch(reference_every=0) as w:
        for x in _loader():
            opt.zero_grad()
            model(normalise(x)).pow(2).mean().backward()
            opt.step()
    _, items = _expected()
    bad = next(f for f in w.report.findings if f.evidence.get("rows"))
    assert bad.evidence["rows"]["dataset_indices"] == items
    assert f"dataset item {items[0]}" in bad.message or f"dataset items {items[0]}" in bad.message


class Windows(Dataset):
    """Sensor windows standardised per sample; item 21 is a flat window (a stuck sensor)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        x = torch.randn(8, generator=torch.Generator().manual_seed(i)) + 3
        return torch.full((8,), 2.5) if i == 21 else x


def test_a_constant_sample_divided_by_its_own_spread_names_the_spread_as_the_zero():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    loader = DataLoader(Windows(), batch_size=16, shuffle=False)
    with fpdoctor.trace(model) as t:
        for x in loader:
            model((x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)).sum().backward()
    found = _rows(t.report)
    assert found["dataset_indices"] == [21] and found["indices"] == [5]
    assert found["differs"].startswith("argument 1 is all zero") and "constant row" in found["differs"]


def test_rows_along_a_dim_0_longer_than_the_known_batch_are_not_called_the_batch():
    """A bmm's dim 0 is batch x heads: 64 rows where the DataLoader handed out 32 items."""
    scores = torch.zeros(64, 4, 4)
    scores[5] = float("inf")
    with loader.rows_kept():
        loader.set_step_rows((list(range(100, 132)), None))
        text = loader.rows_text(loader.bad_rows(scores, batch=True))
    assert "rows" not in text or "of the 64 along dim 0" in text, text
    assert "(the batch)" not in text and "dataset item" not in text, text
    with loader.rows_kept():
        loader.set_step_rows((list(range(100, 164)), None))
        assert "(the batch)" in loader.rows_text(loader.bad_rows(scores, batch=True))
