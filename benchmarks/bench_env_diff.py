"""The budget for `fpdoctor env --diff A B` of two saved files: median wall <= 0.5 s, and
torch is never imported (checked with -X importtime).

The two files are a saved facts JSON (an A100 machine) and the H20 collect_env report, so both
parsers, the rules on each side and the table run. Prints the ratio of the median to 0.5 s, the
CPU time beside the wall time, and `env --from B` run alternately for comparison.

Run: python benchmarks/bench_env_diff.py [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "env"
A = FIXTURES / "facts" / "diff_base_a100_live.json"
B = FIXTURES / "collect_env" / "h20_cu121_pytorch133548.txt"
BUDGET_S = 0.5
# As installed: pip byte-compiles a package, so a run reads cached bytecode. Without this, an
# environment with PYTHONDONTWRITEBYTECODE set compiles every module on every run (~0.6 s here).
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def fpdoctor_cmd() -> list[str]:
    script = Path(sys.executable).parent / "fpdoctor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fpdoctor"]


def wall(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds of one run, and the CPU seconds (user + system) it used: on a shared machine
    the wall time waits for other processes' cores, the CPU time does not."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV, check=False)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    cmd = [*fpdoctor_cmd(), "env", "--diff", str(A), str(B), "--format", "json"]
    # `env --from` of one file, alternating with it: the same budget, so a busy machine shows in both
    one = [*fpdoctor_cmd(), "env", "--from", str(B), "--format", "json"]
    wall(cmd), wall(one)  # warm the page cache and write the bytecode cache
    runs, ones = [], []
    for _ in range(args.rounds):
        runs.append(wall(cmd))
        ones.append(wall(one))
    times = [w for w, _ in runs]
    median, cpu = statistics.median(times), statistics.median(c for _, c in runs)
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fpdoctor", "env", "--diff", str(A), str(B)],
        capture_output=True,
        text=True,
        env=ENV,
        check=False,
    ).stderr
    torch_imported = any(line.rstrip().endswith("| torch") for line in imports.splitlines())
    ok = median <= BUDGET_S and not torch_imported
    print(
        f"fpdoctor env --diff A B     median {median:.3f} s  (runs: {', '.join(f'{t:.2f}' for t in times)}), "
        f"CPU median {cpu:.3f} s, imports torch: {'yes' if torch_imported else 'no'}"
    )
    print(
        f"fpdoctor env --from B       median {statistics.median(w for w, _ in ones):.3f} s, "
        f"CPU median {statistics.median(c for _, c in ones):.3f} s (for comparison, run alternately)"
    )
    verdict = "PASS" if ok else "FAIL"
    print(f"ratio to the budget = {median / BUDGET_S:.2f}  (median / {BUDGET_S} s, <= 1.00)  {verdict}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
