"""The budget of `fpdoctor watch`: <= 1% of a CPU training step of a small transformer.

The same loop (a 4-layer transformer of benchmarks/models.py, dim 256, 8 x 64 tokens, fp32, AdamW,
zero_grad / forward / cross-entropy / backward / step) runs plain and under `ScriptWatch` - what
`fpdoctor watch -- train.py` puts around a script - in interleaved rounds (plain, watched, plain
again, ...) so that the machine's drift hits each alike; per-step wall and CPU times, medians over
rounds of per-round medians. A second plain run ("plain again") shows the run-to-run noise the 1%
has to be read against. What the watch does per step: a global hook pair on every module call
(work only at top-level training calls), one hook per model output, the loss kept by reference,
one fused finite check over the gradients and one read of a few numbers.

`--device-skip`: a fused AdamW, and the watch's GPU path forced on the CPU (`device_skip=True`):
the optimizer is given the step's flag as its found_inf and the flags are read a step later; beside
it, the same optimizer watched with its flags read before the step ("watched, host read").

Run: python benchmarks/bench_watch.py [--rounds R] [--steps N] [--device-skip]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import batch, small_transformer

BUDGET = 1.01
WARM_UP = 2


def run(steps: int, watched: bool, fused: bool = False, device_skip: bool = False) -> tuple[float, float]:
    """(median wall, median CPU) seconds per step of one run."""
    from fpdoctor.integrations.script import ScriptWatch

    torch.manual_seed(0)
    model = small_transformer(layers=4, dim=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    tokens, targets = batch(size=8, length=64)
    loss_fn = nn.CrossEntropyLoss()
    walls, cpus = [], []
    watch = ScriptWatch(gpu_health=False, device_skip=device_skip if fused else None)
    with watch if watched else contextlib.nullcontext():
        for _ in range(steps + WARM_UP):
            wall, cpu = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            opt.step()
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return statistics.median(walls[WARM_UP:]), statistics.median(cpus[WARM_UP:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device-skip", action="store_true", help="fused AdamW, flags read a step later")
    args = parser.parse_args()
    variants = {"plain": (False, True), "watched": (True, True), "plain again": (False, True)}
    if args.device_skip:
        variants["watched, host read"] = (True, False)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (watched, deferred) in variants.items():
            results[name].append(run(args.steps, watched, args.device_skip, deferred))
    plain_wall = statistics.median(w for w, _ in results["plain"])
    plain_cpu = statistics.median(c for _, c in results["plain"])
    kind = "fused AdamW, device_skip" if args.device_skip else "AdamW"
    print(f"watch: {args.rounds} rounds x {args.steps} steps, 4-layer transformer dim 256, 8 x 64 tokens, {kind}")
    ok = True
    for name, rows in results.items():
        wall = statistics.median(w for w, _ in rows)
        cpu = statistics.median(c for _, c in rows)
        line = f"  {name:18s} {wall * 1e3:8.2f} ms/step wall ({wall / plain_wall:.4f}x)  {cpu * 1e3:8.2f} ms CPU"
        line += f" ({cpu / plain_cpu:.4f}x)"
        if name == "watched":
            passed = wall / plain_wall <= BUDGET
            ok = ok and passed
            line += f"  (budget {BUDGET:.2f}x: {'PASS' if passed else 'FAIL'})"
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
