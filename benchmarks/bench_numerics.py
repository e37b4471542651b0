"""The budget for the op-level trace, on transformer training steps (forward, backward, optimizer).

- full op-level trace <= 1.5x a plain step on CPU and on compute-bound GPU steps
- and <= 1.3x the empty-dispatch-mode floor measured in the same run, everywhere
Next to torch.autograd.detect_anomaly. Variants are interleaved step by step (A B C D, A B C D, ...)
so that a shared machine's load drifts hit every variant alike; medians are compared.

Steps: on CPU always the small transformer (compute-bound), a tiny one (per-op overhead
dominates) and the CUDA launch-bound shape; with CUDA also a bf16-autocast AdamW step (dim 1024,
8 layers, 16 x 512 tokens) and a launch-bound small one. The sentinel's budget is measured by bench_sentinel.py.
On CPU the trace also runs its deferred check (`immediate=False`), the path every op takes on a
GPU (ranges kept on the device, read a batch of ops at a time), so that its host cost per op is
measured where no GPU is: printed beside the immediate one, without a verdict of its own (on a
CPU the immediate check is the one users get; on a GPU the CUDA rows judge it).

Run: python benchmarks/bench_numerics.py [--steps N] [--rounds R] [--only cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from models import EmptyDispatch, batch, make_step, small_transformer

DEFERRED = "trace, deferred (GPU's)"


class _CountOps(TorchDispatchMode):
    """Ops a step runs, as a dispatch mode sees them: what the trace's per-op cost is divided by."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _ops_per_step(step: Callable[[], None]) -> int:
    step()  # the optimizer's state made: the ops of a steady step
    with _CountOps() as counted:
        step()
    return counted.ops


def _scenario(
    label: str, *, device: str, layers: int, dim: int, heads: int, size: int, length: int, autocast: Any = None
) -> tuple[str, dict[str, Callable[[], None]], Callable[[], None]]:
    torch.manual_seed(0)
    model = small_transformer(layers=layers, dim=dim, heads=heads).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer, autocast=autocast)
    tokens, targets = batch(size=size, length=length, device=device)

    def plain() -> None:
        step_fn(tokens, targets)
        optimizer.step()

    def floor() -> None:
        with EmptyDispatch():
            plain()

    def traced() -> None:
        with fpdoctor.trace(model):
            plain()

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True), contextlib.redirect_stderr(None):
            plain()

    def deferred() -> None:
        with fpdoctor.Trace(model, immediate=False):
            plain()

    variants = {
        "plain step": plain,
        "empty dispatch mode": floor,
        "trace (fwd+bwd+opt)": traced,
        "detect_anomaly": anomaly,
    }
    if device == "cpu":  # on a GPU `traced` is the deferred check already
        variants[DEFERRED] = deferred
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return label, variants, sync


def _measure(variants: dict[str, Callable[[], None]], sync: Callable[[], None], n: int) -> dict[str, float]:
    for fn in variants.values():  # warm-up: allocator, first-call overheads, lazy imports
        fn()
        sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(n):
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=("cpu", "cuda"), help="run one device's scenarios")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")

    cpu = [
        ("CPU, 4-layer transformer dim 256, 8 x 64 tokens", dict(layers=4, dim=256, heads=4, size=8, length=64)),
        (
            "CPU, tiny (per-op overhead bound): 2 layers dim 32, 2 x 8 tokens",
            dict(layers=2, dim=32, heads=2, size=2, length=8),
        ),
        (
            "CPU, the CUDA launch-bound shape: 2 layers dim 128, 4 x 32 tokens",
            dict(layers=2, dim=128, heads=4, size=4, length=32),
        ),
    ]
    cuda = [
        (
            "CUDA bf16 autocast, 8 layers dim 1024, 16 x 512 tokens, AdamW",
            dict(layers=8, dim=1024, heads=16, size=16, length=512, autocast=torch.bfloat16),
        ),
        ("CUDA launch-bound: 2 layers dim 128, 4 x 32 tokens", dict(layers=2, dim=128, heads=4, size=4, length=32)),
    ]
    scenarios = []
    if args.only in (None, "cpu"):
        scenarios += [_scenario(label, device="cpu", **shape) for label, shape in cpu]
    if args.only in (None, "cuda") and torch.cuda.is_available():
        scenarios += [_scenario(label, device="cuda", **shape) for label, shape in cuda]
    ok = True
    n = args.rounds * args.steps
    ops = {label: _ops_per_step(variants["plain step"]) for label, variants, _ in scenarios if DEFERRED in variants}
    for label, variants, sync in scenarios:
        medians = _measure(variants, sync, n)
        base, floor = medians["plain step"], medians["empty dispatch mode"]
        trace = medians["trace (fwd+bwd+opt)"]
        print(f"{label}: {n} interleaved steps per variant, medians")
        for name, value in medians.items():
            print(f"  {name:<24} {value * 1e3:9.2f} ms/step   x{value / base:5.2f} plain   x{value / floor:5.2f} floor")
        compute_bound = "tiny" not in label and "launch-bound" not in label
        ok_floor = trace / floor <= 1.3
        line = f"  trace / floor {trace / floor:.2f}x (budget <= 1.3x) {'PASS' if ok_floor else 'FAIL'}"
        ok &= ok_floor
        if compute_bound:
            ok_plain = trace / base <= 1.5
            line += f"; trace / plain {trace / base:.2f}x (budget <= 1.5x) {'PASS' if ok_plain else 'FAIL'}"
            ok &= ok_plain
        print(line)
        if DEFERRED in medians:
            deferred = medians[DEFERRED]
            print(
                f"  deferred (the GPU's path) on CPU: trace / floor {deferred / floor:.2f}x beside the immediate"
                f" {trace / floor:.2f}x; {(deferred - floor) / ops[label] * 1e6:.1f} us per op above the floor"
                f" ({ops[label]} ops a step; no budget of its own on CPU)"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
