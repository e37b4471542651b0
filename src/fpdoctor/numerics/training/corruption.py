"""Silent data corruption: the data-parallel rank whose device computes finite wrong numbers.

Most corruption never makes a NaN: a flipped bit, a wrong tile of a GEMM, a stale buffer give
finite wrong activations, and the run trains on them. Under DDP every rank runs the same model on
its own data, so the size of each rank's own gradient before the all-reduce is a statistic a
healthy run keeps within a spread of its own (the data differ) and a faulty device leaves.

The always-on part. `BucketWatch` (distributed.py) takes each bucket's local norm on the device
before the reduction. The statistic rides in the sentinel's one per-step all-reduce, which stays
two numbers long whatever the world size: gloo's all-reduce of a small tensor costs about one
round per element (2 -> 4 elements doubled it on 4 ranks here), and NCCL's is latency-bound. The
two flags the step already agrees on (loss, gradients) and the statistic are packed into two
int64 sums, exact and the same on every rank in any reduction order:

    A = loss flag | gradient flag << 14 | X << 28          (the flags: counts of ranks, 14 bits each)
    B = X * X | escalate << 40 | missing << 52

where X is the rank's log gradient norm (less its own centre) in steps of 2^-7, clamped to +-32
and offset to be non-negative (13 bits). Summed, A and B give every rank the count of ranks with
each flag, the sum and the sum of squares of X, how many ranks ask for an escalation and how
many sent no norm; the flags go back to the step as 0/1, as the maximum gave them. Exact while
the world is under 2^14 ranks (the sentinel is off above it, and the flags go through a plain
maximum); the escalate and missing counts are read as "any" and wrap only if 2^12 (2^11) ranks
set them in one step.

Each rank judges itself: its deviation from the mean of the other ranks (leave-one-out, from the
sums and its own X), over the spread of the ranks' log-norms, which every rank reads from the
same sums (the sample variance across ranks of each judged step). The first `CALIBRATION_STEPS`
judged steps calibrate each rank's centre (its median deviation, for data that differ by rank
for good; subtracted before its norm is sent) and the spread (the median over steps of the
variance, scaled to its mean for the ranks' degrees of freedom, at least `FLOOR`); the spread is
calibrated again `SETTLE` steps later on centred norms, then every `RECALIBRATE_EVERY` judged
steps on the last `WINDOW` whose variance stayed within `QUIET` spreads^2 (a rule of the shared
sums: every rank keeps the same steps and has the same spread). A strike is a deviation beyond
`THRESHOLD` spreads; `STRIKES` strikes of one rank within `STRIKE_WINDOW` steps make that rank ask
for an escalation in its next exchange, and every rank escalates at the step whose sums say so.

The escalation, bounded: up to `GEMMS` of the model's `nn.Linear` layers (evenly spaced, the last
one always) are run again on this device, each `REPEATS` times on `ROWS` rows of a seeded input
(the same on every rank; a new one each time, so that a stale result shows), and each result is
compared with the same product in fp64 against the rounding bound of the layer's dtype. Every
rank does the same on the same weights and inputs, and one `all_gather_object` compares them: the
rank whose results leave the bound while every other rank's stay within it, or (the bound kept by
all) whose results differ bit for bit where every other rank agrees, or whose replica of the
weights differs from everyone's, is named by rank, host, device, GPU index and UUID. At most
`ESCALATIONS` escalations per run; a rank named once does not ask again.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fpdoctor import catalog
from fpdoctor.numerics.observe.gradcheck import FlagRead
from fpdoctor.numerics.training import distributed
from fpdoctor.report.model import Finding, Trial

CALIBRATION_STEPS = 32
SETTLE = 16  # the spread again on centred norms, this many judged steps after the first calibration
WINDOW = 256
RECALIBRATE_EVERY = 64
QUIET = 4.0  # a step whose variance across ranks is beyond QUIET spreads^2 calibrates nothing
# 6 spreads: a Gaussian deviation gives one every 5 x 10^8 ranks x steps, and STRIKES of one rank
# within STRIKE_WINDOW steps escalate (the escalation, not the strike, names a rank). Measured on
# benchmarks/bench_sdc.py: healthy |z| at most 4.5 over 16 x 1000 steps and 6.0 over 4 x 300; a
# stale output on one of 16 ranks, 6.8-7.3 on each faulty step (8 found it on none).
THRESHOLD = 6.0
FLOOR = 0.02  # the least spread of a log-norm (2%): identical data on every rank has none
STRIKES = 3
STRIKE_WINDOW = 32
GEMMS = 8
REPEATS = 16
ROWS = 16
ESCALATIONS = 3
MAX_RANKS = 2**14 - 1  # the packed sums count ranks in 14 bits
QUANTUM = 2.0**-7  # X's step in log-norm
RANGE = 32.0  # |log-norm - centre| clamped here (a norm e^32 times off is off all the same)
_OFFSET = int(RANGE / QUANTUM)  # X = round(y / QUANTUM) + _OFFSET, in [0, 2 * _OFFSET)
_FLAG_BITS, _SUM_BITS, _SQUARE_BITS, _ESCALATE_BITS, _MISSING_BITS = 14, 27, 40, 12, 11


@dataclass
class Calibration:
    """What the thresholds were calibrated on: this rank's centre, the spread, over which steps."""

    steps: int  # the steps the latest calibration read
    first: int
    last: int
    centre: float  # this rank's, in log-norm
    spread: float
    floored: bool  # the measured spread was under FLOOR

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "window": [self.first, self.last],
            "centre": round(self.centre, 5),
            "spread": self.spread,
            "floored": self.floored,
            "threshold": THRESHOLD,
            "strikes": STRIKES,
            "strike_window": STRIKE_WINDOW,
        }


@dataclass
class Escalation:
    step: int
    suspects: list[int]
    strikes: dict[int, list[int]]
    z: dict[int, list[float]] = field(default_factory=dict)  # each suspect's deviations at its strikes
    gemms: list[str] = field(default_factory=list)
    named: list[dict[str, Any]] = field(default_factory=list)  # the ranks that disagree, with why
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "step": self.step,
            "suspects": self.suspects,
            "strikes": {str(r): s for r, s in self.strikes.items()},
            "recomputed": {"gemms": self.gemms, "repeats": REPEATS, "rows": ROWS},
            "named": self.named,
        }
        if self.note:
            out["note"] = self.note
        return out


def identity(device: torch.device) -> dict[str, Any]:
    """rank, host, device, GPU index, name and UUID of this rank (what a drain needs); cpu: the host."""
    info = distributed.describe(device)
    if device.type == "cuda":
        info["index"] = device.index if device.index is not None else torch.cuda.current_device()
    return info


def _field(value: int, shift: int, bits: int) -> int:
    return (value >> shift) & ((1 << bits) - 1)


def _median_of_chi2(dof: int) -> float:
    """The median of a chi-square over its degrees of freedom (Wilson-Hilferty): the median of a
    sample variance over the variance, to turn a robust median into the mean it estimates."""
    return (1.0 - 2.0 / (9.0 * dof)) ** 3 if dof > 0 else 1.0


@dataclass
class _Read:
    """Sums already on the host (a CPU run): what `FlagRead(..., exact=True)` gives on a GPU."""

    values: list[int]

    def ints(self) -> list[int]:
        return self.values


class CorruptionWatch:
    """The corruption sentinel of one run's step judge: `exchange` in the step's all-reduce,
    `observe` when the step is judged. Inactive outside torch.distributed (nothing to compare)."""

    def __init__(self, model: nn.Module, bucket_watch: distributed.BucketWatch | None, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.world = torch.distributed.get_world_size() if distributed.active() else 1
        self.rank = torch.distributed.get_rank() if self.world > 1 else 0
        self.bucket_watch = bucket_watch
        self.off: str | None = None
        if self.world < 2:
            self.off = "one rank: nothing to compare its gradient with"
        elif self.world > MAX_RANKS:
            self.off = f"{self.world} ranks: the packed exchange counts up to {MAX_RANKS}"
        elif bucket_watch is None:
            self.off = "no DDP communication hook of fpdoctor's (FSDP, or a hook of your own): no pre-reduce norm"
        else:
            bucket_watch.norms = True
        self._reads: dict[int, FlagRead | _Read] = {}
        self._agreed: dict[tuple[Any, ...], torch.Tensor] = {}  # the CPU's four answers, per dtype and shape
        # the collective: a benchmark puts its own in to time the rest in one process
        self.reduce: Callable[[torch.Tensor], object] = torch.distributed.all_reduce
        self._signals: dict[tuple[torch.device, int], torch.Tensor] = {}  # B's escalate/missing bits, made once
        self._devices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._asking: list[tuple[int, float]] | None = None  # the strikes (step, z) that asked
        self._bits = 0  # the last signal's bits, for the packing on the host
        self._ask = False  # this rank's strikes ask for an escalation: sent in the next exchange
        self._centre = 0.0  # this rank's, subtracted from its log-norm before it is sent
        self._spread: float | None = None
        # the last WINDOW judged steps: this rank's (step, deviation + centre) without a strike of its
        # own; the shared variances of the quiet steps (every rank keeps the same ones)
        self._deviations: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._variances: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._recalibrate_at = CALIBRATION_STEPS
        self._calibrations = 0
        self.calibration: Calibration | None = None
        self.judged = 0  # steps whose every rank sent its norm
        self.struck: list[tuple[int, float]] = []  # (step, z) of this rank's strikes, the first 100
        self.strike_count = 0
        self.worst = 0.0  # the largest |z| of this rank's steps that were no strike (how close it came)
        self._strikes: deque[int] = deque()
        self.escalations: list[Escalation] = []
        self.named: set[int] = set()
        self.errors: list[str] = []
        self.trace: list[tuple[int, list[float]]] | None = None  # a list: every judged step's z, kept

    # -- the always-on part --------------------------------------------------------------------
    def exchange(self, agreed: torch.Tensor, step: int) -> torch.Tensor:
        """`distributed.all_max(agreed)` (two 0/1 flags), with this rank's gradient norm in the same
        all-reduce of two numbers. Every rank sends the same whatever fails here (else the
        collective would not match)."""
        if self.off is not None or agreed.numel() != 2:  # off on every rank alike (the same model, the same hook)
            return distributed.all_max(agreed)
        flags = agreed.detach().reshape(-1)
        norm = None
        try:
            norm = self.bucket_watch.local_norm() if self.bucket_watch is not None else None
            out = self.pack(flags, norm)
        except Exception as exc:  # the observer never breaks the step's collective: send no norm
            self._error(exc)
            out = self.pack(flags, None)
        self.reduce(out[:2])  # [A, B] summed in place over ranks; out[2] stays this rank's X
        while len(self._reads) >= 4:  # steps never judged (an observer failure before the judge)
            del self._reads[min(self._reads)]
        if out.device.type != "cpu":  # on the device, nothing read back: the step goes on
            self._reads[step] = FlagRead(out, exact=True)
            masks = self._constants(out.device)[2]
            return ((out[:1] & masks) != 0).to(agreed.dtype).reshape(agreed.shape)
        # on the CPU the sums are there: read once, and the flags handed back as one of four
        # tensors made once (a few us a step less than making one; the callers only read them)
        values = out.tolist()
        self._reads[step] = _Read(values)
        a = values[0]
        key = (agreed.dtype, agreed.shape, a & (2**_FLAG_BITS - 1) != 0, (a >> _FLAG_BITS) & (2**_FLAG_BITS - 1) != 0)
        both = self._agreed.get(key)
        if both is None:
            both = self._agreed[key] = torch.tensor([float(key[2]), float(key[3])], dtype=agreed.dtype).reshape(
                agreed.shape
            )
        return both

    def pack(self, flags: torch.Tensor, norm: torch.Tensor | None, *, on_device: bool | None = None) -> torch.Tensor:
        """This rank's [A, B, X] (int64, on the flags' device), as the docstring lays them out, from
        its two flags (nonzero: set, NaN included) and its norm (None: a rank with no norm, missing
        set). On a GPU a dozen small device ops, nothing read back: A, X and X^2 in float64 (exact:
        A < 2^41) by one product with the fields' weights. On the CPU (or `on_device=False`) the
        same integers from Python floats, read at once, in one tensor."""
        device = flags.device
        signal = self._signal(device, norm is None)
        if not (device.type != "cpu" if on_device is None else on_device):
            loss, grad = (int(v != 0) for v in flags.tolist())  # NaN != 0
            x = 0
            if norm is not None:
                v = float(norm)
                y = 0.0 if math.isnan(v) else (math.log(v) - self._centre) / QUANTUM if v > 0 else -math.inf
                x = round(min(max(y, -_OFFSET), _OFFSET - 1)) + _OFFSET
            packed = [loss + (grad << _FLAG_BITS) + (x << 2 * _FLAG_BITS), x * x + self._bits, x]
            return torch.tensor(packed, dtype=torch.int64)
        weights, zero, _ = self._constants(device)
        if norm is None:
            x_t = zero
        else:
            x_t = torch.log(norm.detach().reshape(1).to(device=device, dtype=torch.float64))
            x_t = x_t.sub_(self._centre).mul_(1.0 / QUANTUM)
            # a NaN norm (a non-finite step, not judged) sends the centre; a zero norm is the least X
            x_t = x_t.nan_to_num_(0.0).clamp_(-_OFFSET, _OFFSET - 1).round_().add_(_OFFSET)
        fields = torch.cat([(flags != 0).to(torch.float64), x_t, x_t * x_t]) @ weights  # [A, X^2, X]
        return fields.to(torch.int64) + signal

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per device, made once: the fields' weights ([loss, grad, X, X^2] -> [A, X^2, X]), a zero X,
        and the two flags' masks in A."""
        found = self._devices.get(device)
        if found is None:
            weights = torch.zeros(4, 3, dtype=torch.float64)
            weights[0, 0], weights[1, 0], weights[2, 0] = 1.0, 2.0**_FLAG_BITS, 2.0 ** (2 * _FLAG_BITS)
            weights[3, 1] = weights[2, 2] = 1.0
            mask = 2**_FLAG_BITS - 1
            masks = torch.tensor([mask, mask << _FLAG_BITS], dtype=torch.int64)
            found = self._devices[device] = (
                weights.to(device),
                torch.zeros(1, dtype=torch.float64, device=device),
                masks.to(device),
            )
        return found

    def _signal(self, device: torch.device, missing: bool) -> torch.Tensor:
        """[0, B's escalate and missing bits, 0] on the device, one per combination and device (no
        host-to-device copy on a step); the escalation asked is sent once."""
        key = (device, int(self._ask) | int(missing) << 1)
        self._ask = False
        self._bits = (key[1] & 1) << _SQUARE_BITS | (key[1] >> 1) << (_SQUARE_BITS + _ESCALATE_BITS)
        signal = self._signals.get(key)
        if signal is None:
            signal = self._signals[key] = torch.tensor([0, self._bits, 0], dtype=torch.int64, device=device)
        return signal

    def observe(self, step: int, finite: bool, add: Callable[[Finding], None]) -> None:
        """Judge this rank's norm against the others' (host ints, a few floats): strikes,
        calibration; an escalation where the sums say a rank asked for one; findings to `add`."""
        read = self._reads.pop(step, None)
        if read is None or self.off is not None:
            return
        a, b, x = read.ints()
        if _field(b, _SQUARE_BITS, _ESCALATE_BITS) and len(self.escalations) < ESCALATIONS:
            self._escalate(step, add)  # every rank reads the same sums: all escalate here, or none
        if not finite or _field(b, _SQUARE_BITS + _ESCALATE_BITS, _MISSING_BITS):  # not judged, or a rank sent no norm
            return
        self.judged += 1
        n = self.world
        total, squares = _field(a, 2 * _FLAG_BITS, _SUM_BITS), _field(b, 0, _SQUARE_BITS)
        # from the mean of all ranks (the centre's measure: a rank's offset from the mean), in log-norm
        deviation = (x - total / n) * QUANTUM
        variance = (squares - total * total / n) / (n - 1) * QUANTUM * QUANTUM
        if self._spread is None:  # calibrating: nothing judged yet
            self._deviations.append((step, deviation + self._centre))
            self._variances.append((step, variance))
            if self.judged >= self._recalibrate_at:
                self._calibrate()
            return
        # against the other ranks' mean, over the spread of that difference (the others' mean has a
        # variance of its own: n/(n-1) the spread's square), where the spread is the calibrated one
        # or, if larger, the other ranks' own this step: a rank the outlier's pull moves off the
        # mean (by 1/n of the outlier's distance: a few ranks, a large fault) sees the outlier in
        # the others' spread and stays under the threshold, while the outlier sees healthy ranks
        others = (total - x) / (n - 1)
        spread = self._spread
        if n > 2:
            theirs = (squares - x * x - (n - 1) * others * others) / (n - 2) * QUANTUM * QUANTUM
            spread = max(spread, math.sqrt(max(theirs, 0.0)))
        z = (x - others) * QUANTUM / (spread * math.sqrt(n / (n - 1)))
        if self.trace is not None:  # for a benchmark's distribution of the statistic
            self.trace.append((step, [z]))
        if variance <= QUIET * self._spread**2:  # the same rule on every rank: the same kept steps
            self._variances.append((step, variance))
        if abs(z) <= THRESHOLD:
            self.worst = max(self.worst, abs(z))
            self._deviations.append((step, deviation + self._centre))
        else:
            self._strike(step, z)
        if self.judged >= self._recalibrate_at:
            self._calibrate()

    def _strike(self, step: int, z: float) -> None:
        self.strike_count += 1
        if len(self.struck) < 100:
            self.struck.append((step, abs(z)))
        self._strikes.append(step)
        while self._strikes and self._strikes[0] <= step - STRIKE_WINDOW:
            self._strikes.popleft()
        if len(self._strikes) >= STRIKES and self.rank not in self.named:
            self._ask = True
            self._asking = [(s, z) for s, z in self.struck if s in self._strikes] or [(step, abs(z))]

    def _calibrate(self) -> None:
        """This rank's centre from its deviations; the spread from the shared variances (the same
        floats on every rank: the same spread)."""
        if self._deviations:
            self._centre = statistics.median(d for _, d in self._deviations)
        kept = self._variances or self._deviations  # no quiet step since the last: the spread stays
        if self._variances or self._spread is None:
            median = statistics.median(v for _, v in self._variances) if self._variances else 0.0
            measured = math.sqrt(max(median, 0.0) / _median_of_chi2(self.world - 1))
            self._spread = max(measured, FLOOR)
            floored = measured < FLOOR
        else:
            floored = self.calibration.floored if self.calibration is not None else False
        self.calibration = Calibration(
            steps=len(kept), first=kept[0][0] if kept else 0, last=kept[-1][0] if kept else 0, centre=self._centre,
            spread=self._spread, floored=floored,
        )  # fmt: skip
        self._calibrations += 1
        if self._calibrations == 1:  # that spread was read from norms not yet centred: again on centred ones
            self._variances.clear()
            self._recalibrate_at = self.judged + SETTLE
        else:
            self._recalibrate_at = self.judged + RECALIBRATE_EVERY

    # -- the escalation --------------------------------------------------------------------------
    def _escalate(self, step: int, add: Callable[[Finding], None]) -> None:
        """Every rank recomputes the same GEMMs and compares (one all_gather_object); every rank
        makes the same decision and the same finding from the gathered results."""
        asking, self._asking = self._asking, None
        if asking is not None:
            self._strikes.clear()
        try:
            mine: dict[str, Any] = {"identity": identity(self.device), **recompute(self.model)}
        except Exception as exc:
            self._error(exc)
            mine = {"identity": identity(self.device), "error": f"{type(exc).__name__}: {exc}"}
        if asking is not None:
            mine["asked"] = [[s, round(z, 2)] for s, z in asking]
        everyone = distributed.agree(mine)
        asked = {int(e["identity"].get("rank", -1)): e["asked"] for e in everyone if e.get("asked")}
        escalation = Escalation(
            step, sorted(asked), {r: [s for s, _ in a] for r, a in asked.items()},
            {r: [z for _, z in a] for r, a in asked.items()},
        )  # fmt: skip
        self.escalations.append(escalation)
        escalation.gemms = list(everyone[0].get("gemms") or [])
        escalation.named, escalation.note = disagreeing(everyone)
        for entry in escalation.named:
            self.named.add(int(entry["identity"].get("rank", -1)))
        for named in escalation.named:
            add(self._finding(escalation, named, len(everyone)))

    def _finding(self, e: Escalation, named: dict[str, Any], world: int) -> Finding:
        assert self.calibration is not None
        cal = self.calibration
        who = named["identity"]
        rank = int(who.get("rank", -1))
        where = distributed.where_text(who) + (f", GPU index {who['index']}" if "index" in who else "")
        others = world - len(e.named)
        if rank in e.strikes:
            strikes = e.strikes[rank]
            z = [round(z, 1) for z in e.z[rank]]
            statistic = (
                f"its gradient norm left the calibrated spread {len(strikes)} times in {STRIKE_WINDOW} steps "
                f"(steps {', '.join(map(str, strikes))}; {', '.join(map(str, z))} spreads, threshold {THRESHOLD:g})"
            )
        else:  # the statistic pointed at another rank; the recomputation at this one
            strikes = sorted({s for steps in e.strikes.values() for s in steps}) or [e.step]
            z = []
            statistic = (
                f"the gradient norms of rank(s) {', '.join(map(str, e.suspects))} left the calibrated spread "
                f"{STRIKES} times in {STRIKE_WINDOW} steps (steps {', '.join(map(str, strikes))})"
            )
        decided = f"{statistic}, and {named['why']}, where the {others} other ranks agree"
        message = (
            f"Silent data corruption suspected on {where}: {decided}. No NaN or Inf was needed: its wrong "
            f"numbers were finite, and DDP averaged its gradients into every rank's since step {strikes[0]}."
        )
        fix = (
            f"Check the device: `fpdoctor health` on host {who.get('host', '?')}"
            + (f" (GPU index {who['index']}, {who.get('uuid', '')})" if "index" in who else "")
            + ", nvidia-smi -q -d ECC, the kernel log for Xid errors; drain it, and resume from a checkpoint "
            f"written before step {strikes[0]}."
        )
        evidence: dict[str, Any] = {
            "step": e.step,
            "statistic": (
                "each rank's log gradient norm before the all-reduce, less the other ranks' mean, over the spread of "
                "the ranks' log-norms"
            ),
            "calibration": cal.to_dict(),
            "strikes": strikes,
            "z": z,
            "escalation": e.to_dict(),
            "named": e.named,
        }
        return catalog.make(
            "silent-corruption-suspected",
            message=message,
            fix=fix,
            where={k: who[k] for k in ("rank", "host", "device", "uuid") if k in who} | {"step": e.step},
            evidence=evidence,
            trial=Trial.untried(f"draining a device is an action on the machine; decided by: {decided}"),
        )

    # -- the report ------------------------------------------------------------------------------
    def summary(self) -> tuple[tuple[str, str], dict[str, Any]]:
        """The report's line and data: what was calibrated, strikes, escalations; or why it was off."""
        if self.off is not None:
            return ("corruption sentinel", f"off: {self.off}"), {"off": self.off}
        data: dict[str, Any] = {
            "ranks": self.world,
            "exchange": "2 int64 sums in the step's one all-reduce",
            "judged_steps": self.judged,
            "strikes": self.strike_count,  # this rank's
            "struck": [[s, round(z, 2)] for s, z in self.struck],
            "worst_healthy_z": round(self.worst, 2),
            "escalations": [e.to_dict() for e in self.escalations],
        }
        if self.errors:
            data["errors"] = self.errors
        cal = self.calibration
        if cal is None:
            line = f"calibrating: {self.judged} of the first {CALIBRATION_STEPS} steps with every rank's norm"
        else:
            data["calibration"] = cal.to_dict()
            floor = ", the floor" if cal.floored else ""
            line = (
                f"{self.world} ranks' gradient norms before the all-reduce, each against the others' mean, calibrated "
                f"on steps {cal.first}-{cal.last} (spread {cal.spread:.3g} in log-norm{floor}); "
                f"a strike beyond {THRESHOLD:g} spreads, {STRIKES} in {STRIKE_WINDOW} steps escalate; "
                f"{self.strike_count} strikes here, {len(self.escalations)} escalations, {len(self.named)} ranks named"
            )
        return ("corruption sentinel", line), data

    def switch_off(self, why: str) -> None:
        """No statistic from here on (call it on every rank at the same step)."""
        self.off = why
        if self.bucket_watch is not None:
            self.bucket_watch.norms = False

    def _error(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if len(self.errors) < 5 and text not in self.errors:
            self.errors.append(text)


def linears(model: nn.Module, most: int = GEMMS) -> list[tuple[str, nn.Linear]]:
    """Up to `most` of the model's plain nn.Linear layers, evenly spaced, the last one always."""
    found = [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
    ]
    if len(found) <= most:
        return found
    picks = sorted({round(i * (len(found) - 1) / (most - 1)) for i in range(most)})
    return [found[i] for i in picks]


def _unit(dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """The unit roundoff of the output's dtype, and of the accumulation (TF32 where CUDA allows it)."""
    out = torch.finfo(dtype).eps / 2
    accumulate = torch.finfo(torch.float32).eps / 2
    if device.type == "cuda" and dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        accumulate = 2.0**-11
    return out, max(out if dtype == torch.float64 else accumulate, 2.0**-53)


@torch.no_grad()
def recompute(model: nn.Module) -> dict[str, Any]:
    """Each sampled Linear run again on this device `REPEATS` times (a seeded input of `ROWS` rows,
    new each time, the same on every rank), against fp64: the worst error over its rounding bound
    (|y - y64| / (|x| |W|^T + |b|), componentwise, over (2 + in_features) unit roundoffs), a checksum
    of each result, and one of the weights."""
    gemms, worst, sums, weights = [], [], [], []
    for index, (name, layer) in enumerate(linears(model)):
        weight, bias = layer.weight.detach(), layer.bias.detach() if layer.bias is not None else None
        device, dtype = weight.device, weight.dtype
        w64 = weight.double()
        b64 = bias.double() if bias is not None else None
        out_u, acc_u = _unit(dtype, device)
        bound = out_u + (2 + layer.in_features) * acc_u
        generator = torch.Generator().manual_seed(1_000_003 * (index + 1))
        ratio, results = 0.0, []
        for _ in range(REPEATS):
            x = torch.randn(ROWS, layer.in_features, generator=generator).to(device=device, dtype=dtype)
            # the module as the step runs it (its kernel, on this device), in its own dtype: a judge
            # called from inside the user's autocast (watch's hooks) must not recompute in another
            with torch.autocast(device.type, enabled=False):
                y = layer(x).double()
            x64 = x.double()
            exact = x64 @ w64.T + (b64 if b64 is not None else 0.0)
            size = x64.abs() @ w64.abs().T + (b64.abs() if b64 is not None else 0.0)
            error = ((y - exact).abs() / size.clamp_min(torch.finfo(torch.float64).tiny)).amax()
            ratio = max(ratio, float(error) / bound)  # NaN/Inf results: inf
            results.append(float(y.sum()))
        gemms.append(
            f"{name or 'model'} ({layer.in_features}->{layer.out_features}, {str(dtype).removeprefix('torch.')})"
        )
        worst.append(ratio if math.isfinite(ratio) else math.inf)
        sums.append(results)
        weights.append(float(w64.sum()) + (float(b64.sum()) if b64 is not None else 0.0))
    return {"gemms": gemms, "worst": worst, "sums": sums, "weights": weights}


def disagreeing(everyone: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The ranks that disagree with every other (each with its identity and why), and a note where
    none can be named."""
    if len(everyone) < 2:
        return [], "one rank"
    failed = [e for e in everyone if "error" in e]
    if failed:
        return [], f"the recomputation failed on {len(failed)} ranks ({failed[0]['error']})"
    gemms = everyone[0].get("gemms") or []
    if not gemms:
        return [], "the model has no nn.Linear layer to recompute"
    # 1. a result out of its rounding bound against fp64, on some ranks only
    out = [e for e in everyone if any(not w <= 1.0 for w in e["worst"])]
    if out and (len(out) == 1 or len(out) < len(everyone) / 2) and len(out) < len(everyone):
        return [_named(e, _bound_why(e, gemms)) for e in out], ""
    if out:
        return (
            [],
            f"{len(out)} of {len(everyone)} ranks' recomputations left the fp64 bound: the kernel, not one device",
        )
    # 2. a rank whose replica of the weights differs from every other's (which agree)
    odd = _odd_one(everyone, lambda e: tuple(e["weights"]))
    if odd is not None:
        return [_named(odd, "its replica of the weights differs from every other rank's (DDP keeps them equal)")], ""
    # 3. within the bound everywhere, but one rank's results differ bit for bit where all others agree
    odd = _odd_one(everyone, lambda e: tuple(tuple(s) for s in e["sums"]))
    if odd is not None:
        return [_named(odd, "its recomputed GEMMs differ bit for bit from every other rank's, on the same inputs")], ""
    return [], f"{len(gemms)} GEMMs x {REPEATS} recomputed on every rank: within the fp64 bound, the ranks agree"


def _odd_one(everyone: list[dict[str, Any]], key: Callable[[dict[str, Any]], Any]) -> dict[str, Any] | None:
    keys = [key(e) for e in everyone]
    if len(everyone) < 3:
        return None
    for i, k in enumerate(keys):
        rest = keys[:i] + keys[i + 1 :]
        if all(r == rest[0] for r in rest) and k != rest[0]:
            return everyone[i]
    return None


def _bound_why(e: dict[str, Any], gemms: list[str]) -> str:
    bad = [(g, w) for g, w in zip(gemms, e["worst"], strict=True) if not w <= 1.0]
    text = ", ".join(f"{g} {w:.3g}x" if math.isfinite(w) else f"{g} non-finite" for g, w in bad[:3])
    return f"its recomputed GEMMs left their fp64 rounding bound ({text} the bound)"


def _named(e: dict[str, Any], why: str) -> dict[str, Any]:
    return {"identity": e["identity"], "why": why, "worst": e.get("worst")}
