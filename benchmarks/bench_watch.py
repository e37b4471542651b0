"""The budget of `fpdoctor watch`: <= 1% of a CPU training step, at the worst point of a curve.

What the watch adds per step grows with what it touches: module calls (its module hooks), parameter
tensors (the finite check over the gradients, the lists it gathers them in), gradient bytes (the
check's one pass). So the budget is read over a curve, not at one shape (`models.shapes`): MLPs of
10, 100 and 1000 parameter tensors of width 64 and of 10 and 100 of width 512 (64 rows a batch:
module calls and tensors grow together), each with foreach, fused and for-loop (`foreach=False`)
AdamW on one intra-op thread, three of them on two; and the 4-layer transformer of models.py
(dim 256, 8 x 64 tokens, AdamW, the default thread count).

Each row runs the same loop (zero_grad / forward / loss / backward / step) plain and under
`ScriptWatch` - what `fpdoctor watch -- train.py` puts around a script - in alternating blocks of
steps, so that the machine's drift hits each alike. The always-on cost is the median CPU time per
step (`time.process_time`: other processes' load does not count, their cache pressure does),
watched over plain; the plain steps of odd blocks over even ones are the noise it is read against.

The sampled work is measured apart, where it runs (`models.SampledWork`: made due every 3rd step in
a short watched run of its own) on three MLPs of the curve and the transformer: the reference step
(steps 1, 501, 1001, ...: --reference-every) and the progress experiment (per flat window of 200
finite steps, the window doubling after each: at most 5 in 10,000 steps; every window taken for flat
here, the worst case), in plain steps of the same loop and spread over a run of 10,000 steps. The
update checks run for low-precision weights only (`bench_updates.py`); these MLPs are fp32. The
verdict: the curve's worst always-on ratio plus the worst sampled share.

`--device-skip`: the transformer with fused AdamW and the watch's GPU path forced on the CPU
(`device_skip=True`: the optimizer is given the step's flag as its found_inf, the flags are read a
step later), beside the same optimizer watched with its flags read before the step.

`--device cuda`: on a GPU, the bf16 autocast transformer of bench_sentinel.py (dim 1024, 8 layers,
16 x 512 tokens) with foreach and with fused AdamW, plain and watched in alternating blocks of steps,
wall time per step with the device synchronised at each block's ends (the device's work counts, not
its launch), medians; the budget is the spec's 1%, and the watch adds no host sync (the GPU tests).

Run: python benchmarks/bench_watch.py [--quick] [--blocks B] [--device-skip] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import (
    OPTIMIZERS,
    RUN_STEPS,
    SAMPLED_SHAPES,
    Sampled,
    SampledWork,
    Shape,
    batch,
    mlp_loop,
    shapes,
    small_transformer,
    threads,
)

BUDGET = 1.01
WARM_UP = 2
BLOCK_SECONDS = 0.1  # CPU time a block of steps aims at: its step count follows from a plain step's
ROW_SECONDS = 20.0  # wall time after which a row stops adding blocks (2 at least): the run stays bounded
SAMPLED_STEPS = 4  # the short run the sampled work is timed in: reference steps 1 and 4, an experiment at 3

Step = Callable[[], None]
Watch = Callable[[], contextlib.AbstractContextManager[object]]


@dataclass(frozen=True)
class Transformer:
    optimizer: str
    threads: int
    label = "transformer (dim 256, 4 layers, 8 x 64 tokens), foreach AdamW, default threads"


Row = Shape | Transformer


def loop(row: Row) -> Step:
    """One training step of a fresh model and optimizer."""
    if isinstance(row, Shape):
        _, opt, step_fn = mlp_loop(row)
    else:
        torch.manual_seed(0)
        model = small_transformer(layers=4, dim=256)
        tokens, targets = batch(size=8, length=64)
        loss_fn = nn.CrossEntropyLoss()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[row.optimizer])

        def step_fn() -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(tokens).flatten(0, 1), targets.flatten())
            loss.backward()
            return loss

    def step() -> None:
        step_fn()
        opt.step()

    return step


def measure(row: Row, blocks: int, watches: dict[str, Watch]) -> tuple[dict[str, float], float]:
    """Median CPU seconds per step of one model and optimizer without the watch ("plain") and
    under each of `watches`, in alternating blocks of steps (a watch is entered and left between
    blocks, outside the timed steps); and the noise: the plain steps of odd blocks over those of
    even ones, what 1% is read against."""
    with threads(row.threads):
        step = loop(row)
        probe = []
        for _ in range(WARM_UP + 1):  # first-call costs, and how long a step takes
            start = time.process_time()
            step()
            probe.append(time.process_time() - start)
        per_block = max(3, min(20, round(BLOCK_SECONDS / max(probe[-1], 1e-4))))
        plain: list[list[float]] = []
        times: dict[str, list[float]] = {name: [] for name in watches}
        began = time.perf_counter()
        for done in range(blocks):
            if done >= 2 and time.perf_counter() - began > ROW_SECONDS:  # a row whose threads wait on busy cores
                break
            plain.append(_block(step, per_block, contextlib.nullcontext()))
            for name, watch in watches.items():
                times[name] += _block(step, per_block, watch())
    odd, even = [t for b in plain[0::2] for t in b], [t for b in plain[1::2] for t in b]
    medians = {"plain": statistics.median([t for b in plain for t in b])}
    medians.update({name: statistics.median(values) for name, values in times.items()})
    return medians, statistics.median(odd) / statistics.median(even) if even else 1.0


def _block(step: Step, steps: int, context: contextlib.AbstractContextManager[object]) -> list[float]:
    """CPU seconds of each step of a block but its first (the switch's cache effects)."""
    cpus = []
    with context:
        for _ in range(steps + 1):
            start = time.process_time()
            step()
            cpus.append(time.process_time() - start)
    return cpus[1:]


def watched(device_skip: bool | None = None) -> Watch:
    """One `ScriptWatch` for the whole row, entered for each watched block: the optimizer's judge
    (made at its first watched step) carries over from block to block, as in one long run."""
    from fpdoctor.integrations.script import ScriptWatch

    watch = ScriptWatch(gpu_health=False, device_skip=device_skip)
    return lambda: watch


def sampled(row: Row) -> Sampled:
    """The watch's sampled work on `row`, timed where it runs, in a short watched run of its own."""
    from fpdoctor.integrations.script import ScriptWatch

    with threads(row.threads):
        step = loop(row)
        watch = ScriptWatch(gpu_health=False)
        work = SampledWork(lambda: [run.judge for run in watch.runs.values()])
        with watch, work as out:
            for _ in range(SAMPLED_STEPS):
                step()
                work.tick()
    return out


def curve(quick: bool) -> list[Row]:
    return [*shapes(quick), Transformer("foreach", torch.get_num_threads())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the curve's corners, fewer blocks (about a minute)")
    parser.add_argument("--blocks", type=int, default=None, help="alternating block pairs per row (default 6)")
    parser.add_argument("--device-skip", action="store_true", help="the transformer, fused AdamW, flags a step later")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the GPU section alone")
    args = parser.parse_args()
    blocks = args.blocks or (3 if args.quick else 6)
    if args.device == "cuda":
        return on_cuda(blocks)
    if args.device_skip:
        return device_skip(blocks)
    print(
        f"watch: CPU time per step, {blocks} alternating blocks each, medians (torch {torch.__version__}); "
        f"sampled: its work spread over a run of {RUN_STEPS} steps"
    )
    worst: tuple[float, str] = (0.0, "")
    noise = 0.0
    for row in curve(args.quick):
        m, row_noise = measure(row, blocks, {"watched": watched()})
        ratio = m["watched"] / m["plain"]
        worst = max(worst, (ratio, row.label))
        noise = max(noise, abs(row_noise - 1))
        print(
            f"  {row.label:<52} plain {m['plain'] * 1e3:8.3f} ms  watched {m['watched'] * 1e3:8.3f} ms  "
            f"x{ratio:.4f}  (+{(m['watched'] - m['plain']) * 1e6:5.0f} us; noise x{row_noise:.4f})",
            flush=True,
        )
    print(f"watch always-on, worst point of the curve: x{worst[0]:.4f} ({worst[1]})")
    print(f"sampled work, timed where it runs, in plain steps of the same loop (over {RUN_STEPS} steps):")
    share = 0.0
    for row in [*SAMPLED_SHAPES, Transformer("foreach", torch.get_num_threads())]:
        m, _ = measure(row, 1, {})
        work = sampled(row)
        share = max(share, work.per_step() / m["plain"])
        print(f"  {row.label:<52} {work.line(m['plain'])}", flush=True)
    total = worst[0] + share
    passed = total <= BUDGET
    print(
        f"watch overhead, worst always-on x{worst[0]:.4f} + worst sampled {share:.2%} = x{total:.4f}; noise up "
        f"to {noise:.1%} (budget {BUDGET:.2f}x)  {'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


def device_skip(blocks: int) -> int:
    row = Transformer("fused", torch.get_num_threads())
    m, noise = measure(row, blocks, {"watched (deferred)": watched(True), "watched, host read": watched(False)})
    print(f"watch --device-skip: transformer, fused AdamW, {blocks} alternating blocks, CPU time per step")
    for name, value in m.items():
        print(f"  {name:<20} {value * 1e3:8.2f} ms  x{value / m['plain']:.4f}")
    ratio = m["watched (deferred)"] / m["plain"]
    verdict = "PASS" if ratio <= BUDGET else "FAIL"
    print(f"watch (deferred) x{ratio:.4f}, noise x{noise:.4f} (budget {BUDGET:.2f}x)  {verdict}")
    return 0 if ratio <= BUDGET else 1


CUDA_STEPS = 3  # steps per block on the GPU: a step is tens of milliseconds


def on_cuda(blocks: int) -> int:
    if not torch.cuda.is_available():
        print("watch --device cuda: no CUDA device here; nothing measured")
        return 0
    from fpdoctor.integrations.script import ScriptWatch

    tokens, targets = batch(size=16, length=512)
    tokens, targets = tokens.cuda(), targets.cuda()
    loss_fn = nn.CrossEntropyLoss()
    print(
        f"watch on {torch.cuda.get_device_name()}: 8-layer transformer (dim 1024, 16 x 512 tokens), bf16 autocast, "
        f"{blocks} alternating blocks of {CUDA_STEPS} steps, wall time per step, medians"
    )
    ok = True
    for kind in ("foreach", "fused"):
        torch.manual_seed(0)
        model = small_transformer(layers=8, dim=1024, heads=16).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[kind])

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(tokens)
            loss_fn(logits.float().flatten(0, 1), targets.flatten()).backward()
            opt.step()

        watch = ScriptWatch(gpu_health=False)
        for context in (contextlib.nullcontext(), watch):  # warm-up: first calls, the judge's first step
            with context:
                for _ in range(WARM_UP + 1):
                    step()
        times: dict[str, list[float]] = {"plain": [], "watched": []}
        for _ in range(blocks):
            for name, context in (("plain", contextlib.nullcontext()), ("watched", watch)):
                with context:
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(CUDA_STEPS):
                        step()
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / CUDA_STEPS)
        plain, watched_ = statistics.median(times["plain"]), statistics.median(times["watched"])
        ratio = watched_ / plain
        ok &= ratio <= BUDGET
        print(
            f"  {kind} AdamW: plain {plain * 1e3:7.2f} ms  watched {watched_ * 1e3:7.2f} ms  "
            f"{(ratio - 1) * 100:+.1f}% (budget <= {(BUDGET - 1) * 100:.0f}%)  {'PASS' if ratio <= BUDGET else 'FAIL'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
