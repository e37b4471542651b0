"""What an output of logits decides, measured: top-1 and top-5 agreement with a referee and KL
against it, each beside the same metric for the referee rounded to the candidate's format.

The metrics themselves, shared by every capability that judges an output by its use: compare
(compare/use.py: which output is logits, the finding and its checked fix), plan (plan/metric.py:
a plan's target in one of them) and compare records (record/: the same figures against another
machine's referee, from what the record keeps of its rows).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor.precision.metrics import all_finite, round_to

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
    when the candidate's output is not finite (the non-finite findings speak for it) or has no rows."""
    rows = logit_rows(truth, candidate)
    if rows is None:
        return None
    ref, cand = rows
    rounded = round_to(ref, fmt)
    best = ref.argmax(-1)
    log_p = torch.log_softmax(ref, -1)
    p = log_p.exp()
    k = min(TOP_K, ref.shape[-1])
    top5 = float((cand.topk(k, -1).indices == best[:, None]).any(-1).double().mean())
    return Decisions(
        source=source, rows=ref.shape[0], classes=ref.shape[-1], top1=agreement(cand, best), top5=top5,
        kl=_kl(log_p, p, cand), floor_top1=agreement(rounded, best), floor_kl=_kl(log_p, p, rounded),
    )  # fmt: skip


def top1(truth: torch.Tensor, candidate: torch.Tensor) -> float | None:
    """decisions(...).top1 alone, for a checked run judged by its top-1 agreement (None where
    decisions is None): the rest of decisions costs as much as a forward on a large vocabulary."""
    rows = logit_rows(truth, candidate)
    return None if rows is None else agreement(rows[1], rows[0].argmax(-1))


def kl(truth: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean KL(softmax(truth) || softmax(candidate)) per row, nats: rows of logits, both finite."""
    log_p = torch.log_softmax(truth.double(), -1)
    return _kl(log_p, log_p.exp(), candidate.to(log_p.device, torch.float64))


def _kl(log_p: torch.Tensor, p: torch.Tensor, x: torch.Tensor) -> float:
    # p * (log_p - log_softmax(x)), elementwise the same operations, written into log_softmax's
    # result: two fewer temporaries of the logits' size (their first writes cost as much as the math)
    term = torch.log_softmax(x, -1)
    value = float(torch.sub(log_p, term, out=term).mul_(p).sum(-1).mean())
    return max(value, 0.0) if math.isfinite(value) else math.inf


def logit_rows(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(referee, candidate) in float64 on the referee's device (a CUDA candidate's output is judged
    against a referee that may have run on the host), a row per decision; None when either is not
    finite or empty."""
    if candidate.shape != truth.shape or not all_finite(candidate):
        return None
    ref = truth.detach().double().reshape(-1, truth.shape[-1])
    cand = candidate.detach().to(ref.device, torch.float64).reshape(-1, truth.shape[-1])
    if ref.shape[0] == 0 or not all_finite(ref):
        return None
    return ref, cand


def agreement(x: torch.Tensor, best: torch.Tensor) -> float:
    """The share of rows whose argmax is the referee's (`best`)."""
    return float((x.argmax(-1) == best).double().mean())
