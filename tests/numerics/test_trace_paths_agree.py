"""The tracer's fast paths (one output, or one tensor written in place) record exactly what its
general path records for the same ops: every field of every record and leaf, and the sinks,
in forward, backward and the optimizer step, in immediate and deferred mode, with NaN and Inf
produced, passed on, probed before an in-place write and scaled down without a reduction."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fpdoctor.numerics.trace.modules import ModuleTracker
from fpdoctor.numerics.trace.tracer import Tracer

Scenario = tuple[nn.Module | None, Callable[[], object]]


def _training_step(*, nan_at: int | None, foreach: bool) -> Scenario:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
    x = torch.randn(3, 4)
    if nan_at is not None:
        x[0, nan_at] = math.nan  # an input NaN, passed on through every layer

    def step() -> object:
        for _ in range(2):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()  # outside modules: counted per line
            loss.backward()
            optimizer.step()
        return loss

    return model, step


def _ops_outside_modules() -> object:
    buf = torch.tensor([1.0, math.nan, 2.0])  # met first by an in-place op: probed before it writes
    buf.add_(1.0)
    y = torch.tensor([0.0, 1.0, 4.0]) + 0.0
    logs = torch.log(y)  # -inf produced from finite values
    ratio = (y - y) / (y - y)  # NaN produced
    scaled = (y * 0.5) / 4.0  # scaled down: no reduction
    big = torch.full((2,), 3e38) * 2.0  # +inf: an fp32 overflow
    half = torch.full((4,), 60000.0, dtype=torch.float16) * 1.05  # near fp16's max
    grown = torch.ones(2, 2).mm(torch.ones(2, 2)).t().reshape(-1)  # a view of a view
    torch.add(y, scaled, alpha=2.0, out=torch.empty(3))  # out=: the general path in both
    return buf, logs, ratio, big, half, grown, torch.where(y > 0, logs, y).sum()


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "training step, foreach": lambda: _training_step(nan_at=None, foreach=True),
    "training step, per parameter": lambda: _training_step(nan_at=None, foreach=False),
    "training step with an input NaN": lambda: _training_step(nan_at=1, foreach=False),
    "ops outside modules": lambda: (None, _ops_outside_modules),
}


def _fields(tracer: Tracer) -> list[str]:
    """Every record, leaf and sink as text: NaN compares equal to itself there."""
    records = [repr(r) for r in sorted(tracer.records, key=lambda r: r.index)]
    leaves = [repr(leaf) for leaf in sorted(tracer.leaves, key=lambda leaf: leaf.index)]
    return [*records, *leaves, repr(sorted(tracer.sinks)), f"ops {tracer.ops_seen} records {tracer.records.count}"]


def _traced(scenario: str, *, fast_paths: bool, immediate: bool | None) -> tuple[list[str], int]:
    """The trace's records, and how many ops the fast path `_one` took."""
    model, run = SCENARIOS[scenario]()
    tracker = ModuleTracker([model] if model is not None else None)
    tracer = Tracer(tracker, immediate=immediate, fast_paths=fast_paths)
    fast = Tracer._one
    taken = []

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        taken.append(1)
        return fast(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Tracer, "_one", counted)
        with tracker, tracer:
            kept = run()  # alive until the end, as the user's values are
        tracer.finish()
    del kept
    assert not tracer.errors
    return _fields(tracer), len(taken)


@pytest.mark.parametrize("immediate", [None, False], ids=["immediate", "deferred"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_fast_paths_record_what_the_general_path_records(scenario, immediate):
    fast, taken = _traced(scenario, fast_paths=True, immediate=immediate)
    general, not_taken = _traced(scenario, fast_paths=False, immediate=immediate)
    assert taken > 5 and not_taken == 0
    assert fast == general
