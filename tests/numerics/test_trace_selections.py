"""A value selected from an op's output (gather, advanced indexing) between the op whose precision
lost it and the op that made NaN/Inf: the upstream walk selects the same values again from each
recomputed output, so the origin is found. Before, the selection kept its as-ran fp16 value (an
underflowed 0) in every fp64 re-run, and a survival loss whose cumprod underflows was told "in fp64
this op is non-finite too, so fp32 will not help" with an eps that is 0 in fp16."""

from __future__ import annotations

import pytest
import torch

import fpdoctor
from fpdoctor.numerics.engine import reruns


def _survival_nll(h: torch.Tensor, t: torch.Tensor, how: str) -> torch.Tensor:
    surv = torch.cumprod(1 - h, dim=1)  # the probability of surviving to each step: 0.5^90 underflows fp16
    at = surv.gather(1, t[:, None]).squeeze(1) if how == "gather" else surv[torch.arange(len(t)), t]
    return -torch.log(h[:, 0] * at).mean()


CUMPROD_LINE = _survival_nll.__code__.co_firstlineno + 1


@pytest.mark.parametrize("how", ["gather", "index"])
def test_the_walk_selects_again_from_a_recomputed_output_and_finds_the_origin(how: str) -> None:
    h = torch.full((4, 96), 0.5, dtype=torch.float16, requires_grad=True)
    t = torch.tensor([5, 30, 60, 90])
    with fpdoctor.Trace() as tr:
        _survival_nll(h, t, how).backward()
    first = tr.report.findings[0]
    experiment = first.evidence["experiment"]
    assert experiment["verdict"] == "origin", experiment
    assert experiment["origin"]["op"].startswith("aten.cumprod"), experiment
    assert experiment["origin"]["location"].endswith(f":{CUMPROD_LINE}"), experiment
    assert first.trial is not None and first.trial.tried, first.trial
    assert "will not help" not in first.fix


def test_only_the_latest_selections_are_kept() -> None:
    window = reruns.Window()
    outs = [torch.zeros(1) for _ in range(reruns.SELECTIONS + 5)]
    for out in outs:
        window.select(out, torch.ops.aten.gather.default, (), {})
    assert len(window.selections) == reruns.SELECTIONS
    assert id(outs[-1]) in window.selections and id(outs[0]) not in window.selections
    window.clear()
    assert not window.selections


def test_the_selections_hold_a_bounded_share_of_the_windows_bytes() -> None:
    window = reruns.Window(max_bytes=4 * 2**20)  # a quarter: 1 MiB of sources
    sources = [torch.zeros(2**16) for _ in range(8)]  # 256 KiB each
    outs = [torch.zeros(1) for _ in sources]
    for source, out in zip(sources, outs, strict=True):
        window.select(out, torch.ops.aten.gather.default, (source, 0, torch.zeros(1, dtype=torch.long)), {})
    assert window.selection_bytes <= 2**20 and len(window.selections) == 3  # 256 KiB and an index each
    window.select(torch.zeros(1), torch.ops.aten.gather.default, (torch.zeros(2**19),), {})  # 2 MiB: not kept
    assert len(window.selections) == 3
