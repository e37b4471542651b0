"""Training-precision budget: the sampled update check <= 1% of a CPU training step.

A bf16 small transformer (benchmarks/models.py, bf16 weights, AdamW) steps on the CPU; every step is
timed plain, and on the measured steps (every `EVERY`-th, as the sentinel does) the check's own time
is taken within the same step: the gathers and the fp32 shadow step before `optimizer.step()`, the
gathers, reductions and the one read back after. Its cost per step at the fixed period is that
time divided by EVERY; as the probe schedules it (measure.py: steps 1, 11 and 21, then every
`paced`-th, the period stretched until a measured step costs under 0.5% of the steps between) its
share of a 10,000-step run (`run_share`), the budget's figure; both against the median plain step
of the same run. The what-if run (fp32 master weights, 8 steps, once
per run) is timed beside it as a multiple of a plain step.

Under `trace` (`--trace-steps K`, 0: skip): the same loop, K steps per `fpdoctor.trace()` block, a
block with the update checks and a block without them in turn, after one untimed trace
(`--trace-rounds` of each, their order alternating; the checks are left out by not installing
trace's update hooks). Per traced step: the checks' own time (their optimizer and gradient hooks
timed inside the block: each block measures its first step, and the gradients of its second
window, as a trace does)
against the traced step without them, and the wall time of the two kinds of block side by side.

A curve first (`models.shapes`, in bf16: the check runs for low-precision weights only): MLPs of 10,
100 and 1000 parameter tensors of width 64 and of 10 and 100 of width 512, foreach, fused and
for-loop AdamW, one thread and two; each row 2 x EVERY + 1 steps, the check's own time on its
measured steps (steps 1, 11, 21) over EVERY against the median plain step, and as paced over a
10,000-step run; the verdict on the worst row as paced. `--quick`: its corners.

Run: python benchmarks/bench_updates.py [--quick] [--steps N] [--layers L] [--dim D]
                                        [--trace-steps K] [--trace-rounds R]
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
from fpdoctor.numerics.updates.measure import EVERY, PACE_AFTER, GradAccumulation, UpdateProbe, paced
from fpdoctor.numerics.updates.under_trace import TraceUpdates
from fpdoctor.numerics.updates.whatif import WHAT_IF_STEPS, what_if
from models import RUN_STEPS, Shape, batch, make_step, mlp_loop, shapes, small_transformer, threads


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--trace-steps", type=int, default=10)
    parser.add_argument("--trace-rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="the curve's corners")
    args = parser.parse_args()
    curve_ok = curve(args.quick)
    torch.manual_seed(0)
    model = small_transformer(layers=args.layers, dim=args.dim, heads=max(4, args.dim // 64)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, foreach=True)
    step_fn = make_step(model, opt)
    tokens, targets = batch(size=8, length=64)
    probe = UpdateProbe(model, opt, every=EVERY)
    plain: list[float] = []
    check: list[float] = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        step_fn(tokens, targets)
        if probe.due(step):
            t0 = time.perf_counter()
            sample = probe.before(step)
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            assert sample is not None
            probe.after(sample)
            probe.read(sample)
            check.append((t1 - t0) + (time.perf_counter() - t2))
            plain.append(time.perf_counter() - start - check[-1])
        else:
            opt.step()
            plain.append(time.perf_counter() - start)
    step_s = statistics.median(plain[2:])  # the first steps allocate the optimizer state
    measured_s = statistics.median(check)
    share = measured_s / EVERY / step_s
    run, gap = run_share(measured_s, step_s)
    print(
        f"bf16 transformer, {args.layers} layers, dim {args.dim}, 8 x 64 tokens, AdamW; {len(probe.params)} parameters"
    )
    print(f"  plain step (forward, backward, AdamW)        {step_s * 1e3:8.2f} ms (median of {len(plain) - 2})")
    print(f"  update check on a measured step              {measured_s * 1e3:8.2f} ms (median of {len(check)})")
    print(f"  per step, measured every {EVERY}th                {share:8.2%} of the plain step")
    print(f"  per step as paced over {RUN_STEPS} (every {gap}th)     {run:8.2%} of the plain step")

    def run_step() -> torch.Tensor:
        return step_fn(tokens, targets)

    start = time.perf_counter()
    tried = what_if(model, opt, run_step, steps=WHAT_IF_STEPS)
    took = time.perf_counter() - start
    print(
        f"  what-if run ({WHAT_IF_STEPS} steps x 2 arms, once)          {took:8.2f} s = {took / step_s:.1f} plain steps"
        + (f" (failed: {tried.error})" if tried.error else "")
    )
    verdict = "PASS" if run <= 0.01 and curve_ok else "FAIL"
    print(f"update check {run:.2%} of a CPU step as paced (budget <= 1%)  {'PASS' if run <= 0.01 else 'FAIL'}")
    if args.trace_steps:
        traced = trace_row(lambda: (step_fn(tokens, targets), opt.step()), args.trace_steps, args.trace_rounds)
        said = "PASS" if traced <= 0.01 else "FAIL"
        verdict = verdict if said == "PASS" else said
        print(f"update checks under trace {traced:.2%} of a traced step (budget <= 1%)  {said}")
    return 0 if verdict == "PASS" else 1


def run_share(check_s: float, step_s: float, steps: int = RUN_STEPS) -> tuple[float, int]:
    """The check's share of a run of `steps` steps as the probe schedules it (measure.py): steps 1, 11
    and 21 (PACE_AFTER of them), then every `paced(EVERY, check, step)`-th; and that period."""
    gap = paced(EVERY, check_s, step_s)
    first = 1 + EVERY * (PACE_AFTER - 1)  # the last step measured at EVERY
    measured = PACE_AFTER + (steps - first) // gap
    return measured * check_s / (steps * step_s), gap


def curve_row(shape: Shape) -> tuple[float, float, int]:
    """The median plain step of a bf16 MLP of `shape` (CPU seconds), the update check's own time on a
    measured step (median), and the parameters it samples."""
    with threads(shape.threads):
        model, opt, step_fn = mlp_loop(shape, torch.bfloat16)
        probe = UpdateProbe(model, opt, every=EVERY)
        plain: list[float] = []
        check: list[float] = []
        for step in range(1, 2 * EVERY + 2):
            start = time.process_time()
            step_fn()
            if probe.due(step):
                t0 = time.process_time()
                sample = probe.before(step)
                t1 = time.process_time()
                opt.step()
                t2 = time.process_time()
                assert sample is not None
                probe.after(sample)
                probe.read(sample)
                check.append((t1 - t0) + (time.process_time() - t2))
            else:
                opt.step()
                plain.append(time.process_time() - start)
    return statistics.median(plain[1:]), statistics.median(check), len(probe.params)


def curve(quick: bool) -> bool:
    print(
        f"update check over a curve: bf16 MLPs, AdamW, CPU time; at every {EVERY}th step, and as paced over "
        f"{RUN_STEPS} steps (every {EVERY}th for the first {PACE_AFTER} measured steps, then as its cost sets)"
    )
    worst = (0.0, "")
    for shape in shapes(quick):
        step_s, check_s, params = curve_row(shape)
        label = f"{shape.label} ({params} sampled)"
        share = check_s / EVERY / step_s
        run, gap = run_share(check_s, step_s)
        worst = max(worst, (run, label))
        print(
            f"  {label:<66} plain {step_s * 1e3:8.3f} ms  check {check_s * 1e3:7.3f} ms on a measured "
            f"step  {share:7.2%} a step at every {EVERY}th; paced every {gap}th: {run:6.2%} a step",
            flush=True,
        )
    passed = worst[0] <= 0.01
    verdict = "PASS" if passed else "FAIL"
    print(f"update check as paced, worst point of the curve {worst[0]:.2%} ({worst[1]}) (budget <= 1%)  {verdict}")
    return passed


@contextlib.contextmanager
def _timed_hooks(spent: list[float]) -> Iterator[None]:
    """The checks' own work inside a traced step, timed: TraceUpdates' two optimizer hooks and the
    gradient hooks that sum a window's micro-batch gradients in fp32."""
    originals = {name: getattr(TraceUpdates, name) for name in ("_before", "_after")}
    adder = GradAccumulation._adder

    def timed(original: Callable[..., None]) -> Callable[..., None]:
        def hook(*args: Any) -> None:
            start = time.perf_counter()
            original(*args)
            spent.append(time.perf_counter() - start)

        return hook

    def timed_adder(self: GradAccumulation, i: int, p: torch.Tensor) -> Callable[[torch.Tensor], None]:
        return timed(adder(self, i, p))

    for name, original in originals.items():
        setattr(TraceUpdates, name, timed(original))
    GradAccumulation._adder = timed_adder  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(TraceUpdates, name, original)
        GradAccumulation._adder = adder  # type: ignore[method-assign]


@contextlib.contextmanager
def _without_checks() -> Iterator[None]:
    """trace as it is with its update hooks not installed."""
    enter = TraceUpdates.__enter__
    TraceUpdates.__enter__ = lambda self: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        TraceUpdates.__enter__ = enter  # type: ignore[method-assign]


def trace_row(step: Callable[[], Any], steps: int, rounds: int) -> float:
    """The checks' share of a traced step; prints the row."""
    blocks: dict[bool, list[float]] = {True: [], False: []}
    spent: list[float] = []
    with fpdoctor.trace():  # the first trace of the process works out its per-op paths: not timed
        step()
    for r in range(rounds):
        for checks in (True, False) if r % 2 == 0 else (False, True):
            with _timed_hooks(spent) if checks else _without_checks():
                start = time.perf_counter()
                with fpdoctor.trace():
                    for _ in range(steps):
                        step()
                blocks[checks].append(time.perf_counter() - start)
    with_s, without_s = statistics.median(blocks[True]) / steps, statistics.median(blocks[False]) / steps
    own_s = sum(spent) / (rounds * steps)
    share = own_s / without_s
    print(f"  under trace, {steps} steps per block, {rounds} blocks of each kind:")
    print(f"    traced step without the checks             {without_s * 1e3:8.2f} ms (block median / {steps})")
    print(f"    traced step with the checks                {with_s * 1e3:8.2f} ms ({with_s / without_s:.4f}x)")
    print(f"    the checks' own time per traced step       {own_s * 1e3:8.2f} ms = {share:.2%}")
    return share


if __name__ == "__main__":
    raise SystemExit(main())
