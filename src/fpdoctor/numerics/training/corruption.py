"""Silent data corruption: the data-parallel rank whose device computes finite wrong numbers.

Most corruption never makes a NaN: a flipped bit, a wrong tile of a GEMM, a stale buffer give
finite wrong activations, and the run trains on them. Under DDP every rank runs the same model on
its own data, so the size of each rank's own gradient before the all-reduce is a statistic a
healthy run keeps within a spread of its own (the data differ) and a faulty device leaves.

The always-on part. `BucketWatch` (distributed.py) takes each bucket's local norm on the device
before the reduction; each rank writes its norm into its own slot of a world-long vector (the
others' slots at -1) appended to the sentinel's per-step all-reduce: one MAX
all-reduce per step, as before, now of 2 + world_size floats, read back with the step's flags.
Every rank then holds every rank's norm, and decides the same thing from the same floats.

The statistic is each rank's log-ratio to the median across ranks (scale-free: the loss falling
or the learning rate changing moves every rank alike). The first `CALIBRATION_STEPS` finite steps
calibrate it, robustly: each rank's centre (its median log-ratio, for data that differ by rank
for good) and one spread over all ranks (1.4826 x the median absolute deviation, at least
`FLOOR`); the spread is recalibrated every `RECALIBRATE_EVERY` steps on the last `WINDOW` steps
without a strike, since gradient noise grows against the mean gradient as training goes on. A
strike is a rank further than `THRESHOLD` spreads from its centre; `STRIKES` strikes of one rank
within `STRIKE_WINDOW` steps escalate.

The escalation, bounded: up to `GEMMS` of the model's `nn.Linear` layers (evenly spaced, the last
one always) are run again on this device, each `REPEATS` times on `ROWS` rows of a seeded input
(the same on every rank; a new one each time, so that a stale result shows), and each result is
compared with the same product in fp64 against the rounding bound of the layer's dtype. Every
rank does the same on the same weights and inputs, and one `all_gather_object` compares them: the
rank whose results leave the bound while every other rank's stay within it, or (the bound kept by
all) whose results differ bit for bit where every other rank agrees, or whose replica of the
weights differs from everyone's, is named by rank, host, device, GPU index and UUID. At most
`ESCALATIONS` escalations per run; a rank named once is not escalated again.
"""

from __future__ import annotations

import array
import itertools
import math
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
WINDOW = 256
RECALIBRATE_EVERY = 64
# A robust z of 8 spreads: a Gaussian spread gives one every 10^15 ranks x steps; measured on 4 x 2000
# and 16 x 1000 healthy steps of benchmarks/bench_sdc.py, the largest seen was well under it.
THRESHOLD = 8.0
FLOOR = 0.02  # the least spread of a log-ratio (2%): identical data on every rank has none
STRIKES = 3
STRIKE_WINDOW = 32
GEMMS = 8
REPEATS = 16
ROWS = 16
ESCALATIONS = 3
_MADS = 1.4826  # the median absolute deviation times this is a Gaussian's standard deviation
_LOG_ZERO = -1e30  # the log of a zero norm: far below any rank's


@dataclass
class Calibration:
    """What the thresholds were calibrated on: each rank's centre, the spread, over which steps."""

    steps: int  # the steps the latest calibration read
    first: int
    last: int
    centres: list[float]  # one per rank
    spread: float
    floored: bool  # the measured spread was under FLOOR

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "window": [self.first, self.last],
            "centres": [round(c, 5) for c in self.centres],
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
        elif bucket_watch is None:
            self.off = "no DDP communication hook of fpdoctor's (FSDP, or a hook of your own): no pre-reduce norm"
        else:
            bucket_watch.norms = True
        self._reads: dict[int, FlagRead] = {}
        # the other ranks' slots of the exchanged vector (-1: below any norm), made once per device
        self._others: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._missing = torch.full((1,), -1.0, device=device)
        # the last WINDOW steps without a strike (deviations, steps x ranks), and the thresholds' figures
        self._ring: deque[tuple[int, list[float]]] = deque(maxlen=WINDOW)
        self._filled = 0
        self._centres: list[float] | None = None
        self._spread = FLOOR
        self._since = 0  # steps judged since the last calibration
        self.calibration: Calibration | None = None
        self.judged = 0  # steps whose every rank sent its norm
        self.struck: list[tuple[int, int, float]] = []  # (step, rank, z) of every strike, the first 100
        self.strike_count = 0
        self.worst = 0.0  # the largest z of a step that was no strike (how close a healthy run came)
        self._strikes: dict[int, deque[int]] = {}
        self.escalations: list[Escalation] = []
        self.named: set[int] = set()
        self.errors: list[str] = []
        self.trace: list[tuple[int, list[float]]] | None = None  # a list: every judged step's signed z, kept

    # -- the always-on part --------------------------------------------------------------------
    def exchange(self, agreed: torch.Tensor, step: int) -> torch.Tensor:
        """`distributed.all_max(agreed)`, with every rank's gradient norm in the same all-reduce.
        Every rank sends the same length whatever fails here (else the collective would not match)."""
        if self.world < 2 or self.off is not None:  # off on every rank alike (the same model, the same hook)
            return distributed.all_max(agreed)
        head = agreed.detach().float().reshape(-1)
        mine = self._missing
        try:
            norm = self.bucket_watch.local_norm() if self.bucket_watch is not None else None
            if norm is not None:  # >= 0 (NaN on a non-finite step, which is not judged): -1 marks none
                mine = norm.reshape(1).to(head.device)
        except Exception as exc:  # the observer never breaks the step's collective
            self._error(exc)
        others = self._others.get(head.device)
        if others is None:
            others = self._others[head.device] = (
                torch.full((self.rank,), -1.0, device=head.device),
                torch.full((self.world - self.rank - 1,), -1.0, device=head.device),
            )
        out = torch.cat([head, others[0], mine.to(head.device), others[1]])  # a new tensor: reduced in place
        torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)
        self._reads[step] = FlagRead(out[head.numel() :])
        while len(self._reads) > 4:  # steps never judged (an observer failure before the judge)
            del self._reads[min(self._reads)]
        return out[: head.numel()].to(agreed.dtype).reshape(agreed.shape)

    def observe(self, step: int, finite: bool, add: Callable[[Finding], None]) -> None:
        """Judge the step's norms (host floats): strikes, calibration, escalation; findings to `add`.
        Plain Python per step, a few passes over one float per rank (small torch ops cost more below
        a few hundred ranks); the calibration's medians in torch, every RECALIBRATE_EVERY steps."""
        read = self._reads.pop(step, None)
        if read is None or not finite or self.off is not None:
            return
        norms = read.values()
        least = min(norms)
        if least < 0:  # a rank sent no norm (no bucket reduced this step)
            return
        self.judged += 1
        # map and sorted run in C: a few microseconds for 16 ranks, where a torch op costs as much each
        logs = list(map(math.log, norms)) if least > 0 else [math.log(v) if v > 0 else _LOG_ZERO for v in norms]
        ordered = sorted(logs)
        n = len(ordered)
        # halfway between the middle two for an even count (the lower one alone would put one rank at
        # exactly 0 every step, and two ranks could never be told apart)
        median = 0.5 * (ordered[(n - 1) // 2] + ordered[n // 2])
        deviations = [v - median for v in logs]
        if self._centres is None:
            self._keep(step, deviations)
            if self._filled >= CALIBRATION_STEPS:
                self._calibrate()
            return
        scale = 1.0 / self._spread
        signed = [(d - c) * scale for d, c in zip(deviations, self._centres, strict=True)]
        if self.trace is not None:  # for a benchmark's distribution of the statistic
            self.trace.append((step, signed))
        worst = max(map(abs, signed))
        if worst <= THRESHOLD and math.isfinite(sum(signed)):  # an inf or NaN is no pass
            self.worst = max(self.worst, worst)
            self._keep(step, deviations)
            self._since += 1
            if self._since >= RECALIBRATE_EVERY:
                self._calibrate()
            return
        struck = [r for r, z in enumerate(signed) if not abs(z) <= THRESHOLD]
        suspects = []
        for rank in struck:
            self.strike_count += 1
            if len(self.struck) < 100:
                self.struck.append((step, rank, abs(signed[rank])))
            strikes = self._strikes.setdefault(rank, deque())
            strikes.append(step)
            while strikes and strikes[0] <= step - STRIKE_WINDOW:
                strikes.popleft()
            if len(strikes) >= STRIKES and rank not in self.named:
                suspects.append(rank)
        if suspects and len(self.escalations) < ESCALATIONS:
            self._escalate(step, suspects, add)

    def _keep(self, step: int, deviations: list[float]) -> None:
        """A step without a strike into the calibration's last WINDOW steps (lists: an append per
        step, one tensor made per calibration)."""
        self._ring.append((step, deviations))
        self._filled = len(self._ring)

    def _calibrate(self) -> None:
        # steps x ranks; through a flat array: torch.tensor parses nested lists a float at a time
        flat = array.array("d", itertools.chain.from_iterable(d for _, d in self._ring))
        table = torch.frombuffer(flat, dtype=torch.float64).view(len(self._ring), self.world)
        centres = table.median(dim=0).values
        spread = _MADS * float((table - centres).abs().median())
        self._centres, self._spread = centres.tolist(), max(spread, FLOOR)
        self.calibration = Calibration(
            steps=self._filled, first=self._ring[0][0], last=self._ring[-1][0], centres=self._centres,
            spread=self._spread, floored=spread < FLOOR,
        )  # fmt: skip
        self._since = 0

    # -- the escalation --------------------------------------------------------------------------
    def _escalate(self, step: int, suspects: list[int], add: Callable[[Finding], None]) -> None:
        """Every rank recomputes the same GEMMs and compares (one all_gather_object); every rank
        makes the same decision and the same finding from the gathered results."""
        strikes = {r: list(self._strikes[r]) for r in suspects}
        escalation = Escalation(step, suspects, strikes)
        self.escalations.append(escalation)
        for r in suspects:
            self._strikes[r].clear()
        try:
            mine: dict[str, Any] = {"identity": identity(self.device), **recompute(self.model)}
        except Exception as exc:
            self._error(exc)
            mine = {"identity": identity(self.device), "error": f"{type(exc).__name__}: {exc}"}
        everyone = distributed.agree(mine)
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
            z = [round(z, 1) for s, r, z in self.struck if r == rank and s in strikes]
            statistic = (
                f"its gradient norm left the calibrated spread {len(strikes)} times in {STRIKE_WINDOW} steps "
                f"(steps {', '.join(map(str, strikes))}; {', '.join(map(str, z))} spreads, threshold {THRESHOLD:g})"
            )
        else:  # the statistic pointed at another rank; the recomputation at this one
            strikes = sorted({s for steps in e.strikes.values() for s in steps})
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
            "statistic": "log-ratio of each rank's local gradient norm (before the all-reduce) to the ranks' median",
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
            "judged_steps": self.judged,
            "strikes": self.strike_count,
            "struck": [[s, r, round(z, 2)] for s, r, z in self.struck],
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
            line = (
                f"{self.world} ranks' gradient norms before the all-reduce, calibrated on steps {cal.first}-{cal.last} "
                f"(spread {cal.spread:.3g} in log-norm{', the floor' if cal.floored else ''}); a strike beyond "
                f"{THRESHOLD:g} spreads, {STRIKES} in {STRIKE_WINDOW} steps escalate; {self.strike_count} strikes, "
                f"{len(self.escalations)} escalations, {len(self.named)} ranks named"
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
