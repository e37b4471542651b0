"""What a plan targets: the output's relative error, or the decisions an output of logits feeds.

`rel`:  the end-to-end relative L2 error of the output against fp64 (the metric compare ranks by).
`top1`: the share of rows (every dimension of the logits but the last) whose top-1 class differs
        from fp64's; shown as top-1 agreement.
`kl`:   the mean over rows of KL(fp64 || candidate) of the softmax, in nats.

The default is `kl` where the output is logits (compare's own detection, compare/use.py) and
compare finds their decisions changed far beyond rounding's floor (`decisions-changed`): there the
relative error misses what the decisions show. KL rather than top-1, because
- it is continuous: every module's what-if moves it, so the ranking separates modules that leave
  the same number of flips, and it works on few rows (top-1 over a prompt of 8 tokens moves in
  steps of 12.5%, and a module that halves every margin's error changes no flip until it does);
- it reads the whole distribution that sampling, beam search, top-k and the loss read, where
  top-1 reads the argmax alone.
Top-1 agreement is measured beside it on every run the plan makes, and `top1` targets it.
Elsewhere the default stays `rel`: where the decisions are not changed the two agree, and the
structural test for logits (a last Linear from features to classes) also takes a regression head
of that shape (a denoiser's noise prediction), whose softmax means nothing. A tolerance given
without a metric is a relative error, as it always was.

Floors and targets follow compare's rules. The floor is the metric of the exact output rounded to
the candidate's format, or of the reference run where that is larger; the target is
DECISION_RATIO times the floor, to the metric's power: the rows a margin smaller than the error
lets flip grow about linearly with the output's error, KL with its square (a logit error e costs
about e^2/2 times the softmax's variance), so 16x the error is 256x the KL floor. For `top1` the
target is compare's `decisions-changed` rule itself: a plan within it is one compare would not
call changed. A tolerance, when given, is in the metric's units (a share of rows for `top1`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fpdoctor.precision import decide
from fpdoctor.precision.compare import use
from fpdoctor.precision.metrics import flat_sample, floating, rel_error, round_to
from fpdoctor.precision.profile import DIVERGENCE_RATIO

METRICS = ("kl", "top1", "rel")
# A KL below this is no target to chase: 1e-6 nats moves a probability of 0.5 by about 7e-4.
KL_MIN = 1e-6
_FAILED = "none (the run failed or made NaN/Inf)"


@dataclass(frozen=True)
class Measured:
    """One run of the model with a plan (or none), judged every way: the plan targets one of them."""

    rel: float
    top1: float | None = None  # top-1 agreement with fp64; None: not logits, or not finite
    kl: float | None = None

    def text(self) -> str:
        parts = [f"top-1 agreement {pct(self.top1)}"] if self.top1 is not None else []
        parts += [f"KL {self.kl:.3g} nats"] if self.kl is not None else []
        return ", ".join([*parts, f"relative error {_num(self.rel)}"])


@dataclass(frozen=True)
class Metric:
    name: str
    power: int  # how the metric grows with the output's error: 1 linearly, 2 with its square

    @property
    def decisions(self) -> bool:
        return self.name != "rel"

    @property
    def title(self) -> str:
        """What a trial measured, as Trial.metric says it."""
        return {
            "rel": "end-to-end relative error against fp64",
            "top1": "top-1 agreement with fp64",
            "kl": "KL(fp64 || candidate) of the softmax, nats per row",
        }[self.name]

    @property
    def describe(self) -> str:
        return {
            "rel": "relative L2 error of the output against fp64 (--metric rel)",
            "top1": "top-1 agreement of the logits with fp64's, over their rows (--metric top1)",
            "kl": "KL(fp64 || candidate) of the logits' softmax, mean over their rows, nats (--metric kl)",
        }[self.name]

    def value(self, m: Measured) -> float:
        """The figure the search minimises: lower is better, 0 is fp64's."""
        if self.name == "rel":
            return m.rel
        if self.name == "top1":
            return math.inf if m.top1 is None else 1.0 - m.top1
        return math.inf if m.kl is None else m.kl

    def figure(self, value: float) -> float | str:
        """A value as a trial's before/after: top-1 as the agreement."""
        return pct(1.0 - value) if self.name == "top1" and math.isfinite(value) else value

    def show(self, value: float) -> str:
        """A value as the report says it: 'top-1 agreement 99.8%', 'KL 1.2e-06 nats', 'error 0.0016'."""
        if self.name == "top1":
            return "top-1 agreement " + (pct(1.0 - value) if math.isfinite(value) else _FAILED)
        if self.name == "kl":
            return f"KL {value:.3g} nats" if math.isfinite(value) else f"KL {_FAILED}"
        return f"end-to-end error {_num(value)}"

    def bound(self, target: float) -> str:
        """A target as the report says it."""
        if self.name == "top1":
            return f"top-1 agreement >= {pct(1.0 - target)}"
        if self.name == "kl":
            return f"KL <= {target:.3g} nats"
        return f"{target:.3g}"

    def target(self, floor: float, rows: int) -> float:
        """The default target over the output's floor (rounding it, or the reference's run)."""
        if self.name == "top1":  # compare's decisions-changed rule (decide.py): 16x the floor, and no more
            # than a quarter of the rows above it (on 32 rows 16x a floor of one row would let half of them flip)
            least = max(floor, 1.0 / max(rows, 1))
            return max(use.DECISION_SHARE, min(use.DECISION_RATIO * least, least + decide.DECISION_MORE))
        if self.name == "kl":
            return max(KL_MIN, DIVERGENCE_RATIO**2 * floor)
        return DIVERGENCE_RATIO * floor


def metric(name: str) -> Metric:
    if name not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {name!r}")
    return Metric(name, 2 if name == "kl" else 1)


def check_tolerance(m: Metric, tolerance: float | None) -> None:
    if tolerance is None:
        return
    if m.name == "top1" and not 0 < tolerance < 1:
        raise ValueError(
            f"with --metric top1 the tolerance is the share of rows whose top-1 may differ from fp64's, between 0 "
            f"and 1 (e.g. 0.01), got {tolerance!r}"
        )
    if not tolerance > 0:
        what = "a KL in nats, e.g. 1e-4" if m.name == "kl" else "a positive relative error, e.g. 1e-3"
        raise ValueError(f"tolerance must be {what}, got {tolerance!r}")


def logits_of(output: Any) -> torch.Tensor | None:
    """The output's logits as [rows, classes] float64 on the CPU (the first floating tensor, whole)."""
    first = next(floating(output), None)
    if first is None or first.dim() < 1:
        return None
    return first.detach().to(device="cpu", dtype=torch.float64).reshape(-1, first.shape[-1])


def measure(output: Any, truth: torch.Tensor, logits: torch.Tensor | None) -> Measured:
    """A run's output against the fp64 sample `truth` and, for logits, the fp64 logits whole: the
    same tensor for every run of a plan, whose rows decide.py reads once for all of them."""
    out = flat_sample(output)
    rel = math.inf if out is None or out.numel() != truth.numel() else rel_error(out, truth)
    if logits is None:
        return Measured(rel)
    cand = logits_of(output)
    judged = None if cand is None else decide.top1_and_kl(logits, cand)
    return Measured(rel) if judged is None else Measured(rel, *judged)


def floor_of(logits: torch.Tensor, fmt: str) -> Measured:
    """What rounding the exact output to the candidate's format costs, every way."""
    floor = decide.rounding_floor(logits, fmt)
    rel = rel_error(round_to(logits, fmt).reshape(-1), logits.reshape(-1))
    return Measured(rel) if floor is None else Measured(rel, *floor)


def pct(share: float | None) -> str:
    if share is None:
        return "n/a"
    return f"{100 * share:.1f}%" if share < 0.999 or share == 1.0 else f"{100 * share:.2f}%"


def _num(value: float) -> str:
    return "non-finite" if math.isinf(value) else f"{value:.3g}"
