"""The use metrics (decide.py) give the figures a plain implementation gives: fp64 log-softmax,
argmax and topk over the whole logits at once.

decide.py computes them in chunks, with the KL as lse(x) - lse(r) - sum p (x - r), the argmax of a
row whose max stands alone told by two max reductions, and the referee's rows kept for the calls
that follow on the same tensor. Each figure is checked against the plain one on random logits with
ties (integer logits: many rows tie at the max and at the fifth place), a masked column, very large
magnitudes, bf16/fp16/fp8 candidates, rows across chunk boundaries, and a referee written to in
place between two calls.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch

from fpdoctor.precision import decide
from fpdoctor.precision.metrics import round_to
from fpdoctor.precision.plan import metric as plan_metric


def _kl(r: torch.Tensor, x: torch.Tensor) -> float:
    log_p = torch.log_softmax(r, -1)
    value = float((log_p.exp() * (log_p - torch.log_softmax(x, -1))).sum(-1).mean())
    return max(value, 0.0) if math.isfinite(value) else math.inf


def plain(truth: torch.Tensor, candidate: torch.Tensor, fmt: str) -> dict[str, float]:
    """The figures as decisions defines them, computed the plain way."""
    r = truth.double().reshape(-1, truth.shape[-1])
    x = candidate.double().reshape(-1, truth.shape[-1])
    best = r.argmax(-1)
    rounded = round_to(r, fmt, r.abs().amax())
    k = min(decide.TOP_K, r.shape[-1])
    return {
        "top1": float((x.argmax(-1) == best).double().mean()),
        "top5": float((x.topk(k, -1).indices == best[:, None]).any(-1).double().mean()),
        "kl": _kl(r, x),
        "floor_top1": float((rounded.argmax(-1) == best).double().mean()),
        "floor_kl": _kl(r, rounded),
    }


def _close(got: float, want: float) -> bool:
    return got == want or math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-13)


def _same(found: decide.Decisions | None, want: dict[str, float]) -> None:
    assert found is not None
    for name in ("top1", "top5", "floor_top1"):  # shares of rows: exactly
        assert getattr(found, name) == want[name], name
    for name in ("kl", "floor_kl"):
        assert _close(getattr(found, name), want[name]), (name, getattr(found, name), want[name])


def _noisy(truth: torch.Tensor, dtype: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (truth + scale * torch.randn(truth.shape, generator=g, dtype=torch.float64)).to(dtype)


def _logits(rows: int, classes: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(rows, classes, generator=g, dtype=torch.float64)


def _tied(rows: int, classes: int, seed: int) -> torch.Tensor:
    """Integer logits: most rows hold their max, and their fifth largest, more than once."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 4, (rows, classes), generator=g).double()


CASES = {
    # name: (referee, candidate, format)
    "bf16": lambda: (t := _logits(300, 512, 0), _noisy(t, torch.bfloat16, 0.03, 1), "bf16"),
    "fp16, vocabulary 8192": lambda: (t := _logits(40, 8192, 2), _noisy(t, torch.float16, 0.01, 3), "fp16"),
    "ties at the max and the fifth place": lambda: (
        t := _tied(500, 64, 4),
        torch.where(_tied(500, 64, 5) > 2, t + 1, t).to(torch.bfloat16),
        "bf16",
    ),
    "the candidate's ties only": lambda: (_logits(200, 32, 6), _tied(200, 32, 7).to(torch.float16), "fp16"),
    "a masked column": lambda: (
        t := _logits(256, 100, 8).index_fill_(1, torch.tensor([0, 17]), -1e4),
        _noisy(t, torch.bfloat16, 0.05, 9),
        "bf16",
    ),
    "an offset of 1e4 (bf16's spacing 64)": lambda: (
        t := _logits(1000, 100, 10, scale=30.0) + 1e4,
        _noisy(t, torch.bfloat16, 1.0, 11),
        "bf16",
    ),
    "magnitudes of 1e30": lambda: (t := _logits(64, 50, 12, scale=1e30), _noisy(t, torch.bfloat16, 1e27, 13), "bf16"),
    "fp16 rounding overflows": lambda: (
        t := _logits(64, 50, 14).index_fill_(1, torch.tensor([3]), -1e6),
        _noisy(t, torch.float32, 1e-3, 15),
        "fp16",
    ),
    "fp8-e4m3, an fp8 tensor": lambda: (
        t := _logits(257, 300, 16, scale=50.0),
        _noisy(t, torch.float8_e4m3fn, 2.0, 17),
        "fp8-e4m3",
    ),
    "fp8-e5m2, its values in fp64": lambda: (
        t := _logits(100, 40, 18),
        round_to(_noisy(t, torch.float64, 0.2, 19), "fp8-e5m2"),
        "fp8-e5m2",
    ),
    "fp32, errors near fp64's": lambda: (
        t := _logits(50, 7, 20, scale=0.01),
        _noisy(t, torch.float32, 1e-9, 21),
        "fp32",
    ),
    "one class": lambda: (t := _logits(30, 1, 22), _noisy(t, torch.bfloat16, 0.1, 23), "bf16"),
    "batched rows, [4, 75, 512]": lambda: (
        t := _logits(300, 512, 24).reshape(4, 75, 512),
        _noisy(t, torch.bfloat16, 0.03, 25),
        "bf16",
    ),
}


@pytest.mark.parametrize("chunk", [decide.CHUNK, 1000], ids=["default chunks", "chunks of a few rows"])
@pytest.mark.parametrize("name", list(CASES))
def test_decisions_give_the_plain_figures(name: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decide, "CHUNK", chunk)  # 1000: a chunk ends inside the rows, the last one short
    truth, candidate, fmt = CASES[name]()
    want = plain(truth, candidate, fmt)
    found = decide.decisions(truth, candidate, fmt, "logits")
    _same(found, want)
    # the calls that follow on the same referee read its kept rows: the same figures
    assert decide.top1(truth, candidate) == want["top1"]
    both = decide.top1_and_kl(truth, candidate)
    assert both is not None and both[0] == want["top1"] and _close(both[1], want["kl"])
    assert _close(decide.kl(truth, candidate), want["kl"])
    floor = decide.rounding_floor(truth, fmt)
    assert floor is not None and floor[0] == want["floor_top1"] and _close(floor[1], want["floor_kl"])


def test_the_printed_figures_are_the_plain_ones() -> None:
    truth, candidate, fmt = CASES["ties at the max and the fifth place"]()
    found = decide.decisions(truth, candidate, fmt, "logits")
    assert found is not None
    want = decide.Decisions(source="logits", rows=found.rows, classes=found.classes, **plain(truth, candidate, fmt))
    assert found.text() == want.text()


def test_ties_are_many_in_the_tied_case() -> None:
    """The tied case tests what it says: rows tie at the max, the argmax is the first of them, and
    a tie at the fifth place leaves topk to choose."""
    truth, candidate, _ = CASES["ties at the max and the fifth place"]()
    for x in (truth, candidate.double()):
        at_max = (x == x.amax(-1, keepdim=True)).sum(-1)
        assert (at_max > 1).double().mean() > 0.9
        fifth = x.topk(5, -1).values[:, -1:]
        assert ((x == fifth).sum(-1) > 1).double().mean() > 0.9


@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_before_any_decisions_top1_alone_is_the_plain_one(fmt: str) -> None:
    truth, candidate, _ = CASES["ties at the max and the fifth place"]()
    assert decide.top1(truth.clone(), candidate) == plain(truth, candidate, fmt)["top1"]


def test_a_referee_written_in_place_is_read_again() -> None:
    truth, candidate, fmt = CASES["bf16"]()
    before = decide.decisions(truth, candidate, fmt, "logits")
    truth[:, 0] += 100.0  # every row's class is now the first
    assert decide.top1(truth, candidate) == plain(truth, candidate, fmt)["top1"]
    _same(decide.decisions(truth, candidate, fmt, "logits"), plain(truth, candidate, fmt))
    assert before is not None and before.top1 != decide.top1(truth, candidate)


def test_nothing_kept_outlives_the_referee() -> None:
    truth, candidate, fmt = CASES["bf16"]()
    decide.decisions(truth, candidate, fmt, "logits")
    assert decide._KEPT.entry is not None
    del truth
    gc.collect()
    assert decide._KEPT.entry is None


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["referee", "candidate"])
def test_logits_that_are_not_finite_are_not_judged(bad: float, where: str) -> None:
    truth, candidate, fmt = CASES["bf16"]()
    if where == "referee":
        truth[:, 5] = bad  # a -inf column: a mask written as -inf
    else:
        candidate[3, :] = bad
    assert decide.decisions(truth, candidate, fmt, "logits") is None
    assert decide.top1(truth, candidate) is None
    assert decide.top1_and_kl(truth, candidate) is None
    assert (decide.rounding_floor(truth, fmt) is None) == (where == "referee")


def test_a_referee_judged_finite_then_written_with_inf_is_read_again() -> None:
    truth, candidate, fmt = CASES["bf16"]()
    assert decide.decisions(truth, candidate, fmt, "logits") is not None
    truth[0, 0] = -math.inf
    assert decide.top1(truth, candidate) is None


def test_plan_measures_its_runs_as_compare_judges_them() -> None:
    """plan/metric.py reads the same implementation: every run against the same fp64 logits."""
    truth, candidate, fmt = CASES["ties at the max and the fifth place"]()
    want = plain(truth, candidate, fmt)
    floor = plan_metric.floor_of(truth, fmt)
    assert floor.top1 == want["floor_top1"] and floor.kl is not None and _close(floor.kl, want["floor_kl"])
    for _ in range(2):  # the second run reads the referee's kept rows
        m = plan_metric.measure(candidate, truth.reshape(-1)[:100], truth)
        assert m.top1 == want["top1"] and m.kl is not None and _close(m.kl, want["kl"])


def test_the_host_shortcut_and_the_device_kernels_decide_alike() -> None:
    """On the host, argmax and topk run only on the rows whose max is not at the referee's class
    alone; on a device every row goes through them. Both give argmax's and topk's answers."""
    truth, candidate, _ = CASES["ties at the max and the fifth place"]()
    best = truth.argmax(-1)
    x = torch.stack([candidate.double(), round_to(truth, "bf16")])
    kept = x.clone()
    host = decide._decided(x, best, 5)
    assert torch.equal(x, kept)  # left as it was
    device = decide._decided_by_kernels(x, best, 5)
    for a, b in zip(host, device, strict=True):
        assert torch.equal(a, b)
    assert not bool(host[1].all()) and bool(host[1].any())  # both answers occur


def test_a_referee_made_under_inference_mode_is_judged_and_not_kept() -> None:
    """An inference tensor has no write counter to tell a change by: its rows are read every call."""
    truth, candidate, fmt = CASES["bf16"]()
    want = plain(truth, candidate, fmt)
    with torch.inference_mode():
        truth = truth.clone()
        _same(decide.decisions(truth, candidate, fmt, "logits"), want)
        assert decide._KEPT.get(truth, truth.shape[0]) is None
        assert decide.top1(truth, candidate) == want["top1"]
        truth[:, 0] += 100.0  # written in place, as inference mode allows
        assert decide.top1(truth, candidate) == plain(truth, candidate, fmt)["top1"]
