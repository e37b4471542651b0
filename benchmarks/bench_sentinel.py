"""The budget of the training sentinel, always on: <= 3% step time on CPU; on a GPU <= 1% with
an optimizer that skips on the device (fused: no host sync), <= 3% otherwise.

Each guarded variant is timed against the same step without the sentinel (same optimizer kind,
same precision), all interleaved in one run (A B C ..., A B C ...) so that the machine's load
drifts hit every variant alike; medians. torch.autograd.detect_anomaly is the anchor.
CPU always (the small transformer of benchmarks/models.py, fp32); the CUDA step (dim 1024, 8 layers,
16 x 512 tokens, bf16 autocast, AdamW) when a GPU is there.

On the GPU each round runs --cuda-steps (12) steps a variant: a round starts from an idle device,
and with a few steps the host's refilling of its launch queue would be most of what is timed. Beside
the variants, three unguarded "pattern" steps that each add one thing the sentinel does (the finite
check's pass over the gradients; a wait, at the next step's start, for the last backward - what
reading the verdict there costs; a host read before optimizer.step - what a foreach optimizer's guard
must do), so that a cost on the GPU can be told apart; no budget reads them.

On the GPU also the host synchronisations per step of every variant, counted by torch's sync
debug mode ("warn": one warning per synchronising call), and the guarded fused steps run under
torch.cuda.set_sync_debug_mode("error"): with a fused optimizer the sentinel adds none.

On the CPU also a curve over what moves the sentinel's per-step cost (`models.shapes`: the count of
parameter tensors, their width, the optimizer's kind, one or two threads): MLPs of 10, 100 and 1000
parameter tensors of width 64 and of 10 and 100 of width 512 (64 rows a batch), each with foreach,
fused and for-loop (`foreach=False`) AdamW on one intra-op thread, three of them on two; the same
model and optimizer stepped plain and through `Sentinel.step` in alternating blocks of steps,
medians of per-step CPU time (`time.process_time`); the gradient norm, every 10th step, is inside
them. The sampled work (the reference step, every 500th; the progress experiment, per flat window of
200 steps, doubling) is timed where it runs in a short run of its own (`models.SampledWork`) on
three shapes of the curve, spread over a run of 10,000 steps, every window taken for flat (the
worst case). The verdict: the curve's worst always-on ratio plus the worst sampled share.

The transformer section (CPU, and CUDA) stops adding rounds after SECTION_SECONDS (90 s) of wall
time, three rounds at least, as each curve row does after 20 s; its heading says how many ran.

Run: python benchmarks/bench_sentinel.py [--quick] [--rounds R] [--steps N] [--device cpu|cuda|all]
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

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fpdoctor
from fpdoctor.numerics.observe.gradcheck import grads_of, nonfinite_flag
from models import RUN_STEPS, SAMPLED_SHAPES, SampledWork, Shape, batch, mlp_loop, shapes, small_transformer, threads

# seconds spent inside the user's step_fn and optimizer.step per guarded variant: the rest of a
# guarded step's time is the sentinel's own, measured within the same steps (immune to the load
# drifts that move whole-step medians by a few percent on a shared machine)
_INNER: dict[str, float] = {}


def _timed(name: str, step_fn: Callable, opt: torch.optim.Optimizer) -> Callable:
    _INNER[name] = 0.0
    optimizer_step = opt.step

    def timed_step(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return optimizer_step(*args, **kwargs)
        finally:
            _INNER[name] += time.perf_counter() - start

    opt.step = timed_step  # type: ignore[method-assign]  # a benchmark's own optimizer

    def timed(*args: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return step_fn(*args)
        finally:
            _INNER[name] += time.perf_counter() - start

    return timed


def _variants(device: str, dim: int, layers: int, size: int, length: int) -> dict[str, Callable[[], None]]:
    tokens, targets = batch(size=size, length=length)
    tokens, targets = tokens.to(device), targets.to(device)
    # bf16 autocast on the GPU; fp32 on the CPU, where bf16 autocast is many times slower than fp32
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    loss_fn = nn.CrossEntropyLoss()

    def setup(kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = small_transformer(layers=layers, dim=dim, heads=max(4, dim // 64)).to(device)
        flag = {"foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, **flag)

    def step_of(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> Callable:
        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = model(tokens)
            loss = loss_fn(logits.float().flatten(0, 1), targets.flatten())
            (scaler.scale(loss) if scaler is not None else loss).backward()
            return loss

        return step

    variants: dict[str, Callable[[], None]] = {}
    for kind in ("foreach", "fused"):
        model, opt = setup(kind)
        plain = step_of(model, opt)

        def run_plain(plain: Callable = plain, opt: torch.optim.Optimizer = opt) -> None:
            plain(tokens, targets)
            opt.step()

        g_model, g_opt = setup(kind)
        guard = fpdoctor.Sentinel(g_model, g_opt)
        guarded = _timed(f"sentinel ({kind} AdamW)", step_of(g_model, g_opt), g_opt)
        variants[f"plain ({kind} AdamW)"] = run_plain
        variants[f"sentinel ({kind} AdamW)"] = lambda guard=guard, guarded=guarded: guard.step(guarded, tokens, targets)

    model, opt = setup("fused")
    scaler = torch.amp.GradScaler(device)
    scaled = step_of(model, opt, scaler)

    def run_scaled() -> None:
        scaled(tokens, targets)
        scaler.step(opt)
        scaler.update()

    g_model, g_opt = setup("fused")
    g_scaler = torch.amp.GradScaler(device)
    g_guard = fpdoctor.Sentinel(g_model, g_opt, scaler=g_scaler)
    g_scaled = _timed("sentinel (GradScaler, fused AdamW)", step_of(g_model, g_opt, g_scaler), g_opt)
    variants["plain (GradScaler, fused AdamW)"] = run_scaled
    variants["sentinel (GradScaler, fused AdamW)"] = lambda: g_guard.step(g_scaled, tokens, targets)

    a_model, a_opt = setup("foreach")
    a_step = step_of(a_model, a_opt)

    def anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True), contextlib.redirect_stderr(None):
            a_step(tokens, targets)
        a_opt.step()

    variants["detect_anomaly (foreach AdamW)"] = anomaly
    if device == "cuda":
        variants.update(_patterns(setup, step_of, tokens, targets))
    return variants


# Unguarded steps that each add one thing the sentinel does, to tell its costs apart on a GPU (no
# budget of their own; their names hold "pattern", and the verdicts never read them)
PATTERNS = (
    "pattern: plain fused + the finite check's pass",
    "pattern: plain fused + wait at next start",
    "pattern: plain foreach + host read before step",
)


def _patterns(
    setup: Callable, step_of: Callable, tokens: torch.Tensor, targets: torch.Tensor
) -> dict[str, Callable[[], None]]:
    checked, wait, read = (setup(kind) for kind in ("fused", "fused", "foreach"))
    steps = [step_of(*pair) for pair in (checked, wait, read)]
    device = next(checked[0].parameters()).device
    pending: list[torch.cuda.Event] = []

    def check() -> None:  # the device's work alone: one fused pass over the gradients, nothing read
        steps[0](tokens, targets)
        nonfinite_flag(grads_of(list(checked[0].parameters())), device)
        checked[1].step()

    def waits() -> None:  # the host stops running ahead: the verdict read before the next forward
        if pending:
            pending.pop().synchronize()
        steps[1](tokens, targets)
        event = torch.cuda.Event()
        event.record()
        pending.append(event)
        wait[1].step()

    def reads() -> None:  # what a foreach optimizer's guard must do: read the flag before stepping
        loss = steps[2](tokens, targets)
        torch.isfinite(loss).all().item()
        read[1].step()

    return dict(zip(PATTERNS, (check, waits, reads), strict=True))


# wall time after which the transformer section stops adding rounds (MIN_ROUNDS at least), as the
# curve's rows stop adding blocks: seven variants of a 0.2-0.4 s CPU step, 10 rounds of 3 steps,
# take a minute on a quiet 2-core machine and several where other jobs hold the cores
SECTION_SECONDS = 90.0
MIN_ROUNDS = 3


def measure(device: str, rounds: int, steps: int, **shape: int) -> tuple[dict[str, float], int]:
    return measure_variants(_variants(device, **shape), device, rounds, steps)


def measure_variants(
    variants: dict[str, Callable[[], None]], device: str, rounds: int, steps: int
) -> tuple[dict[str, float], int]:
    """Median seconds per step of each variant, over interleaved rounds of `steps` steps each, and
    the rounds that ran: at most `rounds`, fewer once SECTION_SECONDS of wall time have passed."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for fn in variants.values():  # warm-up: allocator, first-call overheads, the sentinel's first-step learning
        for _ in range(3):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name in _INNER:
        _INNER[name] = 0.0
    began = time.perf_counter()
    done = 0
    for _ in range(rounds):
        if done >= MIN_ROUNDS and time.perf_counter() - began > SECTION_SECONDS:
            break
        done += 1
        for name, fn in variants.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            sync()  # the step's device work counts, not just its launch
            times[name].append((time.perf_counter() - start) / steps)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, inner in _INNER.items():  # the sentinel's own time per step, as a variant of its own
        medians[f"{name}, own time"] = (sum(times[name]) * steps - inner) / (done * steps)
    return medians, done


def _rounds(done: int, asked: int) -> str:
    """How many rounds the section ran, and why fewer than asked."""
    if done == asked:
        return f"{done} round{'s' if done != 1 else ''}"
    return f"{done} of {asked} rounds (stopped after {SECTION_SECONDS:.0f} s of wall time)"


def host_syncs(variants: dict[str, Callable[[], None]], steps: int) -> dict[str, float]:
    """Synchronising CUDA calls per step of each variant, as torch's sync debug mode warns of them."""
    counts = {}
    for name, fn in variants.items():
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in caught) / steps
    return counts


def raises_on_sync(fn: Callable[[], None], steps: int) -> str | None:
    """The error torch raises when `fn` synchronises under set_sync_debug_mode("error"), else None."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            fn()
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return None


def cuda_syncs(variants: dict[str, Callable[[], None]], steps: int) -> bool:
    """The GPU row of host synchronisation: per-step counts of every variant, and the fused budget."""
    counts = host_syncs(variants, steps)
    print("CUDA host synchronisations per step (set_sync_debug_mode('warn')):")
    for name, count in counts.items():
        print(f"  {name:<50} {count:5.2f}")
    ok = True
    for kind in ("fused AdamW", "GradScaler, fused AdamW"):
        added = counts[f"sentinel ({kind})"] - counts[f"plain ({kind})"]
        error = raises_on_sync(variants[f"sentinel ({kind})"], steps)
        passed = added <= 0 and error is None
        ok &= passed
        raised = f"; under 'error' it raised: {error}" if error else ""
        print(
            f"CUDA sentinel ({kind}) host syncs added per step {added:+.2f} (budget <= 0, and none under the "
            f"'error' sync debug mode)  {'PASS' if passed else 'FAIL'}{raised}"
        )
    added = counts["sentinel (foreach AdamW)"] - counts["plain (foreach AdamW)"]
    print(f"CUDA sentinel (foreach AdamW) host syncs added per step {added:+.2f} (the flag read; no budget of its own)")
    return ok


def report(title: str, medians: dict[str, float]) -> dict[str, float]:
    print(title)
    ratios = {}
    for name, value in medians.items():
        base_name = (
            "plain (GradScaler, fused AdamW)"
            if "GradScaler" in name
            else "plain (fused AdamW)"
            if "fused" in name
            else "plain (foreach AdamW)"
        )
        ratio = value / medians[base_name]
        if name.endswith("own time"):
            print(f"    {name:<48} {value * 1e3:7.2f} ms/step   {ratio:6.2%} of the plain step")
            continue
        ratios[name] = ratio
        print(f"  {name:<50} {value * 1e3:7.2f} ms/step   x{ratio:5.3f}")
    return ratios


BLOCK_SECONDS = 0.1  # CPU time a block of steps aims at
ROW_SECONDS = 20.0  # wall time after which a row stops adding blocks (2 at least): the run stays bounded
SAMPLED_STEPS = 4  # the short run the sampled work is timed in: reference steps 1 and 4, an experiment at 3


def curve_row(shape: Shape, blocks: int) -> tuple[float, float]:
    """Median CPU seconds per step of one MLP and optimizer, plain and guarded, in alternating blocks
    (the first step of each block left out: the switch's cache effects)."""
    with threads(shape.threads):
        model, opt, step_fn = mlp_loop(shape)

        def plain() -> None:
            step_fn()
            opt.step()

        guard = fpdoctor.Sentinel(model, opt, gpu_health=False)
        variants = {"plain": plain, "sentinel": lambda: guard.step(step_fn)}
        for fn in variants.values():  # warm-up: first calls, the sentinel's first step (its reference step)
            for _ in range(3):
                fn()
        start = time.process_time()
        plain()
        per_block = max(3, min(20, round(BLOCK_SECONDS / max(time.process_time() - start, 1e-4))))
        times: dict[str, list[float]] = {name: [] for name in variants}
        began = time.perf_counter()
        for done in range(blocks):
            if done >= 2 and time.perf_counter() - began > ROW_SECONDS:  # a row whose threads wait on busy cores
                break
            for name, fn in variants.items():
                for i in range(per_block + 1):
                    start = time.process_time()
                    fn()
                    if i:
                        times[name].append(time.process_time() - start)
    return statistics.median(times["plain"]), statistics.median(times["sentinel"])


def sampled_row(shape: Shape) -> tuple[float, str]:
    """The sentinel's sampled work on `shape` per step over RUN_STEPS, as a share of a plain step."""
    with threads(shape.threads):
        model, opt, step_fn = mlp_loop(shape)
        guard = fpdoctor.Sentinel(model, opt, gpu_health=False)
        work = SampledWork(lambda: [guard._judge])
        with work as sampled:
            for _ in range(SAMPLED_STEPS):
                work.tick()
                guard.step(step_fn)
        plain = []
        for _ in range(5):
            start = time.process_time()
            step_fn()
            opt.step()
            plain.append(time.process_time() - start)
    step_s = statistics.median(plain)
    return sampled.per_step() / step_s, sampled.line(step_s)


def curve(quick: bool) -> bool:
    blocks = 3 if quick else 6
    print(f"CPU curve: MLPs, {blocks} alternating blocks, median CPU time per step")
    worst = (0.0, "")
    for shape in shapes(quick):
        plain, guarded = curve_row(shape, blocks)
        worst = max(worst, (guarded / plain, shape.label))
        print(
            f"  {shape.label:<52} plain {plain * 1e3:8.3f} ms  sentinel {guarded * 1e3:8.3f} ms  "
            f"x{guarded / plain:.4f}  (+{(guarded - plain) * 1e6:5.0f} us)",
            flush=True,
        )
    print(f"CPU sentinel always-on, worst point of the curve x{worst[0]:.4f} ({worst[1]})")
    print(f"sampled work, timed where it runs, in plain steps of the same loop (over {RUN_STEPS} steps):")
    share = 0.0
    for shape in SAMPLED_SHAPES:
        row_share, line = sampled_row(shape)
        share = max(share, row_share)
        print(f"  {shape.label:<52} {line}", flush=True)
    total = worst[0] + share
    passed = total <= 1.03
    verdict = "PASS" if passed else "FAIL"
    print(
        f"CPU sentinel, worst always-on x{worst[0]:.4f} + worst sampled {share:.2%} = x{total:.4f} (budget <= 3%)  "
        f"{verdict}"
    )
    return passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    parser.add_argument(
        "--cuda-steps",
        type=int,
        default=12,
        help="steps per variant per round on the GPU: each round starts from an idle device, and a few "
        "steps would time how fast the host fills its queue again, not the steady state",
    )
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="fewer rows of the CPU curve")
    args = parser.parse_args()
    ok = True
    if args.device in ("cpu", "all"):
        ok &= curve(args.quick)
        shape = {"dim": 256, "layers": 4, "size": 8, "length": 64}
        medians, done = measure("cpu", args.rounds, args.steps, **shape)
        ratios = report(
            f"CPU: 4-layer transformer (dim 256, 8 x 64 tokens), fp32, {_rounds(done, args.rounds)} x "
            f"{args.steps} interleaved steps (at most {SECTION_SECONDS:.0f} s, {MIN_ROUNDS} rounds at least), "
            f"medians, ratio to the same step unguarded",
            medians,
        )
        worst = max(v for k, v in ratios.items() if k.startswith("sentinel"))
        verdict = "PASS" if worst <= 1.03 else "FAIL"
        print(f"CPU sentinel overhead, worst variant {worst - 1:+.1%} (budget <= 3%)  {verdict}")
        ok &= worst <= 1.03
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        shape = {"dim": 1024, "layers": 8, "size": 16, "length": 512}
        variants = _variants("cuda", **shape)
        medians, done = measure_variants(variants, "cuda", args.rounds, args.cuda_steps)
        ratios = report(
            f"CUDA ({torch.cuda.get_device_name()}): 8-layer transformer (dim 1024, 16 x 512 tokens), bf16 autocast, "
            f"{_rounds(done, args.rounds)} x {args.cuda_steps} interleaved steps (at most {SECTION_SECONDS:.0f} s)",
            medians,
        )
        fused = max(ratios["sentinel (fused AdamW)"], ratios["sentinel (GradScaler, fused AdamW)"])
        foreach = ratios["sentinel (foreach AdamW)"]
        print(f"CUDA fused (device-side skip) {fused - 1:+.1%} (budget <= 1%)  {'PASS' if fused <= 1.01 else 'FAIL'}")
        print(f"CUDA foreach (host read) {foreach - 1:+.1%} (budget <= 3%)  {'PASS' if foreach <= 1.03 else 'FAIL'}")
        ok &= fused <= 1.01 and foreach <= 1.03
        ok &= cuda_syncs(variants, args.cuda_steps)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
