"""The budget of `fpdoctor watch`: <= 1% of a CPU training step, at the worst point of a curve.

What the watch adds per step grows with what it touches: module calls (its module hooks), parameter
tensors (the finite check over the gradients, the lists it gathers them in), gradient bytes (the
check's one pass). So the budget is read over a curve, not at one shape: MLPs of 10, 100 and 1000
parameter tensors (Linear(64, 64) layers, 64 rows a batch: module calls and tensors grow together),
one of 8 wide tensors (Linear(1024, 1024), where the pass over the gradient bytes shows), each with
foreach, fused and for-loop (`foreach=False`) AdamW, on one intra-op thread and on two; and the
4-layer transformer of models.py (dim 256, 8 x 64 tokens, AdamW, the default thread count).

Each row runs the same loop (zero_grad / forward / loss / backward / step) plain, under
`ScriptWatch` - what `fpdoctor watch -- train.py` puts around a script - and plain again, in
alternating rounds with fresh models, so that the machine's drift hits each alike. The ratio is the
median over rounds of each run's median CPU time per step (`time.process_time`: other processes'
load does not count, their cache pressure does), watched over plain; "plain again" over plain is the
run-to-run noise the 1% has to be read against. The verdict is the worst watched ratio of the curve.

`--device-skip`: the transformer with fused AdamW and the watch's GPU path forced on the CPU
(`device_skip=True`: the optimizer is given the step's flag as its found_inf, the flags are read a
step later), beside the same optimizer watched with its flags read before the step.

Run: python benchmarks/bench_watch.py [--quick] [--rounds R] [--device-skip]
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
from models import batch, mlp, small_transformer

BUDGET = 1.01
WARM_UP = 2
BLOCK_SECONDS = 0.1  # CPU time a block of steps aims at: its step count follows from a plain step's
OPTIMIZERS = {"foreach": {"foreach": True}, "fused": {"fused": True}, "for-loop": {"foreach": False}}

Step = Callable[[], None]
Watch = Callable[[], contextlib.AbstractContextManager[object]]


@dataclass(frozen=True)
class Row:
    model: str  # "mlp" or "transformer"
    tensors: int
    width: int
    optimizer: str  # a key of OPTIMIZERS
    threads: int

    @property
    def label(self) -> str:
        what = f"MLP {self.tensors:4d} tensors, width {self.width:4d}" if self.model == "mlp" else "transformer"
        return f"{what}, {self.optimizer} AdamW, {self.threads} thread{'s' if self.threads > 1 else ''}"


def loop(row: Row) -> Step:
    """One training step of a fresh model and optimizer."""
    torch.manual_seed(0)
    if row.model == "transformer":
        model = small_transformer(layers=4, dim=256)
        tokens, targets = batch(size=8, length=64)
        loss_fn = nn.CrossEntropyLoss()

        def loss() -> torch.Tensor:
            return loss_fn(model(tokens).flatten(0, 1), targets.flatten())

    else:
        model = mlp(row.tensors, row.width)
        x, y = torch.randn(64, row.width), torch.randn(64, row.width)

        def loss() -> torch.Tensor:
            return (model(x) - y).square().mean()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **OPTIMIZERS[row.optimizer])

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()

    return step


def measure(row: Row, blocks: int, watches: dict[str, Watch]) -> tuple[dict[str, float], float]:
    """Median CPU seconds per step of one model and optimizer without the watch ("plain") and
    under each of `watches`, in alternating blocks of steps (a watch is entered and left between
    blocks, outside the timed steps); and the noise: the plain steps of odd blocks over those of
    even ones, what 1% is read against."""
    saved = torch.get_num_threads()
    torch.set_num_threads(row.threads)
    try:
        step = loop(row)
        probe = []
        for _ in range(WARM_UP + 1):  # first-call costs, and how long a step takes
            start = time.process_time()
            step()
            probe.append(time.process_time() - start)
        per_block = max(3, min(20, round(BLOCK_SECONDS / max(probe[-1], 1e-4))))
        plain: list[list[float]] = []
        times: dict[str, list[float]] = {name: [] for name in watches}
        for _ in range(blocks):
            plain.append(_block(step, per_block, contextlib.nullcontext()))
            for name, watch in watches.items():
                times[name] += _block(step, per_block, watch())
    finally:
        torch.set_num_threads(saved)
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


def curve(quick: bool) -> list[Row]:
    rows = []
    counts = (10, 1000) if quick else (10, 100, 1000)
    kinds = ("foreach", "fused") if quick else tuple(OPTIMIZERS)
    for tensors in counts:
        rows += [Row("mlp", tensors, 64, kind, 1) for kind in kinds]
    rows += [Row("mlp", 8, 1024, kind, 1) for kind in kinds]
    if not quick:  # two threads: the step's own work halves where it parallelises, the watch's Python does not
        rows += [Row("mlp", 1000, 64, "foreach", 2), Row("mlp", 8, 1024, "foreach", 2)]
    rows.append(Row("transformer", 0, 256, "foreach", torch.get_num_threads()))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows, fewer blocks (about a minute)")
    parser.add_argument("--blocks", type=int, default=None, help="alternating block pairs per row (default 12)")
    parser.add_argument("--device-skip", action="store_true", help="the transformer, fused AdamW, flags a step later")
    args = parser.parse_args()
    blocks = args.blocks or (6 if args.quick else 12)
    if args.device_skip:
        return device_skip(blocks)
    print(f"watch: CPU time per step, {blocks} alternating blocks each, medians (torch {torch.__version__})")
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
    passed = worst[0] <= BUDGET
    print(
        f"watch overhead, worst point of the curve: x{worst[0]:.4f} ({worst[1]}); noise up to {noise:.1%} "
        f"(budget {BUDGET:.2f}x)  {'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


def device_skip(blocks: int) -> int:
    row = Row("transformer", 0, 256, "fused", torch.get_num_threads())
    m, noise = measure(row, blocks, {"watched (deferred)": watched(True), "watched, host read": watched(False)})
    print(f"watch --device-skip: transformer, fused AdamW, {blocks} alternating blocks, CPU time per step")
    for name, value in m.items():
        print(f"  {name:<20} {value * 1e3:8.2f} ms  x{value / m['plain']:.4f}")
    ratio = m["watched (deferred)"] / m["plain"]
    verdict = "PASS" if ratio <= BUDGET else "FAIL"
    print(f"watch (deferred) x{ratio:.4f}, noise x{noise:.4f} (budget {BUDGET:.2f}x)  {verdict}")
    return 0 if ratio <= BUDGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
