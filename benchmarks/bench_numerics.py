"""SPEC 5 budgets for the numerics tools, on a small transformer training step (CPU).

- training sentinel, always on: <= 3% step-time overhead
- full op-level trace (forward + backward): <= 1.5x step time
Both next to torch.autograd.detect_anomaly, all measured in one run, interleaved.

Run: python benchmarks/bench_numerics.py [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from models import batch, make_step, small_transformer


class _NopMode(TorchDispatchMode):
    """The floor any dispatch-mode tracer pays (the issue measured 1.15x for it on its machine)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = small_transformer(dim=args.dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer)
    tokens, targets = batch(length=args.length)
    guard = fpdoctor.Sentinel(model, optimizer)

    def plain() -> None:
        step_fn(tokens, targets)
        optimizer.step()

    def sentinel() -> None:
        guard.step(step_fn, tokens, targets)

    def traced() -> None:
        with fpdoctor.trace(model):
            step_fn(tokens, targets)
        optimizer.step()

    def traced_headroom() -> None:
        with fpdoctor.trace(model, headroom=True):
            step_fn(tokens, targets)
        optimizer.step()

    def nop() -> None:
        with _NopMode():
            step_fn(tokens, targets)
        optimizer.step()

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True), contextlib.redirect_stderr(None):
            step_fn(tokens, targets)
        optimizer.step()

    variants = {
        "plain step": plain,
        "empty dispatch mode": nop,
        "sentinel": sentinel,
        "trace (fwd+bwd)": traced,
        "trace + headroom": traced_headroom,
        "detect_anomaly": anomaly,
    }
    for fn in variants.values():  # warm-up: allocator, first-call overheads
        fn()
    # Interleave single steps (A B C D E, A B C D E, ...) so that the shared machine's load drifts
    # hit every variant alike; compare medians.
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds * args.steps):
        for name, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["plain step"])
    print(
        f"4-layer transformer (dim {args.dim}, 8 x {args.length} tokens) training step on CPU, "
        f"{args.rounds * args.steps} interleaved steps per variant, medians"
    )
    for name, values in times.items():
        print(f"  {name:<18} {statistics.median(values) * 1e3:8.2f} ms/step   x{statistics.median(values) / base:5.2f}")
    sentinel_overhead = statistics.median(times["sentinel"]) / base - 1
    trace_ratio = statistics.median(times["trace (fwd+bwd)"]) / base
    ok_sentinel = sentinel_overhead <= 0.03
    ok_trace = trace_ratio <= 1.5
    print(f"sentinel overhead {sentinel_overhead:+.1%} (budget <= 3%)  {'PASS' if ok_sentinel else 'FAIL'}")
    print(f"trace / plain {trace_ratio:.2f}x (budget <= 1.5x)  {'PASS' if ok_trace else 'FAIL'}")
    return 0 if ok_sentinel and ok_trace else 1


if __name__ == "__main__":
    sys.exit(main())
