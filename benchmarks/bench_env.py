"""The budgets for the environment doctor, measured side by side in one run.

1. `fpdoctor env --no-probe` against `python -m torch.utils.collect_env`, alternating, on this
   machine: the ratio of median wall times must be <= 0.8.
2. `fpdoctor env --from FILE` on a real collect_env report: median wall <= 0.5 s, and torch is
   never imported (checked with -X importtime).

Run: python benchmarks/bench_env.py [--rounds N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "tests" / "fixtures" / "env" / "collect_env" / "h20_cu121_pytorch133548.txt"


def fpdoctor_cmd() -> list[str]:
    script = Path(sys.executable).parent / "fpdoctor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fpdoctor"]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    env_cmd = [*fpdoctor_cmd(), "env", "--no-probe", "--format", "json"]
    ref_cmd = [sys.executable, "-m", "torch.utils.collect_env"]
    wall(env_cmd), wall(ref_cmd)  # warm the page cache for both
    ours, theirs = [], []
    for _ in range(args.rounds):
        ours.append(wall(env_cmd))
        theirs.append(wall(ref_cmd))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"fpdoctor env --no-probe     median {statistics.median(ours):.3f} s  (runs: {_runs(ours)})")
    print(f"torch.utils.collect_env     median {statistics.median(theirs):.3f} s  (runs: {_runs(theirs)})")
    ok_env = ratio <= 0.8
    print(f"ratio env / collect_env = {ratio:.2f}  (budget <= 0.80)  {'PASS' if ok_env else 'FAIL'}")

    from_cmd = [*fpdoctor_cmd(), "env", "--from", str(REPORT), "--format", "json"]
    from_times = [wall(from_cmd) for _ in range(args.rounds)]
    from_median = statistics.median(from_times)
    imports = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fpdoctor", "env", "--from", str(REPORT)],
        capture_output=True,
        text=True,
        check=False,
    ).stderr
    torch_imported = any(line.rstrip().endswith("| torch") for line in imports.splitlines())
    ok_from = from_median <= 0.5 and not torch_imported
    print(
        f"fpdoctor env --from FILE    median {from_median:.3f} s  (budget <= 0.50 s), "
        f"imports torch: {'yes' if torch_imported else 'no'}  {'PASS' if ok_from else 'FAIL'}"
    )
    if shutil.which("nvidia-smi") is None:
        print("note: no NVIDIA driver here; on a GPU machine the live run also forces cuBLAS/cuDNN to load")
    return 0 if ok_env and ok_from else 1


if __name__ == "__main__":
    sys.exit(main())
