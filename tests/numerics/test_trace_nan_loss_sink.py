"""A NaN made by the op that computes the loss is never "masked": cross_entropy with class weights
in fp16, whose total weight over a large batch passes fp16's max (16,384 rows, weights 1..10), makes
the loss NaN (its sum divided by Inf) while every gradient is a finite 0. trace said OK, NUM005 "later
ops masked or dropped it before it reached ... the loss", on a run whose loss printed nan at every
step. The backward's first node is the loss's: its op is a sink."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

import fpdoctor


def _classes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module, torch.optim.Optimizer]:
    """16,384 rows of 10 classes weighted 1..10 in fp16 (their total weight past 65504), a model, SGD."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16384, 16, generator=g).half()
    y = torch.randint(0, 10, (16384,), generator=g)
    weights = torch.arange(1, 11, dtype=torch.float16)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).half()
    return x, y, weights, model, torch.optim.SGD(model.parameters(), lr=0.05)


def test_a_nan_loss_from_a_weighted_cross_entropy_in_fp16_is_named_at_its_line() -> None:
    x, y, weights, model, opt = _classes()
    with fpdoctor.Trace(model) as tr:
        for _ in range(2):
            loss = F.cross_entropy(model(x), y, weight=weights)  # the loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not torch.isfinite(loss)
    report = tr.report
    assert report is not None and report.verdict == "error", str(report)
    first = report.findings[0]
    source = inspect.getsource(test_a_nan_loss_from_a_weighted_cross_entropy_in_fp16_is_named_at_its_line)
    line = test_a_nan_loss_from_a_weighted_cross_entropy_in_fp16_is_named_at_its_line.__code__.co_firstlineno + next(
        i for i, s in enumerate(source.splitlines()) if s.endswith("# the loss")
    )
    assert first.name == "nonfinite-produced" and f":{line}" in str(first.evidence.get("location", "")), str(report)
    assert "the loss (what backward() starts from)" in first.message
    assert not report.by_name("nonfinite-masked")


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, nn.Module]:
    """16384 samples, weights 1-10 and a classifier, all in pure fp16: the weights' total is past 65504."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16384, 16, generator=g).half()
    y = torch.randint(0, 10, (16384,), generator=g)
    w = (1 + 9 * torch.rand(16384, generator=g)).half()
    return x, y, w, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 10)).half()


def _weighted(fixed: bool) -> tuple[fpdoctor.Report | None, torch.Tensor]:
    x, y, w, model = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step() -> torch.Tensor:
        per = F.cross_entropy(model(x), y, reduction="none")
        # as printed, fixed: each sum on the line in fp32
        wide = torch.float32 if fixed else None
        loss = (w * per).sum(dtype=wide) / w.sum(dtype=wide)  # the weighted loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    if fixed:
        return None, step()
    with fpdoctor.Trace(model) as tr:
        loss = step()
    return tr.report, loss


def test_a_line_with_two_sums_gets_a_fix_for_both_as_the_check_ran_it() -> None:
    """`(w * l).sum() / w.sum()` in fp16 over 16,384 rows: both sums pass 65504. The fix named "the"
    sum with `.sum(dtype=torch.float32)`, checked by the whole line in fp32; applied to the first sum
    alone, the loss went from NaN to exactly 0 (an fp32 sum over an Inf)."""
    report, loss = _weighted(fixed=False)
    assert report is not None and not torch.isfinite(loss)
    first = report.findings[0]
    assert first.name == "nonfinite-produced" and "give each of the 2 `.sum()` calls on that line" in first.fix, (
        first.fix
    )
    _, fixed = _weighted(fixed=True)
    assert torch.isfinite(fixed) and 1.0 < float(fixed.detach()) < 4.0  # a cross-entropy over 10 classes near ln 10


def test_the_watchs_own_checks_inside_a_traced_step_are_not_the_programs_ops() -> None:
    """Under `fpdoctor watch`, the step traced after a bad one is traced until the next forward: the
    watch's own judging in the optimizer's hook ran inside it, and isfinite's abs of the NaN loss was
    reported as NUM002 "NaN already in an input ... check the data pipeline", no line."""
    x, y, weights, model, opt = _classes()
    with fpdoctor.watch() as w:
        for _ in range(4):
            loss = F.cross_entropy(model(x), y, weight=weights)
            opt.zero_grad()
            loss.backward()
            opt.step()
    names = [f.name for f in w.report.findings]
    assert "nonfinite-produced" in names and "nonfinite-input" not in names, names


def test_a_reentrant_checkpoints_inner_backward_is_no_loss() -> None:
    """`checkpoint(use_reentrant=True)` starts a backward of its own inside the step's, at the segment it
    recomputes: its first node is no loss. A healthy loop whose NaN (a log of negative values) is masked
    after the checkpointed block stays OK, as it is without the checkpoint."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin, head = nn.Linear(16, 16), nn.Linear(16, 1)
    opt = torch.optim.SGD([*lin.parameters(), *head.parameters()], lr=0.01)
    g = torch.Generator().manual_seed(1)
    with fpdoctor.Trace() as tr:
        for _ in range(2):
            x = torch.randn(64, 16, generator=g, requires_grad=True)
            h = checkpoint(lambda v: torch.log(lin(v)), x, use_reentrant=True)
            loss = head(torch.where(torch.isnan(h), torch.zeros_like(h), h)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.isfinite(loss)
    assert tr.report is not None and tr.report.verdict == "ok", str(tr.report)


def test_a_line_of_different_reductions_names_every_op_the_check_ran_wide() -> None:
    """`torch.dot(w, l) / w.sum()` in fp16: the check ran the whole line in fp32, and the fix named one
    op; applied to it alone, the loss was 0 (the other sum still Inf). Every other op is named."""
    x, y, w, model = _batch()
    with fpdoctor.Trace(model) as tr:
        per = F.cross_entropy(model(x), y, reduction="none")
        loss = torch.dot(w, per) / w.sum()  # the loss
        loss.backward()
    assert tr.report is not None and not torch.isfinite(loss)
    first = tr.report.findings[0]
    assert first.name == "nonfinite-produced" and "and every other op on that line" in first.fix, first.fix
    named = {"dot", "sum"} - {first.where["op"].split(".")[1]}
    assert all(f"({op}" in first.fix or f", {op}" in first.fix for op in named), first.fix
