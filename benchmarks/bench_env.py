"""The budgets for the environment doctor, measured side by side in one run.

1. `fpdoctor env --no-probe` against `python -m torch.utils.collect_env`, alternating, on this
   machine: the ratio of median wall times must be <= 0.8.
2. `fpdoctor env --from FILE` on a real collect_env report, in the text and JSON formats: median
   wall <= 0.5 s (CPU time beside it: on a shared machine the wall time waits for other processes'
   cores, the CPU time does not), and torch is never imported (checked with -X importtime).

Run: python benchmarks/bench_env.py [--rounds N] [--from-only]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "tests" / "fixtures" / "env" / "collect_env" / "h20_cu121_pytorch133548.txt"
# As installed: pip byte-compiles a package, so a run reads cached bytecode. Without this, an
# environment with PYTHONDONTWRITEBYTECODE set compiles every changed module on every run.
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def fpdoctor_cmd() -> list[str]:
    script = Path(sys.executable).parent / "fpdoctor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fpdoctor"]


def wall(cmd: list[str]) -> float:
    return timed(cmd)[0]


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds of one run, and the CPU seconds (user + system) it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--from-only", action="store_true", help="measure env --from alone (no torch import)")
    args = parser.parse_args()
    ok_env = True if args.from_only else live(args.rounds)
    ok_from = from_file(args.rounds)
    if not args.from_only and shutil.which("nvidia-smi") is None:
        print("note: no NVIDIA driver here; on a GPU machine the live run also forces cuBLAS/cuDNN to load")
    return 0 if ok_env and ok_from else 1


def live(rounds: int) -> bool:
    env_cmd = [*fpdoctor_cmd(), "env", "--no-probe", "--format", "json"]
    ref_cmd = [sys.executable, "-m", "torch.utils.collect_env"]
    wall(env_cmd), wall(ref_cmd)  # warm the page cache for both
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(wall(env_cmd))
        theirs.append(wall(ref_cmd))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"fpdoctor env --no-probe     median {statistics.median(ours):.3f} s  (runs: {_runs(ours)})")
    print(f"torch.utils.collect_env     median {statistics.median(theirs):.3f} s  (runs: {_runs(theirs)})")
    ok = ratio <= 0.8
    print(f"ratio env / collect_env = {ratio:.2f}  (budget <= 0.80)  {'PASS' if ok else 'FAIL'}")
    return ok


def from_file(rounds: int) -> bool:
    # The text format (the default, what a person reads) renders with rich; JSON (what a bot
    # reads) does not: both, alternately, so a busy moment of the machine falls on both.
    cmds = {fmt: [*fpdoctor_cmd(), "env", "--from", str(REPORT), "--format", fmt] for fmt in ("text", "json")}
    for cmd in cmds.values():
        timed(cmd)  # warm the page cache
    runs: dict[str, list[tuple[float, float]]] = {fmt: [] for fmt in cmds}
    for _ in range(rounds):
        for fmt, cmd in cmds.items():
            runs[fmt].append(timed(cmd))
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fpdoctor", "env", "--from", str(REPORT)],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    ).stderr
    torch_imported = any(line.rstrip().endswith("| torch") for line in imports.splitlines())
    ok = not torch_imported
    for fmt, measured in runs.items():
        walls = [w for w, _ in measured]
        median, cpu = statistics.median(walls), statistics.median(c for _, c in measured)
        ok = ok and median <= 0.5
        print(
            f"fpdoctor env --from FILE --format {fmt:<4}  median {median:.3f} s, CPU median {cpu:.3f} s  "
            f"(runs: {_runs(walls)}; budget <= 0.50 s)"
        )
    print(f"env --from imports torch: {'yes' if torch_imported else 'no'}  {'PASS' if ok else 'FAIL'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
