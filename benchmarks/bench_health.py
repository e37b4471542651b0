"""The budget for `fpdoctor health` without fingerprints: <= 1 s per node, measured side by side.

1. `fpdoctor health --duration 0` (NVML facts + this boot's kernel log) against its anchors in the
   same run, alternating: a bare interpreter that starts NVML (`python -c "import pynvml;
   pynvml.nvmlInit()"`) and, where there is a driver, `nvidia-smi -q` (0.11 s per GPU on an H100).
2. `fpdoctor health --from FILE` on saved kernel logs and `nvidia-smi -q` output.
3. In process, the parser on a large kernel log (a long-running node's ring buffer) and the NVML
   reads of an 8-GPU node through the fake pynvml of the tests (on a GPU node the real NVML is timed
   by (1)).
Neither path may import torch (checked with -X importtime).

Run: python benchmarks/bench_health.py [--rounds N]
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
sys.path.insert(0, str(ROOT))
RULES = ROOT / "tests" / "fixtures" / "health" / "rules"
FROM_FILES = [RULES / "HWR001-xid-error.log", RULES / "HWR004-row-remap-pending.txt", RULES / "HWR002-gpu-lost.log"]
BUDGET_S = 1.0


def fpdoctor_cmd() -> list[str]:
    script = Path(sys.executable).parent / "fpdoctor"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fpdoctor"]


def wall(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def imports_torch(cmd: list[str]) -> bool:
    err = subprocess.run(
        [sys.executable, "-X", "importtime", *cmd[1:]]
        if cmd[0] == sys.executable
        else [sys.executable, "-X", "importtime", "-m", "fpdoctor", *cmd[1:]],
        capture_output=True,
        text=True,
        check=False,
    ).stderr
    return any(line.rstrip().endswith("| torch") for line in err.splitlines())


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.3f}" for t in times)


def side_by_side(commands: dict[str, list[str]], rounds: int) -> dict[str, float]:
    for cmd in commands.values():
        wall(cmd)  # warm the page cache
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, cmd in commands.items():
            times[name].append(wall(cmd))
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:<44} median {medians[name]:.3f} s  (runs: {_runs(t)})")
    return medians


def big_kernel_log(lines: int) -> list[str]:
    """A long-running node's ring buffer: mostly other drivers, an NVIDIA line every 50."""
    xid = "NVRM: Xid (PCI:0000:{bus:02x}:00): 13, pid={pid}, name=pt_main_thread, Graphics SM Warp Exception"
    out = []
    for i in range(lines):
        stamp = f"[{i * 0.01:12.6f}] "
        if i % 50 == 0:
            out.append(stamp + xid.format(bus=0x18 + i % 8, pid=1000 + i))
        else:
            out.append(stamp + f"mlx5_core 0000:{i % 256:02x}:00.0: link state changed, port {i % 4} is up")
    return out


def in_process() -> None:
    from tests.health.fake_nvml import FakeNVML, device

    from fpdoctor.health import kernel_log, nvml

    lines = big_kernel_log(200_000)
    start = time.perf_counter()
    parsed = kernel_log.parse(lines)
    groups = kernel_log.group(parsed.xids)
    parse_s = time.perf_counter() - start
    print(
        f"  parse + group a 200,000-line kernel log ({len(parsed.xids)} Xid lines, {len(groups)} groups): "
        f"{parse_s * 1000:.0f} ms"
    )
    fake = FakeNVML([device(bus_id=f"00000000:{0x18 + i:02X}:00.0") for i in range(8)])
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        nvml.collect(nvml=fake)
        samples.append(time.perf_counter() - start)
    print(
        f"  NVML reads of 8 GPUs through the fake pynvml (fpdoctor's own cost): "
        f"{statistics.median(samples) * 1000:.2f} ms median of 20"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ours = [*fpdoctor_cmd(), "health", "--duration", "0", "--format", "json"]
    anchors = {
        "fpdoctor health --duration 0": ours,
        "python -c 'import pynvml; pynvml.nvmlInit()'": [
            sys.executable,
            "-c",
            "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError:\n    pass",
        ],
    }
    if shutil.which("nvidia-smi"):
        anchors["nvidia-smi -q"] = ["nvidia-smi", "-q"]
    print("1. the live facts path, alternating with its anchors:")
    medians = side_by_side(anchors, args.rounds)
    live = medians["fpdoctor health --duration 0"]
    ratio = live / medians["python -c 'import pynvml; pynvml.nvmlInit()'"]
    live_torch = imports_torch(ours)
    ok_live = live <= BUDGET_S and not live_torch
    print(
        f"  -> {live:.3f} s (budget <= {BUDGET_S:.2f} s per node), {ratio:.2f}x the NVML-init interpreter, "
        f"imports torch: {'yes' if live_torch else 'no'}  {'PASS' if ok_live else 'FAIL'}"
    )

    from_cmd = [*fpdoctor_cmd(), "health", *(a for p in FROM_FILES for a in ("--from", str(p))), "--format", "json"]
    print("2. --from saved files (an Xid log, an nvidia-smi -q excerpt, a fallen-off-bus log):")
    from_median = side_by_side({"fpdoctor health --from 3 files": from_cmd}, args.rounds)[
        "fpdoctor health --from 3 files"
    ]
    from_torch = imports_torch(from_cmd)
    ok_from = from_median <= BUDGET_S and not from_torch
    print(
        f"  -> {from_median:.3f} s (budget <= {BUDGET_S:.2f} s), imports torch: {'yes' if from_torch else 'no'}  "
        f"{'PASS' if ok_from else 'FAIL'}"
    )

    print("3. in process:")
    in_process()
    if not shutil.which("nvidia-smi"):
        print("note: no NVIDIA driver here; on a GPU node (1) includes the real NVML reads of every GPU")
    return 0 if ok_live and ok_from else 1


if __name__ == "__main__":
    sys.exit(main())
