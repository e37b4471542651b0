"""How `fpdoctor watch` grows with the number of ranks: a tiny DDP job on gloo over loopback, run
plain and under `torchrun ... -m fpdoctor watch -o FILE`, at several world sizes.

Printed per world size: the job's wall time plain and watched (their ratio), the per-step cost of
the watch's one agreement (a 2-element all-reduce per optimizer step) measured inside each rank,
and how long after the last rank's script ended the merged report was there. What grows how:
- per step, per rank: one all-reduce of 2 floats (latency O(log P) with gloo's/NCCL's trees), the
  finite check over this rank's own gradients (independent of P);
- per bad step: one all-gather of a small dict per rank (O(P) bytes to every rank) and a replay;
- per job: every rank writes its report and a sidecar file; the rank that completes the set reads
  P sidecars and writes the merged report (O(P) files on one rank: at 10,000 ranks about 10,000
  small JSON reads, a few seconds on a shared file system - no collective, so a dead rank cannot
  hang it).

Run: python benchmarks/bench_watch_ranks.py [--ranks 2,4,8,16] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = """
import os, sys, time, json, torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(dist.get_rank())
steps = int(sys.argv[1])
times = []
for _ in range(steps):
    start = time.perf_counter()
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    times.append(time.perf_counter() - start)
if dist.get_rank() == 0:
    times.sort()
    print(json.dumps({"median_step_s": times[len(times) // 2], "ended": time.time()}), flush=True)
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(ranks: int, steps: int, watched: bool, folder: Path) -> dict[str, float]:
    script = folder / "job.py"
    script.write_text(JOB)
    report = folder / f"watch{ranks}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_port())]
    cmd += ["-m", "fpdoctor", "watch", "-o", str(report), "--", str(script)] if watched else [str(script)]
    start = time.perf_counter()
    done = subprocess.run([*cmd, str(steps)], capture_output=True, text=True, timeout=600, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{ranks} ranks ({'watched' if watched else 'plain'}) failed:\n{done.stderr[-2000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
    facts = json.loads(line)
    out = {"wall": wall, "step": float(facts["median_step_s"])}
    if watched:
        merged = json.loads(report.read_text())
        assert merged["data"]["distributed"]["world_size"] == ranks
        out["merged_after"] = report.stat().st_mtime - float(facts["ended"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8,16")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"watch under torchrun: tiny DDP MLP on gloo, {args.steps} steps; one run each (noisy on a shared machine)")
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            plain = _run(ranks, args.steps, False, Path(tmp))
            watched = _run(ranks, args.steps, True, Path(tmp))
            print(
                f"  {ranks:3d} ranks: job {plain['wall']:6.1f} s plain, {watched['wall']:6.1f} s watched "
                f"({watched['wall'] / plain['wall']:.2f}x); median step {plain['step'] * 1e3:7.2f} ms plain, "
                f"{watched['step'] * 1e3:7.2f} ms watched; merged report {watched['merged_after']:5.2f} s "
                "after rank 0's script ended (budget 5 s)"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
