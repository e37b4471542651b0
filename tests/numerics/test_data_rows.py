"""A NaN/Inf the data makes is the data's: rows of the batch far out of line with the others that
alone make it (checked by the op re-run on the other rows) are named with their dataset items, and
the fix is the data's, never a wider format (which only moves the overflow along); an item whose
own loading divides 0 by 0 names the index its __getitem__ read, and the guard in the line's terms."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import fpdoctor

BAD = 37  # the corrupt item


class Readings(Dataset):
    """64 items of 12 readings; item BAD holds `value` in reading `at` (a logger's garbage, a unit
    error), or in its target."""

    def __init__(self, value: float, *, target: bool = False) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(64, 12, generator=g)
        self.y = self.x[:, :2].sum(1, keepdim=True)
        (self.y if target else self.x)[BAD, 0] = value

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _train(dataset: Dataset, model: nn.Module, loss_fn) -> fpdoctor.Report:
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not torch.isfinite(loss):
                break
    return t.report


def _row_of_bad() -> int:
    order = list(DataLoader(range(64), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5)))
    batch = next(b for b in order if BAD in b.tolist())
    return batch.tolist().index(BAD)


def _assert_the_data_is_named(report: fpdoctor.Report) -> None:
    first = report.findings[0]
    assert first.name == "nonfinite-produced", [f.name for f in report.findings]
    experiment = first.evidence["experiment"]
    assert experiment["verdict"] == "data", experiment
    rows = experiment["rows_standing_out"]
    assert rows["indices"] == [_row_of_bad()] and rows["dataset_indices"] == [BAD]
    assert f"dataset item {BAD}" in first.title and "stand" in first.title
    assert f"dataset[{BAD}]" in first.fix and "fp64" not in first.fix and "Not a precision change" in first.fix
    assert first.trial is not None and first.trial.tried and "left out" in first.trial.changed
    assert isinstance(first.trial.after, float) and first.trial.after < 1e6


def test_a_reading_far_out_of_line_in_one_item_is_named_with_its_dataset_item():
    """A reading of 4e36 in one item: the first Linear's output overflows in that row only (addmm,
    its rows); fp64 would make it finite, so the precision experiment alone would print a wider format."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[0].weight.mul_(200.0)  # 4e36 * 200 passes float32's 3.4e38 in that row
    report = _train(Readings(4e36), model, nn.functional.mse_loss)
    _assert_the_data_is_named(report)


def test_a_target_in_the_wrong_units_in_one_item_is_named_when_the_loss_overflows():
    """A target of 3e20 (a unit error in one label): the squared error overflows in the loss, a
    reduction with no rows of its own; the rows that stand out are its input's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 1))
    report = _train(Readings(3e20, target=True), model, nn.functional.mse_loss)
    _assert_the_data_is_named(report)


def test_rows_that_differ_by_less_than_the_data_would_are_left_to_the_precision_experiment():
    """One row 50x the others in fp16 overflows in the square: a precision matter (fp32 holds it),
    not data far out of line with the rest: no data verdict."""
    x = torch.full((8, 4), 30.0, dtype=torch.float16)
    x[3] = 1500.0
    with fpdoctor.trace() as t:
        y = (x * x).sum(1)
    assert not bool(torch.isfinite(y).all())
    first = t.report.by_name("nonfinite-produced")[0]
    assert first.evidence["experiment"]["verdict"] != "data"
    assert "rows_standing_out" not in first.evidence["experiment"]


class MinMaxScaled(Dataset):
    """Each item scaled to [0, 1] by its own range as it is read: a constant item divides 0 by 0."""

    def __init__(self) -> None:
        self.x = torch.randn(48, 6, generator=torch.Generator().manual_seed(1))
        self.x[BAD] = 2.5  # a sensor stuck at one value

    def __len__(self) -> int:
        return 48

    def __getitem__(self, index: int) -> torch.Tensor:
        x = self.x[index]
        return (x - x.min()) / (x.max() - x.min())


def test_a_nan_made_while_loading_an_item_names_the_index_and_guards_the_lines_own_denominator():
    torch.manual_seed(0)
    model = nn.Linear(6, 1)
    loader = DataLoader(MinMaxScaled(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))
    with fpdoctor.trace(model) as t:
        for x in loader:
            model(x).sum().backward()
    first = t.report.by_name("nonfinite-produced")[0]
    assert first.evidence["dataset_index"] == BAD
    assert f"reading dataset[{BAD}]" in first.message
    assert "guard the denominator `x.max() - x.min()`" in first.fix, first.fix
    assert "(x - x.min()) / (x.max() - x.min() + torch.finfo(torch.float32).eps)" in first.fix
    assert first.trial is not None and first.trial.tried and first.trial.after == 0.0


class _Sequences(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(64, 8, 3, generator=torch.Generator().manual_seed(1))
        self.x[BAD, 2, 0] = 4e36  # time step 2 of item BAD

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]


def test_a_batch_transposed_to_sequence_first_names_the_item_by_the_loaders_rows_not_the_time_steps():
    """[T, B, F] with T == B: the op's rows are time steps; the item is the loader batch's row."""
    torch.manual_seed(0)
    rnn = nn.LSTM(3, 4)
    loader = DataLoader(_Sequences(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    with fpdoctor.trace(rnn) as t:
        for x in loader:
            out, _ = rnn(x.transpose(0, 1) ** 2)
            out.sum().backward()
            if not bool(torch.isfinite(out).all()):
                break
    rows = t.report.findings[0].evidence["experiment"]["rows_standing_out"]
    assert rows["dataset_indices"] == [BAD], rows


def test_a_mask_fill_or_a_computed_value_out_of_line_is_not_called_data():
    """A padded row's additive mask at fp16's min beside a position bias: its sum overflows, a precision
    matter; the rows out of line are values the code made, and no input of the step holds such rows."""
    scores = torch.randn(6, 12, dtype=torch.float16)
    mask = torch.zeros(6, 12, dtype=torch.float16)
    with fpdoctor.trace() as t:
        fill = mask.clone()
        fill[2, 8:] = torch.finfo(torch.float16).min  # the padding of row 2
        biased = (scores + fill) - 40.0  # a position bias subtracted: -65504 - 40 is -inf in fp16
        total = biased.sum()  # the scores read whole (a logged mean): -inf
    assert not bool(torch.isfinite(total))
    first = t.report.by_name("nonfinite-produced")[0]
    assert first.evidence["experiment"]["verdict"] != "data", first.evidence["experiment"]


def _classify(value: float, foreach: bool) -> tuple[fpdoctor.Report, int]:
    """A classifier on Readings with `value` in item BAD, Adam(foreach=): the loss stays finite (a
    cross-entropy of huge logits is huge, not Inf) and the weights stay finite, while the square of the
    first layer's gradient overflows in Adam's second moment, which then holds Inf for good (the Inf
    elements of exp_avg_sq at the end are returned)."""
    torch.manual_seed(0)
    dataset = Readings(value)
    dataset.y = (dataset.x[:, 1] > 0).long()
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2))
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=foreach)
    with fpdoctor.trace(model) as t:
        for _ in range(2):
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                assert torch.isfinite(loss)
    frozen = sum(int(s["exp_avg_sq"].isinf().sum()) for s in opt.state.values())
    return t.report, frozen


def test_an_item_that_overflows_adams_second_moment_is_named_though_loss_and_weights_stay_finite():
    """A reading of 3e24: the gradient of the first Linear reaches ~1e22 and its square is Inf in
    exp_avg_sq, so those weights never move again; the run's loss and weights stay finite. The
    optimizer's state is where the Inf stays (was: 'masked', info), and the data is why, checked by
    the gradient's backward op re-run without that row and Adam's op re-run on what it gives."""
    for foreach in (False, True):
        report, frozen = _classify(3e24, foreach)
        assert frozen > 0  # the run really is broken
        _assert_the_data_is_named(report)
        first = report.findings[0]
        assert first.severity == "error"
        assert any("optimizer state exp_avg_sq of 0.weight" in r for r in first.evidence["reaches"])
        through = first.evidence["experiment"]["rows_standing_out"]["through"]
        assert through["gradient_before"] > 1e19 and through["gradient_after"] < 1e3
        assert "backward" in first.trial.changed and "optimizer's state keeps it" in first.message


def test_an_optimizer_state_overflow_with_no_item_out_of_line_is_not_called_data():
    """The same classifier on readings every one of which is 1e22 times too large (a unit error in the
    whole set): the gradient's square overflows Adam's second moment as before, but no row of the
    batch stands out from the others, so no item is named."""
    torch.manual_seed(0)
    dataset = Readings(0.5)
    dataset.y = (dataset.x[:, 1] > 0).long()
    dataset.x *= 1e22
    model = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 2))
    loader = DataLoader(dataset, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert any(int(s["exp_avg_sq"].isinf().sum()) for s in opt.state.values())
    first = t.report.findings[0]
    assert first.name == "nonfinite-produced" and first.severity == "error", [f.name for f in t.report.findings]
    assert first.evidence["experiment"]["verdict"] != "data"
    assert any(r.startswith("optimizer state exp_avg_sq") for r in first.evidence["reaches"])


def test_rows_out_of_line_are_the_data_through_a_linear_as_wide_as_the_batch():
    """A batch of 16 given as it is, one row holding 1e38, a first Linear 16 wide: its weight's transpose
    has as many columns as the batch has rows, and cutting those too made addmm fail, so the verdict fell
    to the precision experiment ("compute it in fp64")."""
    for width in (32, 16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, 1))
        with torch.no_grad():
            model[0].weight.mul_(100.0)
        x = torch.randn(16, 12)
        x[5, 0] = 1e38
        with fpdoctor.trace(model) as t:
            model(x)
        first = t.report.findings[0]
        assert first.evidence["experiment"]["verdict"] == "data", (width, first.title)
        assert "row 5 of the batch" in first.title and "fp64" not in first.fix


class Frames(Dataset):
    """Frames standardised by their own std: a constant frame (items 5 and 40) divides 0 by 0."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.x = torch.rand(64, 1, 8, 8, generator=g)
        self.x[5] = 0.0
        self.x[40] = 1.0

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = self.x[i]
        return (x - x.mean()) / x.std(), i % 2


def test_items_made_in_dataloader_workers_are_named_once_with_every_step():
    """num_workers=2: the batch reaches the main process rebuilt from shared memory (set_ on a storage),
    which was "a constant created by aten.set_", one finding per batch, with "check the data pipeline"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(144, 2))
    loader = DataLoader(Frames(), batch_size=16, num_workers=2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with fpdoctor.trace(model) as t:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    inputs = t.report.by_name("nonfinite-input")
    assert len(inputs) == 1 and inputs[0] is t.report.findings[0], [f.title for f in t.report.findings]
    first = inputs[0]
    assert first.evidence["origin"] == "input" and first.evidence["dataset_indices"] == [5, 40], first.evidence
    assert first.evidence["occurrences"] == 2 and "dataset items 5, 40" in first.fix and "num_workers=0" in first.fix
