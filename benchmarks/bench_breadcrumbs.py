"""The budget of `fpdoctor run --breadcrumbs`: <= 25 us per aten op.

Training steps (forward, backward, AdamW step) with and without the breadcrumb recorder (the
dispatch mode, the global module and optimizer hooks and the ring writes of
fpdoctor.crash.breadcrumbs), next to the floors of the two ways Python can see every op: an
empty TorchDispatchMode (what the recorder is built on; it sees forward, backward and optimizer
aten ops) and an empty TorchFunctionMode (cheaper per call, but blind to backward and to what
composite ops dispatch). Variants are interleaved step by step (A B C D, A B C D, ...) so that
a shared machine's load drifts hit every variant alike; medians are compared. Per-op cost =
(variant - plain) / aten ops per step, the ops counted once by a counting dispatch mode.

On CPU the steps run on one torch thread and are timed by the thread's CPU clock
(time.thread_time), not the wall clock: on a shared 2-core machine a second intra-op thread that
loses its core to another process turns a 2 ms step into a 100 ms one, and a busy machine
stretches wall time by its load, either of which drowns a cost of a few microseconds per op;
what is measured (Python work per op) runs on the calling thread. CUDA steps are timed by the
wall clock around a synchronize.

Steps: on CPU the tiny transformer (per-op overhead dominates: the budget's worst case) and the
4-layer one of bench_numerics.py (compute-bound); with CUDA also a launch-bound small step and the
bf16 autocast step (dim 1024, 8 layers, 16 x 512 tokens).

Run: python benchmarks/bench_breadcrumbs.py [--steps N] [--rounds R] [--only cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fpdoctor.crash import breadcrumbs
from models import EmptyDispatch, batch, make_step, small_transformer

BUDGET_US = 25.0


class _NopFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _scenario(
    *, device: str, layers: int, dim: int, heads: int, size: int, length: int, run_dir: str, autocast: Any = None
) -> tuple[dict[str, Callable[[], None]], Callable[[], None], int]:
    torch.manual_seed(0)
    model = small_transformer(layers=layers, dim=dim, heads=heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer, autocast=autocast)
    tokens, targets = batch(size=size, length=length, device=device)

    def plain() -> None:
        step_fn(tokens, targets)
        optimizer.step()

    def dispatch_floor() -> None:
        with EmptyDispatch():
            plain()

    def function_floor() -> None:
        with _NopFunction():
            plain()

    def crumbs() -> None:
        with breadcrumbs.recording(run_dir):
            plain()

    counter = _Count()
    with counter:
        plain()
    variants = {
        "plain step": plain,
        "empty TorchFunctionMode": function_floor,
        "empty TorchDispatchMode": dispatch_floor,
        "breadcrumbs": crumbs,
    }
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return variants, sync, counter.ops


def _measure(
    variants: dict[str, Callable[[], None]], sync: Callable[[], None], n: int, clock: Callable[[], float]
) -> dict[str, float]:
    for fn in variants.values():  # warm-up: allocator, first-call overheads, the ring's first names
        fn()
        sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(n):
        for name, fn in variants.items():
            sync()
            start = clock()
            fn()
            sync()
            times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("cpu", "cuda"), help="run one device's scenarios")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = [
        ("CPU, tiny (per-op bound): 2 layers dim 32, 2 x 8 tokens", dict(layers=2, dim=32, heads=2, size=2, length=8)),
        ("CPU, 4-layer transformer dim 256, 8 x 64 tokens", dict(layers=4, dim=256, heads=4, size=8, length=64)),
    ]
    cuda = [
        ("CUDA launch-bound: 2 layers dim 128, 4 x 32 tokens", dict(layers=2, dim=128, heads=4, size=4, length=32)),
        (
            "CUDA bf16 autocast, 8 layers dim 1024, 16 x 512 tokens, AdamW",
            dict(layers=8, dim=1024, heads=16, size=16, length=512, autocast=torch.bfloat16),
        ),
    ]
    plan = []
    if args.only in (None, "cpu"):
        plan += [(label, "cpu", shape) for label, shape in cpu]
    if args.only in (None, "cuda") and torch.cuda.is_available():
        plan += [(label, "cuda", shape) for label, shape in cuda]
    ok = True
    n = args.rounds * args.steps
    with tempfile.TemporaryDirectory(prefix="fpdoctor-bench-") as run_dir:
        for label, device, shape in plan:
            variants, sync, ops = _scenario(device=device, run_dir=run_dir, **shape)
            clock = time.perf_counter if device == "cuda" else time.thread_time
            medians = _measure(variants, sync, n, clock)
            base = medians["plain step"]
            what = "wall" if device == "cuda" else f"thread CPU time, {torch.get_num_threads()} torch thread(s)"
            print(f"{label}: {ops} aten ops per step, {n} interleaved steps per variant, medians of {what}")
            for name, value in medians.items():
                per_op = (value - base) / ops * 1e6
                print(
                    f"  {name:<24} {value * 1e3:9.2f} ms/step  x{value / base:5.2f}  "
                    f"{ops / value / 1e3:8.1f} k ops/s  {per_op:+7.2f} us/op"
                )
            cost = (medians["breadcrumbs"] - base) / ops * 1e6
            own = (medians["breadcrumbs"] - medians["empty TorchDispatchMode"]) / ops * 1e6
            passed = cost <= BUDGET_US
            ok &= passed
            print(
                f"  breadcrumbs {cost:.2f} us/op (budget <= {BUDGET_US:.0f}) {'PASS' if passed else 'FAIL'}; "
                f"{own:.2f} us/op above the empty dispatch mode"
            )
    size = breadcrumbs.HEADER_SIZE + breadcrumbs.SLOTS * breadcrumbs.SLOT_SIZE + breadcrumbs.NAMES_CAPACITY
    print(f"ring file per process: {breadcrumbs.SLOTS} ops, {size / 2**20:.2f} MiB")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
