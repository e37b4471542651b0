"""The budgets of `fpdoctor run`: default overhead <= 1% of a training step; the report
within 5 s of the death.

1. Step time: the same small training loop (benchmarks/models.py's transformer, AdamW) as
   `python loop.py` and as `fpdoctor run -- python loop.py`, in separate processes started side
   by side in each round (one thread each), so that the machine's load hits both alike. Each
   process reports the median of its own steps (wall and CPU time) after a warm-up; the median
   of the per-round ratios is the overhead. Default mode only: what `--breadcrumbs` costs per op is
   benchmarks/bench_breadcrumbs.py's.
2. fpdoctor's own CPU while the command runs: `run_command` in this process around a command
   that sleeps 2 s and 12 s; the difference per second is what the launcher takes from the
   machine (its pump and waiter threads block; it looks at the run directory 5 times a second).
   Inside the command's processes nothing runs per step in the default mode: faulthandler and
   the hooks only act when a process dies or raises, so this and start-up are the whole cost.
3. Start-up: `python -c pass` with and without the sitecustomize every instrumented process runs
   (its one-time cost, paid by each process the command starts).
4. Death to report: a process that dies of SIGSEGV under `fpdoctor run -o FILE` with this
   machine's environment verdicts joined; the time from the death (the fault file's time) to the
   report file; optionally (--torchrun) a 2-rank gloo job whose rank 1 dies of SIGFPE.

Run: python benchmarks/bench_run.py [--rounds R] [--steps N] [--device cpu|cuda] [--torchrun]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DIE = ROOT / "tests" / "fixtures" / "crash" / "die.py"
RANK_DIES = ROOT / "tests" / "fixtures" / "crash" / "rank_dies.py"
FPDOCTOR = [sys.executable, "-m", "fpdoctor"]


def loop(steps: int, warmup: int, device: str) -> None:
    """The training loop both variants run (this file with --loop): prints its step times."""
    import torch

    if device == "cpu":
        torch.set_num_threads(1)  # the two variants of a round run side by side, one core each
    sys.path.insert(0, str(HERE))
    from models import batch, make_step, small_transformer

    torch.manual_seed(0)
    if device == "cuda":
        model = small_transformer(layers=8, dim=1024, heads=16).to(device)
        tokens, targets = batch(size=16, length=512, device=device)
    else:
        model = small_transformer()
        tokens, targets = batch()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step_fn = make_step(model, optimizer, autocast=torch.bfloat16 if device == "cuda" else None)
    times, cpu = [], []
    for i in range(warmup + steps):
        if device == "cuda":
            torch.cuda.synchronize()
        start, start_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        step_fn(tokens, targets)
        optimizer.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    print(json.dumps({"median_s": statistics.median(times), "cpu_s": statistics.median(cpu), "steps": steps}))


def step_overhead(rounds: int, steps: int, device: str) -> dict[str, float]:
    """Each round starts both variants at the same moment (one thread each): on a machine shared
    with other work, a pair run side by side sees the same load, which runs taken one after the
    other do not (their ratios spread from 0.2 to 4 here). Which one starts first alternates."""
    worker = [sys.executable, __file__, "--loop", "--steps", str(steps), "--device", device]
    variants = {"plain": worker, "run": [*FPDOCTOR, "run", "--", *worker]}
    wall: dict[str, list[float]] = {"plain": [], "run": []}
    cpu: dict[str, list[float]] = {"plain": [], "run": []}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        procs = {name: subprocess.Popen(variants[name], stdout=subprocess.PIPE, text=True) for name in order}
        for name, proc in procs.items():
            out, _ = proc.communicate()
            result = json.loads(out.strip().splitlines()[-1])
            wall[name].append(result["median_s"])
            cpu[name].append(result["cpu_s"])
    ratios = [r / p for p, r in zip(wall["plain"], wall["run"], strict=True)]
    cpu_ratios = [r / p for p, r in zip(cpu["plain"], cpu["run"], strict=True)]
    return {
        "plain_ms": statistics.median(wall["plain"]) * 1e3,
        "run_ms": statistics.median(wall["run"]) * 1e3,
        "ratio": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "cpu_ratio": statistics.median(cpu_ratios),
    }


def launcher_cpu() -> dict[str, float]:
    import resource

    from fpdoctor.crash import run_command

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)  # this process only, not the command
        return usage.ru_utime + usage.ru_stime

    run_command([sys.executable, "-c", "pass"], stdout=None, stderr=None, environment=False)  # imports done
    spent = {}
    for seconds in (2, 12):
        start = cpu()
        code = f"import time; time.sleep({seconds})"
        run_command([sys.executable, "-c", code], stdout=None, stderr=None, environment=False)
        spent[seconds] = cpu() - start
    return {
        "fixed_ms": (spent[2] - 2 * (spent[12] - spent[2]) / 10) * 1e3,
        "per_s_ms": (spent[12] - spent[2]) / 10 * 1e3,
    }


def startup(repeats: int) -> dict[str, float]:
    import py_compile

    from fpdoctor.crash import SITE_DIR, child_environment

    # as installed: pip writes the bytecode, so no process compiles the file (PYTHONDONTWRITEBYTECODE
    # would otherwise make every process compile it)
    py_compile.compile(os.path.join(SITE_DIR, "sitecustomize.py"), doraise=True)
    with tempfile.TemporaryDirectory() as run_dir:
        envs = {"plain": dict(os.environ), "instrumented": child_environment(dict(os.environ), run_dir, False)}
        times: dict[str, list[float]] = {k: [] for k in envs}
        for _ in range(repeats):
            for name, env in envs.items():
                start = time.perf_counter()
                subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
                times[name].append(time.perf_counter() - start)
    plain, inst = statistics.median(times["plain"]), statistics.median(times["instrumented"])
    return {"plain_ms": plain * 1e3, "instrumented_ms": inst * 1e3, "extra_ms": (inst - plain) * 1e3}


def death_to_report(command: list[str], rank: int | None = None) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        subprocess.run([*FPDOCTOR, "run", "-o", str(out), "--", *command], capture_output=True, check=False)
        doc = json.loads(out.read_text())
        ends = [
            p["end"]
            for p in doc["data"]["processes"]
            if p.get("signal") in ("SIGSEGV", "SIGFPE") and (rank is None or p.get("rank") == rank)
        ]
        return out.stat().st_mtime - min(ends)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--torchrun", action="store_true", help="also time a 2-rank gloo job's report")
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        loop(args.steps, warmup=max(5, args.steps // 10), device=args.device)
        return
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    s = step_overhead(args.rounds, args.steps, args.device)
    print(
        f"training step ({args.device}): plain {s['plain_ms']:.2f} ms, under fpdoctor run {s['run_ms']:.2f} ms; "
        f"wall ratio per round, median {s['ratio']:.4f} (rounds {s['min']:.4f}-{s['max']:.4f}); "
        f"CPU time per step ratio {s['cpu_ratio']:.4f}   budget <= 1.01"
    )
    c = launcher_cpu()
    print(
        f"fpdoctor's own CPU while the command runs: {c['per_s_ms']:.2f} ms per second "
        f"({c['per_s_ms'] / 10:.3f}% of one core), plus {c['fixed_ms']:.1f} ms once"
    )
    u = startup(20)
    print(
        f"start-up per Python process: plain {u['plain_ms']:.1f} ms, instrumented {u['instrumented_ms']:.1f} ms "
        f"(+{u['extra_ms']:.1f} ms)"
    )
    reports = [death_to_report([sys.executable, str(DIE), "sigsegv"]) for _ in range(3)]
    print(
        f"death to report, SIGSEGV, live environment verdicts: {min(reports):.2f}-{max(reports):.2f} s   budget <= 5 s"
    )
    if args.torchrun:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
        job = [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(RANK_DIES)]
        seconds = death_to_report(job, rank=1)
        print(f"death to report, torchrun rank 1 SIGFPE (rank 0 in all_reduce): {seconds:.2f} s   budget <= 5 s")


if __name__ == "__main__":
    main()
