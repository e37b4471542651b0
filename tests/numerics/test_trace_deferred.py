"""The deferred check (how the trace runs on a GPU), run on the CPU: each op's range stays on the
device and is read a batch of ops at a time, parameters and inputs met by the trace included.
A NaN made by an op is named as that op, with its line and the ranges of what it read; bad input
data is named with its rows as the immediate check names them; a finite training run says OK;
the trace adds no host read per op or per parameter, only one per batch of ops."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fpdoctor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from models import batch, make_step, small_transformer


class LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return torch.log(h - 100.0)  # negative everywhere: NaN, made here


LOG_LINE = LogBlock.forward.__code__.co_firstlineno + 2


def _log_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), LogBlock(), nn.Linear(32, 4))


@pytest.mark.parametrize("sync_every", [3, 256])
def test_a_nan_made_by_an_op_is_named_with_its_line_and_inputs(sync_every: int) -> None:
    model = _log_model()
    x = torch.randn(8, 16)
    with fpdoctor.Trace(model, immediate=False, sync_every=sync_every) as tr:
        model(x).sum().backward()
    first = tr.report.findings[0]
    assert first.name == "nonfinite-produced", str(tr.report)
    assert first.where["op"].startswith("aten.log"), first.where
    assert first.where["module"] == "2", first.where
    assert first.evidence["location"] == f"{__file__}:{LOG_LINE} in forward", first.evidence
    (read,) = first.evidence["inputs"]  # what log read: h - 100, its exact range read with the batch
    assert read["from"].startswith("aten.sub"), read
    assert read["nonfinite"] is None and read["max"] < 0, read
    with torch.no_grad():
        h = model[2].proj(model[1](model[0](x))) - 100.0
    assert (read["min"], read["max"]) == (h.min().item(), h.max().item())
    with fpdoctor.Trace(model, immediate=True) as immediate:
        model(x).sum().backward()
    assert [(f.name, f.where, f.evidence["location"]) for f in immediate.report.findings[:1]] == [
        (first.name, first.where, first.evidence["location"])
    ]


def test_nan_in_the_input_data_is_named_with_its_rows_as_the_immediate_check_names_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    x[3, 5] = math.nan
    found = {}
    for immediate in (True, False):
        with fpdoctor.Trace(model, immediate=immediate, sync_every=4) as tr:
            model(x).sum()
        first = tr.report.findings[0]
        found[immediate] = (first.name, first.where, first.evidence.get("rows"), first.evidence.get("counts"))
    assert found[False] == found[True], found
    assert found[False][2] == {"indices": [3], "of": 8, "batch": True}, found


def test_a_nan_weight_is_named_before_the_optimizer_writes_it() -> None:
    """A parameter met in the forward and read with a later batch, after the optimizer step
    wrote it: still named as the weight that held NaN, with its range from when it was read."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        model[2].weight[1, 3] = math.nan
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with fpdoctor.Trace(model, immediate=False, sync_every=4096) as tr:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
    inputs = [f for f in tr.report.findings if f.name == "nonfinite-input"]
    assert inputs and inputs[0].where.get("input") == "2.weight", str(tr.report)


def _tiny_step(device: str = "cpu") -> tuple[nn.Module, object]:
    torch.manual_seed(0)
    model = small_transformer(layers=2, dim=32, heads=2).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer)
    tokens, targets = batch(size=2, length=8, device=device)

    def step() -> None:
        step_fn(tokens, targets)
        optimizer.step()

    return model, step


def test_a_finite_training_run_on_the_deferred_path_says_ok() -> None:
    model, step = _tiny_step()
    with fpdoctor.Trace(model, immediate=False, sync_every=64) as tr:
        for _ in range(3):
            step()
    assert tr.report.verdict == "ok", str(tr.report)
    assert not [f for f in tr.report.findings if f.severity.name in ("ERROR", "WARNING")], str(tr.report)


class _HostReads(TorchDispatchMode):
    """Counts the ops that read a value of `device` back to the host: on a GPU each is a sync.
    A read of a CPU tensor in a GPU run is none (a non-capturable AdamW keeps its step counts on
    the CPU, and the trace checks what is written there at once, as it does on a CPU run)."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.device = device
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads += args[0].device.type == self.device
        return func(*args, **(kwargs or {}))


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_deferred_trace_reads_back_once_per_batch_of_ops_not_per_op_or_parameter(device: str) -> None:
    """On a GPU each read is a host sync; there the trace is deferred without being asked."""
    model, step = _tiny_step(device)
    step()  # the optimizer's state exists: a plain step's own reads (AdamW's step counts) are steady
    with _HostReads(device) as plain:
        step()
    steps, sync_every = 0, 64
    flushes, in_flushes = [], []
    # the counter below the trace: it sees the tracer's own reads too
    immediate = False if device == "cpu" else None
    with _HostReads(device) as traced, fpdoctor.Trace(model, immediate=immediate, sync_every=sync_every) as tr:
        flush = tr.tracer.flush

        def counted() -> None:
            flushes.append(tr.tracer.records.count)
            before = traced.reads
            flush()
            in_flushes.append(traced.reads - before)

        tr.tracer.flush = counted  # type: ignore[method-assign]
        # enough ops for ten batches (a foreach AdamW, CUDA's default, records fewer ops a step)
        while steps < 3 or (tr.tracer.records.count <= 10 * sync_every and steps < 20):
            step()
            steps += 1
        in_block = traced.reads
        records = tr.tracer.records.count
    # every parameter met: no read of its own but at a flush, and there a few, not one per op of the
    # batch (sync_every) or per parameter (on a CPU none: tolist() copies; an H200 showed 6 a flush)
    assert in_block - sum(in_flushes) == plain.reads * steps, (in_block, in_flushes, plain.reads)
    assert all(n <= sync_every // 8 for n in in_flushes), in_flushes
    assert records > 10 * sync_every, records
    # one read per batch, and the last ones at the block's end (which reads what is left twice over)
    assert len(flushes) <= records // sync_every + 2, (len(flushes), records)
