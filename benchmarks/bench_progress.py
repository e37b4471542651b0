"""What the progress display costs: nothing measurable when it is off, little when it is on.

1. Off (stderr not a terminal, --quiet, the Python API): one `with progress.task(...) as t:
   t.advance(); t.describe(...)` cycle against the same cycle on `contextlib.nullcontext()`
   and against `progress.task()` alone, in ns per call (timeit, best of 5).
2. On, drawing to a pseudo-terminal: the same cycle, and `advance()` alone, in us per call.
3. End to end: `fpdoctor plan` on a transformer (benchmarks/models.py) with stderr on a
   pseudo-terminal (display on) against `--quiet`, alternating which goes first, medians of the
   wall time and of the process's CPU time (user + system: steadier on a shared machine).

Run: python benchmarks/bench_progress.py [--rounds N] [--layers L]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import pty
import select
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent

FACTORY = """
import sys
sys.path.insert(0, {here!r})
import torch
from models import batch, small_transformer

def make():
    torch.manual_seed(0)
    model = small_transformer(layers={layers}, dim=128).eval()
    tokens, _ = batch(size=4, length=64)
    return model, tokens
"""


def _best_ns(fn: object, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e9  # type: ignore[arg-type]


def _cycle(task: object) -> object:
    def run() -> None:
        with task("plan fp16: keep in fp32", total=10, unit="runs") as t:  # type: ignore[operator]
            t.advance()
            t.describe("plan fp16: verify")

    return run


def _null_cycle() -> None:
    with contextlib.nullcontext() as t:
        del t


def _pty() -> tuple[int, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    return master, slave


def _drain(master: int, stop: threading.Event) -> None:
    while not stop.is_set():
        if select.select([master], [], [], 0.05)[0]:
            try:
                os.read(master, 65536)
            except OSError:
                return


def in_process() -> None:
    from fpdoctor import progress

    n = 200_000
    off = _best_ns(_cycle(progress.task), n)
    alone = _best_ns(lambda: progress.task("plan fp16: verify"), n)
    null = _best_ns(_null_cycle, n)
    print(f"off:  task+with+advance+describe {off:.0f} ns/call, task() alone {alone:.0f} ns, nullcontext {null:.0f} ns")
    assert "rich" not in sys.modules, "the display being off must not import rich"

    master, slave = _pty()
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, stop), daemon=True)
    reader.start()
    saved = sys.stderr
    sys.stderr = os.fdopen(slave, "w", buffering=1)
    os.environ.setdefault("TERM", "xterm-256color")
    try:
        with progress.display(True), progress.task("outer", unit="runs") as outer:
            m = 2_000
            on = _best_ns(_cycle(progress.task), m) / 1e3
            step = _best_ns(outer.advance, 20_000) / 1e3
    finally:
        stream, sys.stderr = sys.stderr, saved
        stop.set()
        reader.join(timeout=5)
        stream.close()
        os.close(master)
    print(f"on:   task+with+advance+describe {on:.1f} us/call (two redraws: start, end), advance {step:.2f} us")


def _plan_run(spec: str, *, shown: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one `fpdoctor plan`."""
    master, slave = _pty()
    stop = threading.Event()
    reader = threading.Thread(target=_drain, args=(master, stop), daemon=True)
    reader.start()
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "RANK", "LOCAL_RANK")}
    env["TERM"] = "xterm-256color"
    env["OMP_NUM_THREADS"] = "1"  # one thread: no OpenMP spin-waiting in the CPU time, on a shared machine
    args = [sys.executable, "-m", "fpdoctor", "plan", spec, "--candidate", "fp16", *([] if shown else ["-q"])]
    started = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=slave, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    os.close(slave)
    stop.set()
    reader.join(timeout=5)
    os.close(master)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"fpdoctor plan failed with {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def end_to_end(rounds: int, layers: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "factory.py"
        path.write_text(FACTORY.format(here=str(HERE), layers=layers))
        spec = f"{path}:make"
        _plan_run(spec, shown=False)  # warm the page cache (torch's libraries)
        runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
        for k in range(rounds):
            for shown in (k % 2 == 1, k % 2 == 0):
                runs[shown].append(_plan_run(spec, shown=shown))
    for i, what in ((0, "wall"), (1, "CPU")):
        q = statistics.median(r[i] for r in runs[False])
        s = statistics.median(r[i] for r in runs[True])
        print(
            f"plan fp16, {layers}-layer transformer, {what}: --quiet {q:.2f} s, display on a terminal {s:.2f} s, "
            f"ratio {s / q:.3f} (medians of {rounds}; importing torch included)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    in_process()
    end_to_end(args.rounds, args.layers)


if __name__ == "__main__":
    main()
