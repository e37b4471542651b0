"""What keeping the last ops' arguments (numerics/engine/reruns.py's Window) costs a healthy trace.

The same traced training step with the window as the tracer keeps it, and with its append made a
no-op; interleaved step by step (A B, A B, ...) so that a shared machine's load hits both alike;
medians are compared. A healthy run runs no experiment: the window's append is all it pays.

Run: python benchmarks/bench_window.py [--steps N] [--layers L] [--dim D]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from models import batch, make_step, small_transformer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = small_transformer(layers=args.layers, dim=args.dim, heads=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer)
    tokens, targets = batch(size=4, length=32, device="cpu")

    def traced(window: bool) -> float:
        start = time.perf_counter()
        with fpdoctor.trace(model) as t:
            if not window:
                t.tracer._window.append = lambda step: None  # the tracer reads this attribute per op
            step_fn(tokens, targets)
            optimizer.step()
        assert not t.tracer.experiments
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {True: [], False: []}
    traced(True), traced(False)  # warm-up
    for _ in range(args.steps):
        for window in (True, False):
            times[window].append(traced(window))
    with_window, without = statistics.median(times[True]), statistics.median(times[False])
    print(f"traced step, window kept:   {with_window * 1e3:8.2f} ms (median of {args.steps})")
    print(f"traced step, no window:     {without * 1e3:8.2f} ms")
    print(f"cost of the window:         {100 * (with_window / without - 1):+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
