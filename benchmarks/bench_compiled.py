"""SPEC 5 budget of the compiled-graph checks: <= 5% of a compiled CPU training step, no recompilation.

A 2-layer transformer of benchmarks/models.py (dim 128, 8 x 64 tokens, fp32, AdamW, dropout off),
compiled with torch.compile (Inductor's C++ backend; `aot_eager` where Inductor cannot build here),
takes the same training step (zero_grad / compiled forward / cross-entropy / backward / step) in
interleaved rounds: plain, with the compiled-output checks (`numerics/compiled/step.py`'s OutputCheck,
what the sentinel, `watch` and the callbacks put on a compiled model: one fused finite check of
the compiled module's outputs per call, and one of each Dynamo graph's outputs per graph call
(`numerics/compiled/graphs.py`), left on the device) and plain again (the run-to-run noise). The graphs
are compiled while a check is open, as under the sentinel, so their callables carry the
per-graph wrapper in every variant: the plain rounds pay its closed cost too. Per-step wall
times, medians over rounds of per-round medians; the budget is read on the
check's own time inside the step (the interleaved walls show how large the machine's noise is).
Dynamo's count of compiled graphs is read before the measured rounds and after them: the check
adds none (it sits on the wrapper, outside what Dynamo traces and guards).

Run: python benchmarks/bench_compiled.py [--rounds R] [--steps N] [--backend inductor|aot_eager]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import batch, small_transformer

BUDGET = 1.05
WARM_UP = 2


def compile_model(backend: str) -> tuple[nn.Module, nn.Module, str]:
    """(model, compiled wrapper, backend used): Inductor if it builds here, else aot_eager."""
    torch.manual_seed(0)
    model = small_transformer(layers=2, dim=128, dropout=0.0)
    tokens, _ = batch(size=8, length=64)
    from fpdoctor.numerics.compiled.graphs import GraphCheck

    for name in dict.fromkeys([backend, "aot_eager"]):
        compiled = torch.compile(model, backend=name)
        check = GraphCheck()  # open while Dynamo compiles: each graph's callable gets its wrapper
        try:
            compiled(tokens).sum().backward()  # compiles forward and backward now, outside the timing
            model.zero_grad(set_to_none=True)
            if not check.graphs:
                raise SystemExit("no graph was seen compiled: the per-graph check is not measured")
            return model, compiled, name
        except Exception as exc:
            print(f"  backend {name} cannot run here ({type(exc).__name__}); trying aot_eager", file=sys.stderr)
            torch._dynamo.reset()
        finally:
            check.close()
    raise SystemExit("torch.compile cannot run here")


OWN: list[float] = []  # seconds the check itself took, per checked step


@contextlib.contextmanager
def output_check(compiled: nn.Module) -> Iterator[Callable[[], None]]:
    """The check on the compiled wrapper; its own time per step is added to OWN (the hook's work,
    timed inside the step: the share of the step is read without the machine's noise)."""
    from fpdoctor.numerics.compiled.step import OutputCheck

    check = OutputCheck(compiled)
    note, called = check.note, check.graphs._called
    spent = [0.0]

    def timed(name: str, output: object) -> None:
        start = time.perf_counter()
        note(name, output)
        spent[0] += time.perf_counter() - start

    def timed_graph(graph: object, args: object, out: object, flag: object) -> None:
        start = time.perf_counter()
        called(graph, args, out, flag)  # type: ignore[arg-type]
        spent[0] += time.perf_counter() - start

    check.note = timed  # type: ignore[method-assign]
    check.graphs._called = timed_graph  # type: ignore[method-assign]

    def begin() -> None:
        if spent[0]:
            OWN.append(spent[0])
        spent[0] = 0.0
        check.begin()

    try:
        yield begin
    finally:
        if not check.graphs._calls and not OWN:
            print("  the per-graph check saw no graph call", file=sys.stderr)
        check.close()


def run(compiled: nn.Module, opt: torch.optim.Optimizer, steps: int, variant: str) -> float:
    """The median wall seconds per step of one run."""
    tokens, targets = batch(size=8, length=64)
    loss_fn = nn.CrossEntropyLoss()

    def forward_backward() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(compiled(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        return loss

    walls = []
    with output_check(compiled) if variant == "checked" else contextlib.nullcontext(lambda: None) as begin:
        for _ in range(steps + WARM_UP):
            wall = time.perf_counter()
            begin()  # a new window: the sentinel's begin_window
            forward_backward()
            opt.step()
            walls.append(time.perf_counter() - wall)
    return statistics.median(walls[WARM_UP:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    from torch._dynamo.utils import counters

    model, compiled, backend = compile_model(args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    run(compiled, opt, 1, "plain")  # the optimizer's state, outside the timing
    graphs_before = counters["stats"]["unique_graphs"]
    variants = ("plain", "checked", "plain again")
    results: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            results[name].append(run(compiled, opt, args.steps, name.replace(" again", "")))
    graphs_after = counters["stats"]["unique_graphs"]
    plain = statistics.median(results["plain"])
    print(
        f"compiled-graph checks: backend {backend}, {args.rounds} rounds x {args.steps} steps, "
        "2-layer transformer dim 128, 8 x 64 tokens, AdamW"
    )
    for name, rows in results.items():
        wall = statistics.median(rows)
        print(f"  {name:12s} {wall * 1e3:8.2f} ms/step wall ({wall / plain:.4f}x)")
    own = statistics.median(OWN)
    ok = 1 + own / plain <= BUDGET
    verdict = "PASS" if ok else "FAIL"
    print(
        f"  the check's own time {own * 1e3:.3f} ms/step: {1 + own / plain:.4f}x plain "
        f"(budget {BUDGET:.2f}x: {verdict})"
    )
    recompiled = graphs_after - graphs_before
    ok = ok and recompiled == 0
    print(
        f"  graphs compiled during the measured rounds: {recompiled} (budget 0: {'PASS' if not recompiled else 'FAIL'})"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
