"""What an output of logits decides, measured: top-1 and top-5 agreement with a referee and KL
against it, each beside the same metric for the referee rounded to the candidate's format.

The metrics themselves, shared by every capability that judges an output by its use: compare
(compare/use.py: which output is logits, the finding and its checked fix), plan (plan/metric.py:
a plan's target in one of them) and compare records (record/: the same figures against another
machine's referee, from what the record keeps of its rows).

How they are computed, each figure the one fp64 log-softmax, argmax and topk over the whole logits
give (tests/precision/test_use_metrics_reference.py):
- rows at a time (CHUNK logits), into fp64 buffers reused chunk after chunk: a few MiB whatever the
  vocabulary and the batch, where an LM's 4096 x 50,000 logits are 1.6 GB in fp64;
- what depends on the referee alone, each row's class and log-sum-exp, once per referee tensor,
  kept for the calls that follow on it (compare's checked runs, plan's runs; `_Kept`);
- KL per row as lse(x) - lse(r) - sum p (x - r): one exponential pass per judged tensor, and one
  for the referee's probabilities, where log-softmax and a product of its size took two;
- on the host, a row whose max is at the referee's class and nowhere else agrees on top-1 and
  top-5, as two max reductions tell; argmax and topk (scalar loops) run on the other rows only.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from fpdoctor.precision.candidates import compute_dtype
from fpdoctor.precision.metrics import all_finite, fp8_format, round_to

# The candidate changes the decisions when it flips this many times the rows rounding flips (the
# rows a margin smaller than the error lets flip grow about linearly with the error: as
# DIVERGENCE_RATIO is for the error itself) ...
DECISION_RATIO = 16.0
# ... and at least this share of the rows: fewer is within what one input set can tell. Where rounding
# alone flips many rows, the flips cannot grow 16x (there are not that many rows): this share of all
# the rows more than rounding flips is the computation's too.
DECISION_SHARE = 0.01
DECISION_MORE = 0.25
DECISION_MORE_ROWS = 8  # ... in this many rows at least: 1 of 2 rows is no evidence
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
    floor_format: str = ""  # the format the floor rounds the exact output to (an fp8 candidate's: what it returns)
    # "ids": the output is the decisions themselves (token ids a decoding loop made, each an argmax fed
    # back): rows are its sequences, classes its positions, top1 the share of ids equal to the referee's,
    # floor_top1 the reference model's share, `first` the median first position where a row differs
    kind: str = "logits"
    first: int | None = None

    @property
    def changed(self) -> bool:
        """The candidate's computation changes far more decisions than rounding its output does."""
        return self._changes(self.top1)

    def _changes(self, top1: float, floor_top1: float | None = None) -> bool:
        """A run of top-1 agreement `top1` changes far more decisions than rounding the output does
        (`floor_top1`: that rounding's agreement where the run returns another format, fp32 logits)."""
        n = self.rows * self.classes if self.kind == "ids" else self.rows  # ids: each value is a decision
        kept = self.floor_top1 if floor_top1 is None else floor_top1
        flipped, floor = 1.0 - top1, max(1.0 - kept, 1.0 / n)
        more = flipped >= floor + DECISION_MORE and flipped * n >= DECISION_MORE_ROWS
        return flipped >= DECISION_SHARE and (flipped >= DECISION_RATIO * floor or more)

    def recovered(self, top1: float, floor_top1: float | None = None) -> bool:
        """A run whose top-1 agreement is `top1` gives the decisions back: RECOVERED of the flips at most,
        and no more than the decisions rule allows (38.9% -> 87.4% gives most back, and still changes 12.6%),
        against `floor_top1` where the run returns its output in another format than the candidate's."""
        return 1.0 - top1 <= RECOVERED * (1.0 - self.top1) and not self._changes(top1, floor_top1)

    def text(self) -> str:
        if self.kind == "ids":
            where = f", the first difference at position {self.first} (median)" if self.first is not None else ""
            return (
                f"ids equal to fp64's {pct(self.top1)} (the reference model's: {pct(self.floor_top1)}) over "
                f"{self.rows} rows of {self.classes}{where}"
            )
        top5 = f", top-{TOP_K} {pct(self.top5)}" if self.classes > TOP_K else ""  # of fewer classes: always 100%
        return (
            f"top-1 agreement {pct(self.top1)} (rounding the exact output: {pct(self.floor_top1)}){top5}, KL "
            f"{self.kl:.3g} nats ({self.floor_kl:.3g}) over {self.rows} rows of {self.classes}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pct(share: float) -> str:
    """A share of rows as the reports print it: one decimal, two near 100%."""
    return f"{100 * share:.1f}%" if share < 0.999 or share == 1.0 else f"{100 * share:.2f}%"


def decisions(truth: torch.Tensor, candidate: torch.Tensor, fmt: str, source: str) -> Decisions | None:
    """The candidate's decisions against the referee's (`truth`, fp64), and rounding's floor; None
    when the candidate's output is not finite (the non-finite findings speak for it) or has no rows."""
    rows = _as_rows(truth, candidate)
    if rows is None:
        return None
    ref, cand = rows
    n, classes = ref.shape
    amax = _largest(ref) if fp8_format(fmt) is not None else None  # an fp8 scale is the whole output's
    referee, known = _referee(truth, ref)
    # the candidate and the exact output rounded to its format, judged side by side, chunk by chunk
    work = _Work(ref, judged=2)
    sums = torch.zeros(2, 3, dtype=torch.float64, device=ref.device)
    for at, r, c in _chunks(ref, cand):
        sums += work.judge(r, [c, _rounded(r, fmt, amax)], referee, at, fill=not known, k=min(TOP_K, classes))
    (top1_, top5_, kl_sum), (floor_top1, _, floor_kl) = (sums / n).tolist()  # one host read
    # a NaN or Inf in either makes the candidate's KL NaN or Inf (see _Work.judge), where finite
    # logits cannot: whether they are finite is read only then, not by two passes of its own
    if not math.isfinite(kl_sum) and not (all_finite(cand) and all_finite(ref)):
        return None
    if not known:
        _KEPT.put(truth, referee)
    return Decisions(
        source=source, rows=n, classes=classes, top1=top1_, top5=top5_, kl=_nonnegative(kl_sum),
        floor_top1=floor_top1, floor_kl=_nonnegative(floor_kl), floor_format=fmt,
    )  # fmt: skip


# A masked output's kept sets change when this share of what a row keeps moves in or out, on average. Its
# floor (the exact output rounded after the mask) moves none by construction: the filter's inputs rounded
# move some in any format, which this share leaves room for (a hand-written sparsemax in bf16 moves 1.2%).
KEPT_MOVED = 0.02
# An entry of decided scores at or below this is masked: -inf in logits a filter masked, log 0 of a
# probability a filter zeroed (compare takes the log of a distribution, clamped at 1e-300: -690).
MASKED = -600.0
MASKED_LOGIT = -1e4  # what compare decides a masked output's -inf logit as: below MASKED, exp() of it 0


@dataclass
class Kept:
    """The entries a masked output keeps (a top-p or top-k filter's distribution, logits set to -inf
    outside the allowed tokens), against the referee's: each row's kept set is a decision of which
    entries may be chosen at all."""

    rows: int
    changed: float  # share of rows whose kept set differs from the referee's
    floor: float  # the same for the referee rounded to the candidate's format
    more: float  # entries the candidate keeps beyond the referee's, per row (negative: fewer)
    flips: float  # entries kept by one and masked by the other, per row
    kept: float  # entries the referee keeps, per row

    @property
    def differs(self) -> bool:
        """The candidate changes the kept sets far beyond what rounding its output does (as top-1), by
        KEPT_MOVED of what each row keeps at least: a nucleus of 14,000 tokens that gains 26 of the
        smallest is the same sampler."""
        floor = max(self.floor, 1.0 / self.rows)
        more = self.changed >= floor + DECISION_MORE and self.changed * self.rows >= DECISION_MORE_ROWS
        rows = self.changed >= DECISION_SHARE and (self.changed >= DECISION_RATIO * floor or more)
        return rows and self.flips >= KEPT_MOVED * self.kept

    def text(self) -> str:
        side = "more" if self.more >= 0 else "fewer"
        return (
            f"the entries it keeps (the rest masked: 0 or -inf) differ from fp64's in {pct(self.changed)} of "
            f"{self.rows} rows (rounding the exact output after the mask: {pct(self.floor)}; what the mask is "
            f"computed from, rounded, may move some itself): of the {self.kept:.1f} fp64 keeps per "
            f"row on average, {self.flips:.1f} kept by one and not the other "
            f"({pct(self.flips / max(self.kept, 1.0))}), "
            f"{abs(self.more):.1f} {side} kept"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kept(truth: torch.Tensor, candidate: torch.Tensor, rounded: torch.Tensor) -> Kept | None:
    """The kept sets of decided scores (`truth`, the candidate's, and the referee rounded to the
    candidate's format, each as compare decides them: log-probabilities or logits) where the referee
    masks entries in some rows and keeps several in most; None for an output that masks nothing."""
    rows = _as_rows(truth, candidate)
    floor = _as_rows(truth, rounded)
    if rows is None or floor is None:
        return None
    ref, cand = rows
    masked = ref <= MASKED
    kept_ref = (~masked).sum(-1)
    # a filter's output: entries masked in most rows, and more than one kept (an argmax's one-hot is a top-1)
    if (
        not bool(masked.any())
        or float((kept_ref > 1).double().mean()) < 0.5
        or float(masked.any(-1).double().mean()) < 0.5
    ):
        return None
    flips = masked != (cand <= MASKED)
    floor_flips = masked != (floor[1] <= MASKED)
    return Kept(
        rows=ref.shape[0], changed=float(flips.any(-1).double().mean()),
        floor=float(floor_flips.any(-1).double().mean()),
        more=float(((cand > MASKED).sum(-1) - kept_ref).double().mean()), flips=float(flips.sum(-1).double().mean()),
        kept=float(kept_ref.double().mean()),
    )  # fmt: skip


def id_decisions(truth: torch.Tensor, candidate: torch.Tensor, reference: float, source: str) -> Decisions | None:
    """Decisions of an output of ids (integers): the share of ids equal to the referee's `truth`, the
    reference model's share beside it (`reference`); None where the shapes differ."""
    agreed = ids_agree(truth, candidate)
    if agreed is None:
        return None
    rows = truth.reshape(truth.shape[0] if truth.dim() > 1 else 1, -1)
    differs = (rows != candidate.to(rows.device).reshape(rows.shape)).cpu()
    firsts = [int(row.nonzero()[0]) for row in differs if bool(row.any())]
    first = sorted(firsts)[len(firsts) // 2] if firsts else None
    return Decisions(source, rows.shape[0], rows.shape[1], agreed, agreed, math.nan, reference, math.nan,
                     kind="ids", first=first)  # fmt: skip


def ids_agree(truth: torch.Tensor, candidate: torch.Tensor) -> float | None:
    """The share of a candidate's ids equal to the referee's; None where the shapes differ."""
    if candidate.shape != truth.shape or truth.numel() == 0:
        return None
    return float((truth == candidate.to(truth.device)).double().mean())


def top1(truth: torch.Tensor, candidate: torch.Tensor) -> float | None:
    """decisions(...).top1 alone, for a checked run judged by its top-1 agreement (None where
    decisions is None): against the referee's classes that decisions kept for its tensor."""
    judged = _judged(truth, candidate, kl=False)
    return None if judged is None else judged[0]


def top1_and_kl(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float] | None:
    """decisions(...).top1 and .kl without top-5 and the floor, for a plan's run judged by its
    logits (None where decisions is None)."""
    return _judged(truth, candidate, kl=True)


def rounding_floor(truth: torch.Tensor, fmt: str) -> tuple[float, float] | None:
    """(decisions(...).floor_top1, .floor_kl): what rounding the referee to `fmt` costs, alone
    (None where the referee is not finite or has no rows). A rounded value may overflow the format
    (fp16's 65504): its row's KL is then inf, as decisions' floor says."""
    rows = _as_rows(truth, truth)
    if rows is None:
        return None
    ref = rows[0]
    referee, known = _referee(truth, ref)
    if not known and not all_finite(ref):  # a referee kept was finite
        return None
    amax = _largest(ref) if fp8_format(fmt) is not None else None
    work = _Work(ref, judged=1)
    sums = torch.zeros(3, dtype=torch.float64, device=ref.device)
    for at, r, _ in _chunks(ref, ref):
        sums += work.judge(r, [_rounded(r, fmt, amax)], referee, at, fill=not known, k=None)[0]
    if not known:
        _KEPT.put(truth, referee)
    agreed, _, kl_sum = (sums / ref.shape[0]).tolist()  # one host read
    return agreed, _nonnegative(kl_sum)


def kl(truth: torch.Tensor, candidate: torch.Tensor) -> float:
    """Mean KL(softmax(truth) || softmax(candidate)) per row, nats: rows of logits, both finite."""
    ref = truth.detach().double().reshape(-1, truth.shape[-1])
    cand = candidate.detach().to(ref.device).reshape(-1, truth.shape[-1])
    referee, work = _Referee.empty(ref), _Work(ref, judged=1)
    total = torch.zeros((), dtype=torch.float64, device=ref.device)
    for at, r, c in _chunks(ref, cand):
        total += work.judge(r, [c], referee, at, fill=True, k=None, decide=False)[0, 2]
    return _nonnegative(float(total) / max(ref.shape[0], 1))


def _judged(truth: torch.Tensor, candidate: torch.Tensor, *, kl: bool) -> tuple[float, float] | None:
    """(top-1 agreement, mean KL per row, nan unless `kl`) against the referee, or None."""
    rows = _as_rows(truth, candidate)
    if rows is None or not all_finite(rows[1]):
        return None
    ref, cand = rows
    referee, known = _referee(truth, ref)
    if not known and not all_finite(ref):  # a referee kept was finite
        return None
    # top-1 alone against kept rows compares the candidate with itself only: fp32 holds every value
    # of a candidate of 32 bits or fewer, in half the bytes
    narrow = known and not kl and cand.dtype.is_floating_point and cand.dtype.itemsize <= 4
    work = _Work(ref, judged=1, dtype=torch.float32 if narrow else torch.float64)
    sums = torch.zeros(3, dtype=torch.float64, device=ref.device)
    for at, r, c in _chunks(ref, cand):
        sums += work.judge(r, [c], referee, at, fill=not known, k=None, kl=kl or not known)[0]
    if not known:
        _KEPT.put(truth, referee)
    agreed, _, kl_sum = (sums / ref.shape[0]).tolist()  # one host read
    return agreed, (_nonnegative(kl_sum) if kl else math.nan)


# logits per chunk: the buffers hold three to five times this in fp64, 3-5 MiB. Smaller chunks
# spend more in the ops' own overhead than in their arithmetic (1.4-1.5x the time at 2^15, one
# thread, vocabularies of 512 and 8192); 2^18 is no faster
CHUNK = 2**17
# exp(y) as exp2(y * LOG2E): torch's fp64 exp2 takes half the time of its exp on the host (AVX-512,
# torch 2.13). The product's rounding moves exp(y) by |y| * 2^-53 relative, 4e-15 at y = -40,
# below which a term adds less than 5e-18 of its row's sum.
LOG2E = 1.0 / math.log(2.0)


def _largest(ref: torch.Tensor) -> torch.Tensor:
    """max |ref| without a copy of |ref|."""
    low, high = torch.aminmax(ref)
    return torch.maximum(-low, high)


def _rounded(r: torch.Tensor, fmt: str, amax: torch.Tensor | None) -> torch.Tensor:
    """round_to(r, fmt, amax)'s values; outside fp8, in the format's own dtype (the copy into the
    judged buffer is the cast back: one pass less)."""
    return round_to(r, fmt, amax) if fp8_format(fmt) is not None else r.to(compute_dtype(fmt))


def _chunks(ref: torch.Tensor, cand: torch.Tensor) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    step = _rows_per_chunk(ref)
    for start in range(0, ref.shape[0], step):
        at = slice(start, start + step)
        yield at, ref[at], cand[at]


def _rows_per_chunk(ref: torch.Tensor) -> int:
    return max(1, CHUNK // max(ref.shape[-1], 1))


@dataclass(frozen=True)
class _Referee:
    """What the metrics read of the referee alone, per row: computed by the first call that reads
    its rows (decisions, in compare), kept for the others (each checked run's top-1, plan's runs)."""

    best: torch.Tensor  # [rows] int64: the referee's class, its argmax (the first of tied maxima)
    lse: torch.Tensor  # [rows] float64: log(sum(exp(row)))

    @staticmethod
    def empty(ref: torch.Tensor) -> _Referee:
        n = ref.shape[0]
        return _Referee(
            torch.empty(n, dtype=torch.int64, device=ref.device),
            torch.empty(n, dtype=torch.float64, device=ref.device),
        )


class _Kept:
    """The last referee's rows while its tensor lives and is not written to: a weak reference to
    it, its in-place write counter, the rows. compare's referee is one tensor, read by decisions
    and then by the top-1 of each checked run; plan's is read by every run it judges. A row's two
    numbers are all that is kept: nothing the size of the logits outlives the call that made it."""

    def __init__(self) -> None:
        self.entry: tuple[weakref.ref[torch.Tensor], int, _Referee] | None = None

    def get(self, truth: torch.Tensor, rows: int) -> _Referee | None:
        if self.entry is None or truth.is_inference():
            return None
        held, version, referee = self.entry
        same = held() is truth and truth._version == version and referee.best.shape[0] == rows
        return referee if same else None

    def put(self, truth: torch.Tensor, referee: _Referee) -> None:
        if truth.is_inference():  # made under torch.inference_mode: no write counter to tell a change by
            return
        self.entry = (weakref.ref(truth, self._drop), truth._version, referee)

    def _drop(self, held: weakref.ref[torch.Tensor]) -> None:
        if self.entry is not None and self.entry[0] is held:
            self.entry = None


_KEPT = _Kept()


def _referee(truth: torch.Tensor, ref: torch.Tensor) -> tuple[_Referee, bool]:
    """The referee's rows kept for `truth`, and True; or empty ones for the caller to fill, and False."""
    kept = _KEPT.get(truth, ref.shape[0])
    return (kept, True) if kept is not None else (_Referee.empty(ref), False)


class _Work:
    """A chunk's fp64 buffers, reused by every chunk: the logits judged (then their difference from
    the referee's), and the exponentials of each and of the referee."""

    def __init__(self, ref: torch.Tensor, *, judged: int, dtype: torch.dtype = torch.float64) -> None:
        size = min(ref.shape[0], _rows_per_chunk(ref)) * ref.shape[-1]
        self.x = torch.empty(judged * size, dtype=dtype, device=ref.device)
        self.e = torch.empty((judged + 1) * size, dtype=torch.float64, device=ref.device)

    def judge(
        self, r: torch.Tensor, judged: list[torch.Tensor], referee: _Referee, at: slice, *, fill: bool,
        k: int | None, kl: bool = True, decide: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Per block of `judged` logits (the chunk's rows `at`): [rows whose argmax is the referee's,
        rows whose topk(k) holds it (0 without k), the sum of the rows' KL(referee || block) (0
        without kl)], fp64 on the device. `fill`: the referee's rows are computed here, else read.

        KL per row as sum p (log p - log q) = lse(x) - lse(r) - sum p (x - r): one exponential
        pass over the block, none over a log-softmax of its size; the error is the log-softmax
        difference's, |row max| * 2^-53 and the exponential's ulp."""
        b, (n, classes) = len(judged), r.shape
        # exact copies (fp64 holds every narrower float); the KL's ops then take one dtype
        # throughout, as a mixed-dtype op casts its operands into copies of their own first
        x = self.x[: b * n * classes].view(b, n, classes)
        for block, logits in zip(x, judged, strict=True):
            block.copy_(logits)
        if fill:
            shift, best = r.max(-1)  # the first index of each row's max, as argmax gives it
            referee.best[at] = best
        else:
            shift, best = referee.lse[at], referee.best[at]
        if decide:
            top, top1, topk = _decided(x, best, k)
        else:
            top, top1 = x.amax(-1), torch.zeros(b, n, dtype=torch.bool, device=r.device)
            topk = top1
        if not kl:
            return torch.stack([_count(top1), _count(topk), torch.zeros(b, dtype=torch.float64, device=r.device)], -1)
        e = self.e[: (b + 1) * n * classes].view(b + 1, n, classes)
        torch.sub(x, top[..., None], out=e[:b])
        torch.sub(r, shift[:, None], out=e[b])
        total = e.mul_(LOG2E).exp2_().sum(-1)  # [b + 1, n]
        lse = total.log()  # each row's log-sum-exp, less its shift
        lse[:b] += top
        lse[b] += shift
        if fill:
            referee.lse[at] = lse[b]
        # sum p (x - r) per row, p the referee's exponentials over their sum
        moved = torch.sub(x, r, out=e[:b]).mul_(e[b]).sum(-1).div_(total[b])
        kl_ = (lse[:b] - lse[b]).sub_(moved).sum(-1)
        return torch.stack([_count(top1), _count(topk), kl_], -1)


def _count(rows: torch.Tensor) -> torch.Tensor:
    return rows.sum(-1, dtype=torch.float64)


def _decided(x: torch.Tensor, best: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each row's max, whether its argmax is `best`, whether `best` is among its topk(k) indices;
    False without k) for x [blocks, rows, classes]: argmax and topk's own answers, ties included.
    On the host, a row whose max is at `best` and nowhere else agrees on both, as two vectorised max
    reductions tell; argmax and topk (scalar loops, 5-10x their time) run on the other rows only,
    a reading of the host for the rows' indices. x is left as it was."""
    if x.device.type != "cpu":  # one kernel each on a device, no host read per chunk
        return _decided_by_kernels(x, best, k)
    top = x.amax(-1)
    at = best[None, :, None].expand(x.shape[0], -1, 1)
    there = x.gather(-1, at)
    second = x.scatter_(-1, at, -math.inf).amax(-1)  # each row's max without `best`
    x.scatter_(-1, at, there)
    alone = (there.squeeze(-1) == top) & (second < top)
    top1 = alone.clone()
    topk = alone.clone() if k is not None else torch.zeros_like(alone)
    other = (~alone).nonzero()
    if other.numel():
        block, row = other.unbind(1)
        rows, wanted = x[block, row], best[row]
        top1[block, row] = rows.argmax(-1) == wanted
        if k is not None:
            topk[block, row] = (rows.topk(k, -1).indices == wanted[:, None]).any(-1)
    return top, top1, topk


def _decided_by_kernels(
    x: torch.Tensor, best: torch.Tensor, k: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_decided with argmax and topk on every row."""
    top1 = x.argmax(-1) == best
    topk = torch.zeros_like(top1) if k is None else (x.topk(k, -1).indices == best[:, None]).any(-1)
    return x.amax(-1), top1, topk


def _nonnegative(value: float) -> float:
    return max(value, 0.0) if math.isfinite(value) else math.inf


def logit_rows(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(referee in float64, candidate at its own dtype, exact for argmax and top-k) on the referee's
    device (a CUDA candidate's output is judged against a referee that may have run on the host), a
    row per decision; None when either is not finite or empty."""
    rows = _as_rows(truth, candidate)
    return rows if rows is not None and all_finite(rows[1]) and all_finite(rows[0]) else None


def _as_rows(truth: torch.Tensor, candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """logit_rows without reading whether they are finite: None when the shapes differ or there are no rows."""
    if candidate.shape != truth.shape:
        return None
    ref = truth.detach().double().reshape(-1, truth.shape[-1])
    cand = candidate.detach().to(ref.device).reshape(-1, truth.shape[-1])
    if not cand.is_floating_point():
        cand = cand.double()
    return (ref, cand) if ref.shape[0] > 0 else None


def agreement(x: torch.Tensor, best: torch.Tensor) -> float:
    """The share of rows whose argmax is the referee's (`best`)."""
    return float((x.argmax(-1) == best).double().mean())
