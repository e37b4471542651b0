"""A bad step that does not reproduce, told apart four ways on the CPU (numerics/training/transient.py).

Each cause is injected into a small model so that the first training step goes non-finite and its
replay does not, as in a real job; each must get its own verdict, decided by its own experiment:

- the machine: an op that returns a wrong value on its first call only;
- a nondeterministic kernel: a reduction whose result depends on a call counter unless deterministic
  algorithms are on (atomics that add in another order each run; under them, one order);
- an uninitialised read: `torch.empty` whose unwritten padding reaches the result through a zero
  weight (0 x NaN = NaN). What the block holds is set by the test (NaN on the first call, zeros after,
  the way a real job's garbage is sometimes NaN): glibc's reuse of a freed block cannot be steered
  from Python reliably, and a fill_uninitialized_memory run writes over it as torch's fill does;
- a race on a reused buffer: a custom op standing in for a copy launched on a side stream, whose
  write lands late on every other call (the consumer then reads the buffer's previous tenant, NaN);
  a synchronisation completes it, the way `torch.cuda.synchronize()` waits for a stream. The CPU has
  no streams, so the test's side stream is completed by `torch.cpu.synchronize`, which the
  experiment calls after every op.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils.deterministic
from torch import nn

import fpdoctor
from fpdoctor.numerics.observe.batches import MicroBatch
from fpdoctor.numerics.training import transient
from fpdoctor.preserve import RngState

NAN = float("nan")


class Net(nn.Module):
    """8 -> 16 -> 1, with a hook between the two layers where each test injects its cause."""

    def __init__(self, middle) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 16)
        self.head = nn.Linear(16, 1)
        self.middle = middle

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self, torch.relu(self.lin(x))))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def _train_one_bad_step(model: Net) -> fpdoctor.Report:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = fpdoctor.Sentinel(model, opt, reference_every=0)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    guard.step(step, *_batch())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert guard.report.data["verdicts"] == {1: "transient-fault-suspected"}
    return guard.report


def _told(report: fpdoctor.Report):
    (finding,) = report.by_name("transient-fault-suspected")
    experiments = {e["name"]: e for e in finding.evidence["experiments"]}
    return finding, experiments


# -- the four causes --------------------------------------------------------------------------------


def test_an_op_wrong_on_its_first_call_only_is_the_machine():
    calls = {"n": 0}

    def faulty(net: Net, h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return h * NAN if calls["n"] == 1 else h  # a wrong tile, once

    finding, ran = _told(_train_one_bad_step(Net(faulty)))
    assert finding.evidence["cause"] == "machine"
    assert finding.title.startswith("A non-finite step did not reproduce when replayed: the machine")
    for name in ("as run", "deterministic", "ordered"):
        assert ran[name]["gave"] == "1 result in 2 runs, finite", ran[name]
    assert ran["fill"]["gave"] == ran["ordered+fill"]["gave"] == "finite"
    assert "zero-fill" not in ran and "neighbour" not in ran  # a CPU step has no neighbour here
    assert "no other device here" in finding.message and "the machine" in finding.message
    assert not finding.trial.tried and "action on the machine" in finding.trial.reason  # a drain: untried
    assert "fpdoctor health" in finding.fix


def test_a_reduction_that_depends_on_its_order_is_a_nondeterministic_kernel():
    calls = {"n": 0}

    def reduction(net: Net, h: torch.Tensor) -> torch.Tensor:
        total = h.sum(-1, keepdim=True)  # (4, 1)
        if not torch.are_deterministic_algorithms_enabled():
            calls["n"] += 1  # another order of the atomics each run: other low bits, once an overflow
            total = total * math.inf if calls["n"] == 1 else total * (1 + calls["n"] * 2.0**-20)
        return h + total

    finding, ran = _told(_train_one_bad_step(Net(reduction)))
    assert finding.evidence["cause"] == "nondeterministic-kernel", finding.message
    assert ran["as run"]["gave"] == "2 results in 2 runs, finite"
    assert ran["deterministic"]["gave"] == "1 result in 2 runs, finite"
    assert "torch.use_deterministic_algorithms(True)" in finding.message
    trial = finding.trial
    assert trial.tried and trial.changed.startswith("torch.use_deterministic_algorithms(True")
    assert (trial.before, trial.after) == ("2 results in 2 runs, finite", "1 result in 2 runs, finite")
    assert "use_deterministic_algorithms(True)" in finding.fix


def test_a_torch_empty_read_is_an_uninitialised_read():
    calls = {"n": 0}
    width = 1024  # (4, 1024) fp32: 16 KiB, a size nothing else in the step allocates

    def padded(net: Net, h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        pad = torch.empty(4, width)
        if not _filled():  # the block holds what its last tenant left: NaN once, zeros after
            with torch.no_grad():
                pad.copy_(torch.full_like(pad, NAN if calls["n"] == 1 else 0.0))
        pad[:, :16] = h  # the kernel writes 16 columns; the padding stays as the allocator gave it
        weight = torch.zeros(width, 16)
        weight[:16] = torch.eye(16)  # the padding's weights are zero: 0 x garbage = 0, 0 x NaN = NaN
        return pad @ weight

    finding, ran = _told(_train_one_bad_step(Net(padded)))
    assert finding.evidence["cause"] == "uninitialised-read", finding.message
    assert ran["as run"]["gave"] == ran["deterministic"]["gave"] == "1 result in 2 runs, finite"
    assert ran["fill"]["gave"] == "non-finite" and ran["ordered+fill"]["gave"] == "non-finite"
    assert "fill_uninitialized_memory" in finding.message
    assert ran["zero-fill"]["gave"] == "finite"
    trial = finding.trial  # the fix, tried: the fresh memory zero-filled
    assert trial.tried and "zeros" in trial.changed and trial.after == "finite"
    assert "torch.zeros" in finding.fix


def _filled() -> bool:
    """torch.empty's memory is NaN-filled (fill_uninitialized_memory under deterministic algorithms):
    the fill writes over whatever the block held."""
    return torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory


class _SideStream:
    """A stream the CPU does not have: a copy launched on it lands when the stream is synchronised,
    or late, after the consumer has read, on every other launch (timing)."""

    def __init__(self) -> None:
        self.launches = 0
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    def launch(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.launches += 1
        self.pending.append((src.clone(), dst))
        if self.launches % 2 == 0:  # this time the copy finished before the next op read it
            self.synchronize()

    def synchronize(self) -> None:
        while self.pending:
            src, dst = self.pending.pop(0)
            dst.copy_(src)


@pytest.fixture
def side_stream(monkeypatch):
    stream = _SideStream()

    @torch.library.custom_op("fpdoctor_test_transient::side_copy", mutates_args=("dst",))
    def side_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
        stream.launch(src, dst)

    # the device's synchronize completes the side stream's work, as torch.cuda.synchronize does
    monkeypatch.setattr(torch.cpu, "synchronize", stream.synchronize)
    return stream


def test_a_reused_buffer_read_before_its_write_is_a_race(side_stream):
    block = torch.full((4, 16), NAN)  # a block of the allocator's: its previous tenant padded it with NaN

    def racy(net: Net, h: torch.Tensor) -> torch.Tensor:
        torch.ops.fpdoctor_test_transient.side_copy(h.detach(), block)  # the copy into it runs on a side stream
        out = h + block  # read on this stream, without waiting for the copy
        side_stream.synchronize()  # the side stream finishes later on
        block.fill_(NAN)  # freed, and handed to its next tenant, which pads it with NaN again
        return out

    finding, ran = _told(_train_one_bad_step(Net(racy)))
    assert finding.evidence["cause"] == "race", finding.message
    assert ran["as run"]["gave"] == "2 results in 2 runs, 1 non-finite"
    assert ran["deterministic"]["gave"] == "2 results in 2 runs, 1 non-finite"
    assert ran["ordered"]["gave"] == "1 result in 2 runs, finite"
    assert any("torch.cpu.synchronize()" in n for n in ran["ordered"]["not_applied"])  # what the CPU cannot order
    trial = finding.trial
    assert trial.tried and trial.changed.startswith("a synchronisation after every op")
    assert (trial.before, trial.after) == ("2 results in 2 runs, 1 non-finite", "1 result in 2 runs, finite")
    assert "record_stream" in finding.fix and "a read ran before its write" in finding.message


# -- undecided, the settings put back, the neighbour -------------------------------------------------


def test_a_step_that_varies_under_every_setting_is_undecided_and_says_what_was_tried():
    calls = {"n": 0}

    def flaky(net: Net, h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return h * NAN if calls["n"] % 2 == 1 else h  # bad on every other call, whatever is set

    finding, _ = _told(_train_one_bad_step(Net(flaky)))
    assert finding.evidence["cause"] == "undecided"
    assert finding.title == "A non-finite step did not reproduce when replayed, and no experiment decided why"
    assert not finding.trial.tried
    for name in ("as run", "deterministic", "fill", "ordered"):
        assert name in finding.trial.reason  # what was tried, each with what it gave


@pytest.fixture
def user_settings():
    was = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])
    torch.utils.deterministic.fill_uninitialized_memory = was[2]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = was[3], was[4]


@pytest.mark.parametrize("settings", [(False, False, False, True), (True, True, True, False)])
def test_the_users_settings_are_put_back_exactly(user_settings, settings):
    mode, warn_only, fill, benchmark = settings
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    torch.backends.cudnn.benchmark = benchmark
    calls = {"n": 0}

    def once(net: Net, h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return h * NAN if calls["n"] == 1 else h

    _told(_train_one_bad_step(Net(once)))
    assert torch.are_deterministic_algorithms_enabled() is mode
    assert torch.is_deterministic_algorithms_warn_only_enabled() is warn_only
    assert torch.utils.deterministic.fill_uninitialized_memory is fill
    assert torch.backends.cudnn.benchmark is benchmark and torch.backends.cudnn.deterministic is False


def test_the_neighbour_runs_the_step_on_copies_and_the_weights_stay_as_they_were():
    """On a GPU the neighbour is a second GPU or the CPU; here the CPU stands in for it, on copies."""
    calls = {"n": 0}

    def once(net: Net, h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return h

    model = Net(once)
    params = list(model.parameters())
    x, y = _batch()

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in params]
    told = transient.decide(
        model, params, step, [MicroBatch(RngState.capture(), (x, y), {})], list, neighbour=torch.device("cpu")
    )
    assert told.cause == "machine"
    near = told.experiment("neighbour")
    assert near is not None and near.stable and "on cpu it is finite too" in told.decided_by
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    assert all(p.grad is None for p in params)


def test_experiments_are_not_run_under_torch_distributed_and_are_bounded_per_run():
    told = transient.Experiments(limit=1)
    under = told.decide(nn.Linear(1, 1), [], lambda: None, [], list, step=1, distributed=True)
    assert under.cause == "undecided" and "torch.distributed" in (under.why_not or "")
    told.decided[3] = "machine"
    later = told.decide(nn.Linear(1, 1), [], lambda: None, [], list, step=9)
    assert later.cause == "undecided" and "step 3: machine" in (later.why_not or "")
