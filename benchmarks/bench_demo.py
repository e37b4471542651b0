"""The budget for `fpdoctor demo`: all casebook cases in <= 60 s on a 2-core CPU.

Runs `python -m fpdoctor demo` (every case) N times in fresh interpreters, as a user would, and
prints the median wall time as a ratio of the budget (<= 1.0 passes).

Run: python benchmarks/bench_demo.py [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

BUDGET_S = 60.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    walls = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "fpdoctor", "demo"], capture_output=True, text=True, check=False)
        walls.append(time.perf_counter() - start)
        if proc.returncode != 0:
            print(f"fpdoctor demo exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            return 1
    median = statistics.median(walls)
    print(f"fpdoctor demo (all cases), {args.rounds} runs: median {median:.1f} s")
    print(f"  ratio to the {BUDGET_S:.0f} s budget: {median / BUDGET_S:.2f} (<= 1.0)")
    ok = median <= BUDGET_S
    print(f"demo {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
