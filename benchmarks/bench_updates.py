"""Training-precision budget: the sampled update check <= 1% of a CPU training step.

A bf16 small transformer (benchmarks/models.py, bf16 weights, AdamW) steps on the CPU; every step is
timed plain, and on the measured steps (every `EVERY`-th, as the sentinel does) the check's own time
is taken within the same step: the gathers and the fp32 shadow step before `optimizer.step()`, the
gathers, reductions and the one read back after. Its cost per step is that time divided by EVERY,
against the median plain step of the same run. The what-if run (fp32 master weights, 8 steps, once
per run) is timed beside it as a multiple of a plain step.

Run: python benchmarks/bench_updates.py [--steps N] [--layers L] [--dim D]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fpdoctor.numerics.update_whatif import WHAT_IF_STEPS, what_if
from fpdoctor.numerics.updates import EVERY, UpdateProbe
from models import batch, make_step, small_transformer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    args = parser.parse_args()
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
    print(
        f"bf16 transformer, {args.layers} layers, dim {args.dim}, 8 x 64 tokens, AdamW; {len(probe.params)} parameters"
    )
    print(f"  plain step (forward, backward, AdamW)        {step_s * 1e3:8.2f} ms (median of {len(plain) - 2})")
    print(f"  update check on a measured step              {measured_s * 1e3:8.2f} ms (median of {len(check)})")
    print(f"  per step, measured every {EVERY}th                {share:8.2%} of the plain step")

    def run_step() -> torch.Tensor:
        return step_fn(tokens, targets)

    start = time.perf_counter()
    tried = what_if(model, opt, run_step, steps=WHAT_IF_STEPS)
    took = time.perf_counter() - start
    print(
        f"  what-if run ({WHAT_IF_STEPS} steps x 2 arms, once)          {took:8.2f} s = {took / step_s:.1f} plain steps"
        + (f" (failed: {tried.error})" if tried.error else "")
    )
    verdict = "PASS" if share <= 0.01 else "FAIL"
    print(f"update check {share:.2%} of a CPU step (budget <= 1%)  {verdict}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
