"""What the op-level range checks of overflow-risk cost: compare's op ranges and the trace's fp16
what-ifs of fp32 ops.

compare (budget: <= 3x the two plain forward passes): bench_compare.py's model (12-layer
encoder, dim 256, 8 x 128 tokens), its passes run by `passes.hooked` as compare runs them,
without and with `precision.near_limit.OpRanges` recording: the fp64 pass (every floating output)
and the fp16 candidate pass (its fp16 outputs), then a whole `fpdoctor.compare(candidate="fp16")`
with its op ranges switched off and on (compare takes them for a candidate whose dtype is in
`near_limit.AT_RISK`; the benchmark sets that set): on, the fp64 pass records every op's range
and the candidate's pass only the module calls that came near the max, all read and judged at
the end. This CPU has no fast fp16 GEMM
(an fp16 pass takes ten times a bf16 one), which hides the recorder's cost; so bf16 stands in
for fp16 on hardware whose fp16 GEMMs run at bf16's speed (a GPU): the same recorder taking the
bf16 outputs. Variants alternate, medians.

trace (budget: <= 1.5x a plain step on CPU): bench_numerics.py's 4-layer transformer training
step traced with headroom, without and with `Tracer.ranges` (exact ranges of fp32 forward
outputs, for the fp16 what-ifs of ops). Variants alternate, medians.

Wall and CPU time are both printed: on a shared machine other work stretches the wall time. One
torch thread by default, so that OpenMP's spin-waiting does not swamp the CPU time.

Run: python benchmarks/bench_near_limit.py [--rounds N] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from fpdoctor.numerics.api import Trace
from fpdoctor.precision.candidates import make_run, run_flags
from fpdoctor.precision.compare import near_limit
from fpdoctor.precision.compare.passes import hooked
from fpdoctor.preserve import RngState
from models import batch, make_step, small_transformer

# pass -> (dtype, the output dtypes its recorder takes): the fp64 pass all, a candidate its own
PASSES = {
    "fp64": (torch.float64, None),
    "fp16": (torch.float16, near_limit.AT_RISK),
    "bf16": (torch.bfloat16, frozenset({torch.bfloat16})),
}


def _medians(variants: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """Per variant: (median wall time, median CPU time of this process). On a shared machine the
    CPU time is the steadier one: other processes' load stretches wall time, not ours."""
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: (statistics.median(w for w, _ in values), statistics.median(c for _, c in values))
        for name, values in times.items()
    }


def _line(label: str, base: tuple[float, float], other: tuple[float, float], what: str) -> str:
    return (
        f"  {label}: {base[0] * 1e3:8.1f} ms, {what} {other[0] * 1e3:8.1f} ms: {other[0] / base[0]:.3f}x wall, "
        f"{other[1] / base[1]:.3f}x CPU time"
    )


def _passes(rounds: int) -> tuple[dict[str, tuple[float, float]], int]:
    torch.manual_seed(0)
    model = small_transformer(layers=12, dim=256).eval()
    tokens, _ = batch(length=128)
    embed = model.embed(tokens).detach()
    encoder = model.encoder
    rng = RngState.capture()
    runs = {name: (make_run(encoder, name).eval(), dtype) for name, (dtype, _) in PASSES.items()}
    cpu = torch.device("cpu")
    counted = []

    def plain(name: str) -> Callable[[], None]:
        run, dtype = runs[name]

        def go() -> None:
            with run_flags(name, cpu):  # module by module, as compare runs
                hooked(run, embed, dtype, pre=lambda *a: None, post=lambda *a: None, rng=rng)

        return go

    def recorded(name: str) -> Callable[[], None]:
        run, dtype = runs[name]

        def go() -> None:
            dtypes = PASSES[name][1]
            ranges = near_limit.OpRanges() if dtypes is None else near_limit.OpRanges(dtypes)
            with run_flags(name, cpu), ranges:
                hooked(run, embed, dtype, pre=ranges.pre(lambda *a: None), post=ranges.post(lambda *a: None), rng=rng)
            counted.append(len(ranges.read()))

        return go

    variants = {}
    for name in PASSES:
        variants[f"{name} pass"] = plain(name)
        variants[f"{name} pass + op ranges"] = recorded(name)
    return _medians(variants, rounds), counted[0]


@contextlib.contextmanager
def _at_risk(dtypes: frozenset[torch.dtype]) -> Iterator[list[int]]:
    """compare with op ranges taken for candidates computing in `dtypes` (compare records them for
    a candidate whose dtype is in near_limit.AT_RISK, read when its comparison starts); yields the
    number of fp64 op ranges each judged comparison read, to show the ranges were really taken."""
    saved, judge = near_limit.AT_RISK, near_limit.near_limit
    judged: list[int] = []

    def counted(candidate: Any, reference: Any = (), **kw: Any) -> list[dict[str, Any]]:
        reference = list(reference)
        judged.append(len(reference))
        return judge(candidate, reference, **kw)

    near_limit.AT_RISK, near_limit.near_limit = dtypes, counted
    try:
        yield judged
    finally:
        near_limit.AT_RISK, near_limit.near_limit = saved, judge


def _compare(rounds: int, candidate: str) -> dict[str, tuple[float, float]]:
    """A whole `fpdoctor.compare` without op ranges and with them, as compare wires them: the fp64
    pass's ranges taken in the own-ops dispatch, the candidate's pass watching only the module
    calls that came near the max (none here: the encoder's values are small, so what is measured is
    the fp64 side and the choice of what to watch), the ranges read and judged at the end."""
    torch.manual_seed(0)
    model = small_transformer(layers=12, dim=256).eval()
    tokens, _ = batch(length=128)
    embed = model.embed(tokens).detach()
    encoder = model.encoder
    dtype = PASSES[candidate][0]
    with_dtype = near_limit.AT_RISK | {dtype}

    def without() -> None:
        with _at_risk(frozenset()) as judged:
            fpdoctor.compare(encoder, embed, candidate=candidate)
        assert not judged, "op ranges were taken although switched off"

    def with_ranges() -> None:
        with _at_risk(with_dtype) as judged:
            fpdoctor.compare(encoder, embed, candidate=candidate)
        assert judged and judged[0] > 0, "compare judged no op ranges"

    return _medians({"compare": without, "+ op ranges": with_ranges}, rounds)


def _trace(rounds: int) -> dict[str, tuple[float, float]]:
    torch.manual_seed(0)
    model = small_transformer(layers=4, dim=256, heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer)
    tokens, targets = batch(size=8, length=64)

    def plain() -> None:
        step_fn(tokens, targets)
        optimizer.step()

    def traced(ranges: bool) -> Callable[[], None]:
        def go() -> None:
            # ranges=True: what `trace(headroom=True)` sets when fp16 is a target
            with Trace(model, headroom=True, ranges=ranges):
                plain()

        return go

    return _medians(
        {"plain step": plain, "trace, headroom": traced(False), "trace, headroom + fp32 op ranges": traced(True)},
        rounds,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (OpenMP spin-waits swamp CPU time)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    passes, ops = _passes(args.rounds)
    print(f"12-layer encoder, dim 256, 8 x 128 tokens: hooked passes, {args.rounds} alternating rounds, medians")
    for name in PASSES:
        label = f"{name} pass" + (" (stand-in for fast fp16)" if name == "bf16" else "")
        print(_line(label, passes[f"{name} pass"], passes[f"{name} pass + op ranges"], "with op ranges"))
    print(f"  op outputs recorded in the fp64 pass: {ops}")
    for candidate in ("fp16", "bf16"):
        whole = _compare(args.rounds, candidate)
        label = f"compare --candidate {candidate}" + (" (stand-in for fast fp16)" if candidate == "bf16" else "")
        print(_line(label, whole["compare"], whole["+ op ranges"], "op ranges wired"))
    steps = _trace(args.rounds)
    print("CPU training step, 4-layer transformer dim 256, 8 x 64 tokens, medians")
    plain = steps["plain step"]
    print(f"  plain step {plain[0] * 1e3:8.1f} ms")
    headroom = steps["trace, headroom"]
    print(f"  traced with headroom: {headroom[0] / plain[0]:.2f}x plain (wall), {headroom[1] / plain[1]:.2f}x (CPU)")
    print(_line("traced with headroom", headroom, steps["trace, headroom + fp32 op ranges"], "+ fp32 op ranges"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
