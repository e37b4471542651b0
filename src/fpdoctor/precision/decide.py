"""What an output of logits decides, measured: top-1 and top-5 agreement with a referee and KL
against it, each beside the same metric for the referee rounded to the candidate's format.

The metrics themselves, shared by every capability that judges an output by its use: compare
(compare/use.py: which output is logits, the finding and its checked fix), plan (plan/metric.py:
a plan's target in one of them) and compare records (record/: the same figures against another
machine's referee, from what the record keeps of its rows).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor.precision.metrics import all_finite, fp8_format, round_to

# The candidate changes the decisions when it flips this many times the rows rounding flips (the
# rows a margin smaller than the error lets flip grow about linearly with the error: as
# DIVERGENCE_RATIO is for the error itself) ...
DECISION_RATIO = 16.0
# ... and at least this share of the rows: fewer is within what one input set can tell.
DECISION_SHARE = 0.01
TOP_K = 5
# A module kept in fp32 gives the decisions back when it leaves at most this share of the flips.
RECOVERED = 0.25


@dataclass
class Decisions:
    """Top-1, top-5 and KL of the candidate's output and of the exact output rounded to its format."""

    source: str  # where the logits come from, as the report names it
    rows: int
    classes: int
    top1: float  # share of rows whose argmax is the referee's
    top5: float  # share of rows whose referee argmax is among the candidate's TOP_K best
    kl: float  # mean KL(referee || candidate) per row, nats
    floor_top1: float
    floor_kl: float

    @property
    def changed(self) -> bool:
        """The candidate's computation changes far more decisions than rounding its output does."""
        flipped, floor = 1.0 - self.top1, max(1.0 - self.floor_top1, 1.0 / self.rows)
        return flipped >= DECISION_SHARE and flipped >= DECISION_RATIO * floor

    def recovered(self, top1: float) -> bool:
        """A run whose top-1 agreement is `top1` gives the decisions back: RECOVERED of the flips at most."""
        return 1.0 - top1 <= RECOVERED * (1.0 - self.top1)

    def text(self) -> str:
        return (
            f"top-1 agreement {pct(self.top1)} (rounding the exact output: {pct(self.floor_top1)}), top-{TOP_K} "
            f"{pct(self.top5)}, KL {self.kl:.3g} nats ({self.floor_kl:.3g}) over {self.rows} rows of {self.classes}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pct(share: float) -> str:
    """A share of rows as the reports print it: one decimal, two near 100%."""
    return f"{100 * share:.1f}%" if share < 0.999 or share == 1.0 else f"{100 * share:.2f}%"


def decisions(truth: torch.Tensor, candidate: torch.Tensor, fmt: str, source: str) -> Decisions | None:
    """The candidate's decisions against the referee's (`truth`, fp64), and rounding's floor; None
    when the candidate's output is not finite (the non-finite findings speak for it) or has no rows.
    Rows at a time (CHUNK logits): the fp64 temporaries stay a few MiB whatever the vocabulary and
    the batch (an LM's 4096 x 50,000 logits are 1.6 GB in fp64), and stay in cache between passes."""
    rows = logit_rows(truth, candidate)
    if rows is None:
        return None
    ref, cand = rows
    n, classes = ref.shape
    k = min(TOP_K, classes)
    amax = ref.abs().amax() if fp8_format(fmt) is not None else None  # an fp8 scale is the whole output's
    sums = torch.zeros(5, dtype=torch.float64, device=ref.device)
    for r, chunk in _chunks(ref, cand):
        c = chunk.to(torch.float64)  # once: argmax and top-k on a bf16 tensor are several times slower here
        best = r.argmax(-1)
        log_p, p = _log_softmax_and_p(r)
        rounded = round_to(r, fmt, amax)
        sums += torch.stack(
            [
                (c.argmax(-1) == best).sum(),
                (c.topk(k, -1).indices == best[:, None]).any(-1).sum(),
                _kl_sum(log_p, p, c),
                (rounded.argmax(-1) == best).sum(),
                _kl_sum(log_p, p, rounded),
            ]
        )
    top1, top5, kl_, floor_top1, floor_kl = (sums / n).tolist()  # one host read
    return Decisions(
        source=source, rows=n, classes=classes, top1=top1, top5=top5, kl=_nonnegative(kl_),
        floor_top1=floor_top1, floor_kl=_nonnegative(floor_kl),
    )  # fmt: skip


def top1(truth: torch.Tensor, candidate: torch.Tensor) -> float | None:
    """decisions(...).top1 alone, for a checked run judged by its top-1 agreement (None where
    decisions is None): the rest of decisions costs as much as a forward on a large vocabulary."""
    rows = logit_rows(truth, candidate)
    return None if rows is None else agreement(rows[1], rows[0].argmax(-1))


def kl(truth: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean KL(softmax(truth) || softmax(candidate)) per row, nats: rows of logits, both finite."""
    truth = truth.reshape(-1, truth.shape[-1])
    candidate = candidate.to(truth.device).reshape(-1, truth.shape[-1])
    total = torch.zeros((), dtype=torch.float64, device=truth.device)
    for r, c in _chunks(truth, candidate):
        log_p, p = _log_softmax_and_p(r.double())
        total += _kl_sum(log_p, p, c)
    return _nonnegative(float(total) / max(truth.shape[0], 1))


# logits per chunk: each fp64 temporary 512 KiB, within a core's cache between the passes
CHUNK = 2**16


def _chunks(ref: torch.Tensor, cand: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    step = max(1, CHUNK // max(ref.shape[-1], 1))
    for start in range(0, ref.shape[0], step):
        yield ref[start : start + step], cand[start : start + step]


def _log_softmax_and_p(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log_softmax(r) and softmax(r) with one exp: softmax from the shifted exponentials, their
    log from the row's log-sum-exp (log_softmax then exp would take two)."""
    top = r.amax(-1, keepdim=True)
    p = torch.sub(r, top).exp_()
    total = p.sum(-1, keepdim=True)
    log_p = r - total.log().add_(top)
    return log_p, p.div_(total)


def _kl_sum(log_p: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Sum over rows of KL(p || softmax(x)), fp64, on the device. p * (log_p - log_softmax(x)),
    written into log_softmax's result: one temporary of the chunk's size."""
    term = torch.log_softmax(x.to(torch.float64), -1)
    return torch.sub(log_p, term, out=term).mul_(p).sum()


def _nonnegative(value: float) -> float:
    return max(value, 0.0) if math.isfinite(value) else math.inf


def logit_rows(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(referee in float64, candidate at its own dtype, exact for argmax and top-k) on the referee's
    device (a CUDA candidate's output is judged against a referee that may have run on the host), a
    row per decision; None when either is not finite or empty."""
    if candidate.shape != truth.shape or not all_finite(candidate):
        return None
    ref = truth.detach().double().reshape(-1, truth.shape[-1])
    cand = candidate.detach().to(ref.device).reshape(-1, truth.shape[-1])
    if not cand.is_floating_point():
        cand = cand.double()
    if ref.shape[0] == 0 or not all_finite(ref):
        return None
    return ref, cand


def agreement(x: torch.Tensor, best: torch.Tensor) -> float:
    """The share of rows whose argmax is the referee's (`best`)."""
    return float((x.argmax(-1) == best).double().mean())
