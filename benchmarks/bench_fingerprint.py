"""The budget for GEMM fingerprints: <= 10 s per node; on a GPU the bf16 fingerprint GEMMs at
>= 90% of the throughput of a plain torch.mm of the same shape, measured in the same run.

Two parts:
- wall time of `run_fingerprints(duration)` as `fpdoctor health` calls it (children, one per
  device, in parallel), for a few durations: what it costs beyond the asked-for seconds;
- bf16 throughput side by side in this process: the fingerprint loop (deterministic settings,
  every product digested on the device) against plain `torch.mm` of the same operands with
  torch's defaults, rounds interleaved (plain, fingerprint, plain, ...) so a shared machine's
  load drifts hit both alike; medians compared. On a CPU the shape is the CPU fingerprint's
  (tiny: CPU ranks share cores), where the digest weighs far more than on a GPU.

Run: python benchmarks/bench_fingerprint.py [--durations 0 1 3] [--rounds 5] [--device cpu|cuda] [--shape MN K]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fpdoctor.health import gemm
from fpdoctor.health.fingerprint import run_fingerprints

NODE_BUDGET_S = 10.0  # the whole fingerprint run of one node
GPU_THROUGHPUT = 0.9  # the bf16 fingerprint loop against plain torch.mm, on a GPU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_tflops(device: torch.device, mn: int, k: int, repeats: int) -> float:
    """bf16 torch.mm of the fingerprint's operands, torch's default settings, no digest."""
    torch.use_deterministic_algorithms(False)
    a, b = gemm.seeded_operands("bf16", device, mn, k)
    torch.mm(a, b)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.mm(a, b)
    _sync(device)
    return 2.0 * mn * k * mn * repeats / (time.perf_counter() - start) / 1e12


def fingerprint_tflops(device: torch.device, mn: int, k: int, budget_s: float) -> tuple[float, int]:
    gemm.deterministic(device)
    result = gemm.seeded("bf16", device, mn, k, budget_s)
    return result["tflops"], result["repeats"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--durations", type=float, nargs="+", default=[0.0, 1.0, 3.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shape",
        type=int,
        nargs=2,
        metavar=("MN", "K"),
        help="bf16 shape of the throughput comparison (default: the fingerprint's own for the device); "
        "the digest's share falls as K grows",
    )
    args = parser.parse_args()
    device = torch.device(args.device if args.device == "cpu" else "cuda:0")
    nodes = "every GPU of this node" if device.type == "cuda" else "the CPU"
    print(f"run_fingerprints on {nodes} (children in parallel), wall time:")
    ok = True
    for duration in args.durations:
        start = time.perf_counter()
        result = run_fingerprints(duration, device=None if device.type == "cuda" else "cpu")
        wall = time.perf_counter() - start
        verdicts = ",".join(sorted({r["verdict"] for r in result.rows})) or "-"
        ok &= wall <= NODE_BUDGET_S
        print(
            f"  --duration {duration:4.1f}: {wall:6.2f} s wall (budget <= {NODE_BUDGET_S:.0f} s per node)  "
            f"{'PASS' if wall <= NODE_BUDGET_S else 'FAIL'}; {wall - duration:5.2f} s beyond the duration, "
            f"{len(result.rows)} device(s), verdicts {verdicts}, {len(result.findings)} finding(s)"
        )
        for row in result.rows:  # the node's wall time, split: the child's start-up against its GEMMs
            seconds = row.get("detail", {}).get("seconds")
            if seconds:
                print(f"    {row['device']}: start-up {seconds['start-up']:.2f} s, GEMMs {seconds['work']:.2f} s")
    shapes = gemm.GPU_SHAPES if device.type == "cuda" else gemm.CPU_SHAPES
    mn, k = args.shape or (shapes.mn, shapes.k["bf16"])
    budget = 1.0 if device.type == "cuda" else 0.3
    plain, fp = [], []
    for _ in range(args.rounds):
        value, repeats = fingerprint_tflops(device, mn, k, budget)
        fp.append(value)
        plain.append(plain_tflops(device, mn, k, repeats))
    p, f = statistics.median(plain), statistics.median(fp)
    print(f"bf16 {mn}x{k}x{mn} on {device} ({args.rounds} interleaved rounds, medians):")
    print(f"  plain torch.mm            {p * 1e3:12.3f} GFLOPS")
    share = f"{f / p:6.1%} of plain"
    if device.type == "cuda":
        ok &= f / p >= GPU_THROUGHPUT
        verdict = f"(budget >= {GPU_THROUGHPUT:.0%})  {'PASS' if f / p >= GPU_THROUGHPUT else 'FAIL'}"
    else:
        verdict = f"(budget only on a GPU: >= {GPU_THROUGHPUT:.0%})"
    print(f"  fingerprint (mm + digest) {f * 1e3:12.3f} GFLOPS   {share} {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
