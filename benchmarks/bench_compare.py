"""SPEC 5 budget for `compare`: extra memory O(largest activation), time <= 3x two plain forwards.

A 12-layer transformer encoder (benchmarks/models.py), eval mode, fp16 candidate against fp32.
Each measurement runs in its own subprocess so that peak resident memory (ru_maxrss) belongs to
it alone: (a) the two plain forward passes (fp32 reference and fp16 candidate copies), (b) compare.
Extra memory = peak(b) - peak(a) - the fp64 copy of the weights compare adds (reported apart,
it is O(parameters), not O(activations)).

Run: python benchmarks/bench_compare.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, resource, sys, time, copy
sys.path.insert(0, {here!r})
import torch
from models import small_transformer, batch
torch.manual_seed(0)
model = small_transformer(layers=int(sys.argv[2]), dim=256).eval()
tokens, _ = batch(length=128)
embed = model.embed(tokens).detach()
encoder = model.encoder
largest = 8 * 128 * 1024 * 4  # the feed-forward activation, fp32 bytes
params = sum(p.numel() for p in encoder.parameters())
mode = sys.argv[1]
if mode == "plain":
    ref = copy.deepcopy(encoder); cand = copy.deepcopy(encoder).half()
    with torch.no_grad():
        ref(embed); cand(embed.half())  # warm-up
        start = time.perf_counter(); ref(embed); cand(embed.half()); elapsed = time.perf_counter() - start
else:
    import fpdoctor
    fpdoctor.compare(encoder, embed, candidate="fp16")  # warm-up
    import gc; gc.collect()
    start = time.perf_counter(); result = fpdoctor.compare(encoder, embed, candidate="fp16")
    elapsed = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"seconds": elapsed, "peak": peak, "largest": largest, "params": params}}))
"""


def run(mode: str, layers: int = 12) -> dict[str, float]:
    argv = [sys.executable, "-c", CHILD.format(here=str(HERE)), mode, str(layers)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    plain, comp = [], []
    for _ in range(args.rounds):
        plain.append(run("plain"))
        comp.append(run("compare"))
    t_plain = statistics.median(p["seconds"] for p in plain)
    t_comp = statistics.median(c["seconds"] for c in comp)
    fp64_weights = plain[0]["params"] * 8
    extra = statistics.median(c["peak"] for c in comp) - statistics.median(p["peak"] for p in plain) - fp64_weights
    largest = plain[0]["largest"]
    ratio = t_comp / t_plain
    print(f"12-layer encoder, dim 256, 8 x 128 tokens, fp16 vs fp32, {args.rounds} rounds (medians)")
    print(f"  two plain forwards {t_plain * 1e3:8.1f} ms   compare {t_comp * 1e3:8.1f} ms")
    print(f"  ratio {ratio:.2f}x (budget 3x)")
    print(f"  extra peak memory beyond the fp64 weight copy: {extra / 2**20:.1f} MiB")
    print(
        f"  = {extra / largest:.1f}x the largest activation ({largest / 2**20:.1f} MiB); "
        f"fp64 weights {fp64_weights / 2**20:.1f} MiB"
    )
    # O(largest activation), not O(all activations): the extra memory must not grow with depth.
    deep_plain, deep_comp = run("plain", 24), run("compare", 24)
    extra_deep = deep_comp["peak"] - deep_plain["peak"] - deep_plain["params"] * 8
    growth = extra_deep / extra if extra > 0 else float("inf")
    print(
        f"  24 layers: extra {extra_deep / 2**20:.1f} MiB, {growth:.2f}x the 12-layer extra (constant = O(activation))"
    )
    ok_time = ratio <= 3.0
    ok_memory = growth <= 1.25
    print(f"time {'PASS' if ok_time else 'FAIL'}, memory {'PASS' if ok_memory else 'FAIL'}")
    return 0 if ok_time and ok_memory else 1


if __name__ == "__main__":
    sys.exit(main())
