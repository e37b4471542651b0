"""What the output decides, judged by the decision: compare's use metrics.

An output that holds logits feeds an argmax or a softmax. Its relative error can stay small while
the class that wins changes, when the output's norm is carried by values that take no part in the
decision (a large offset common to every class, masked classes at -1e4) or when the classes' margins
are below the candidate's spacing. So an output of logits is judged by what it decides, over its
rows (every dimension but the last): top-1 agreement with the fp64 referee, top-5 (the referee's
class among the candidate's five best) and KL(referee || candidate) of their softmax. Each beside
its floor: the same metric for the exact output rounded to the candidate's format, what any run
that returns this format loses.

Logits are told by where the output comes from: the model's last leaf call is a Linear that maps
features to classes (in_features != out_features) and its output is the model's. An encoder's
hidden states (a LayerNorm last, or a square projection) are not judged by an argmax.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.precision.inputs import describe
from fpdoctor.precision.inputs import text as inputs_text
from fpdoctor.precision.metrics import all_finite, round_to
from fpdoctor.report.model import Finding, Trial

# The candidate changes the decisions when it flips this many times the rows rounding flips (the
# rows a margin smaller than the error lets flip grow about linearly with the error: as
# DIVERGENCE_RATIO is for the error itself) ...
DECISION_RATIO = 16.0
# ... and at least this share of the rows: fewer is within what one input set can tell.
DECISION_SHARE = 0.01
TOP_K = 5


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
            f"top-1 agreement {_pct(self.top1)} (rounding the exact output: {_pct(self.floor_top1)}), top-{TOP_K} "
            f"{_pct(self.top5)}, KL {self.kl:.3g} nats ({self.floor_kl:.3g}) over {self.rows} rows of {self.classes}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%" if share < 0.999 or share == 1.0 else f"{100 * share:.2f}%"


def logits_source(name: str, module: nn.Module, output: Any) -> str | None:
    """How the report names the logits, when the last leaf call (`name`, `module`) made them."""
    if not isinstance(module, nn.Linear) or module.in_features == module.out_features or module.out_features < 2:
        return None
    if not isinstance(output, torch.Tensor) or output.dim() < 1 or output.shape[-1] != module.out_features:
        return None
    where = f"`{name}`" if name else "the model"
    return f"logits of {where} (Linear {module.in_features} -> {module.out_features})"


def decisions(truth: torch.Tensor, candidate: torch.Tensor, fmt: str, source: str) -> Decisions | None:
    """The candidate's decisions against the referee's (`truth`, fp64), and rounding's floor; None
    when the candidate's output is not finite (the non-finite findings speak for it) or has no rows."""
    rows = _rows(truth, candidate)
    if rows is None:
        return None
    ref, cand = rows
    rounded = round_to(ref, fmt)
    best = ref.argmax(-1)
    log_p = torch.log_softmax(ref, -1)
    p = log_p.exp()

    def kl(x: torch.Tensor) -> float:
        # p * (log_p - log_softmax(x)), elementwise the same operations, written into log_softmax's
        # result: two fewer temporaries of the logits' size (their first writes cost as much as the math)
        term = torch.log_softmax(x, -1)
        value = float(torch.sub(log_p, term, out=term).mul_(p).sum(-1).mean())
        return max(value, 0.0) if math.isfinite(value) else math.inf

    k = min(TOP_K, ref.shape[-1])
    top5 = float((cand.topk(k, -1).indices == best[:, None]).any(-1).double().mean())
    return Decisions(
        source=source, rows=ref.shape[0], classes=ref.shape[-1], top1=_top1(cand, best), top5=top5, kl=kl(cand),
        floor_top1=_top1(rounded, best), floor_kl=kl(rounded),
    )  # fmt: skip


def top1(truth: torch.Tensor, candidate: torch.Tensor) -> float | None:
    """decisions(...).top1 alone, for a checked run judged by its top-1 agreement (None where
    decisions is None): the rest of decisions costs as much as a forward on a large vocabulary."""
    rows = _rows(truth, candidate)
    return None if rows is None else _top1(rows[1], rows[0].argmax(-1))


def _rows(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(referee, candidate) in float64, a row per decision; None when either is not finite or empty."""
    if candidate.shape != truth.shape or not all_finite(candidate):
        return None
    ref = truth.detach().double().reshape(-1, truth.shape[-1])
    cand = candidate.detach().double().reshape(-1, truth.shape[-1])
    if ref.shape[0] == 0 or not all_finite(ref):
        return None
    return ref, cand


def _top1(x: torch.Tensor, best: torch.Tensor) -> float:
    """The share of rows whose argmax is the referee's (`best`)."""
    return float((x.argmax(-1) == best).double().mean())


# Besides the logits' own layer, the leaves with the largest error against their floor are tried kept
# in fp32, one forward each.
TRIED_LEAVES = 2
# A module kept in fp32 gives the decisions back when it leaves at most this share of the flips.
RECOVERED = 0.25


def finding(
    found: Decisions, label: str, tried: list[tuple[list[str], float]], *, head: str, inputs: Any,
    state: tuple[str, float] | None = None,
) -> Finding:  # fmt: skip
    """`decisions-changed`: what the candidate does to the decisions, and the fix, checked: the running
    states named the cause of the error, kept in fp64 (`state`: their lines and the top-1 agreement
    then), when that gives them back; else the modules kept in fp32 (`tried`: each set with the
    candidate's top-1 agreement then) that give most of them back, or that none tried is enough."""
    flipped = 1.0 - found.top1
    floor = 1.0 - found.floor_top1
    against = (
        f"{flipped / floor:.0f}x what rounding the exact output to {label} changes ({_pct(floor)})"
        if floor > 0
        else f"where rounding the exact output to {label} changes none"
    )
    message = (
        f"In {label}, the output's top-1 class differs from fp64's on {_pct(flipped)} of its {found.rows} rows, "
        f"{against}: the computation changes the decisions, however small the relative error (KL {found.kl:.3g} "
        f"nats)."
    )
    on = inputs_text(describe(inputs))

    def names(modules: list[str]) -> str:
        return " and ".join(f"`{m}`" for m in modules)

    def checked(what: str, after: str) -> Trial:
        return Trial.checked(what, metric="top-1 agreement with fp64", before=_pct(found.top1), after=after, on=on)

    best = max(tried, key=lambda t: t[1], default=None)
    if state is not None and found.recovered(state[1]):
        lines, top1 = state
        noun = "running states" if "," in lines else "running state"
        fix = (
            f"Keep the {noun} updated at {lines} in fp32, as the finding on the end-to-end error says: "
            f"the same checked run gives the decisions back, top-1 agreement {_pct(found.top1)} -> {_pct(top1)}."
        )
        trial = checked(f"the {noun} at {lines} kept in fp64, the rest in {label}", _pct(top1))
    elif best is not None and found.recovered(best[1]):
        modules, top1 = best
        output = ", returning fp32 logits" if head in modules else ""
        fix = (
            f"Keep {names(modules)} in fp32{output} (fpdoctor plan writes the code): top-1 agreement "
            f"{_pct(found.top1)} -> {_pct(top1)}."
        )
        trial = checked(f"{names(modules)} kept in fp32{output}, the rest in {label}", _pct(top1))
    elif best is not None:
        each = "; ".join(f"{names(m)} {_pct(t)}" for m, t in tried)
        fix = (
            f"No module set tried gives the decisions back in fp32 ({each}): run `fpdoctor plan` for a larger "
            f"set and check it by top-1 agreement."
        )
        trial = checked(
            "kept in fp32, one set at a time: " + "; ".join(names(m) for m, _ in tried),
            f"at best {_pct(best[1])} (not enough)",
        )
    else:
        fix = f"Keep {names([head]) if head else 'the logits layer'} in fp32, returning fp32 logits."
        trial = Trial.untried("no module of the model could be re-run in fp32 in its place")
    return catalog.make(
        "decisions-changed",
        message=message,
        fix=fix,
        where={"module": head, "op": None},
        evidence={
            "decisions": found.to_dict(),
            "kept_in_fp32_tried": [{"modules": m, "top1": t} for m, t in tried],
            **({"running_state_kept": {"locations": state[0], "top1": state[1]}} if state is not None else {}),
        },
        trial=trial,
    )
