"""Soak: `fpdoctor run` over a healthy 2-rank torchrun job does nothing to it.

Each round runs the same job twice, as `torchrun ...` and as `fpdoctor run -o report.json --
torchrun ...` (gloo over loopback, CPU), in that order, and compares what the job did:

- the exit status;
- stdout and stderr, line for line (sorted: two ranks print in either order), read to their end,
  which comes only when the background writers the ranks left behind have closed them;
- every file the job wrote, by name and content.

What each rank of the job does:

- helpers: an optional-dependency probe through a shell (`python -c 'import apex'`: the
  grandchild inherits RANK and fails), a Python helper that inherits RANK and writes a file, a
  DataLoader with two worker processes;
- signals: SIGUSR1 to itself five times and once from this script (to each rank's pid), each
  counted by its handler; a SIGCHLD for each helper;
- background work: a detached process that outlives the job by a second and then writes three
  lines to the job's stderr and a file (an upload that logs);
- a thread that prints while the main thread runs collectives.

fpdoctor's report must be `ok` (notes only) and stderr must carry nothing of fpdoctor's.
Bounded: --rounds (3) and --max-seconds (900); each run times out after 240 s.

Run: python benchmarks/soak_run.py [--rounds R] [--max-seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

JOB = textwrap.dedent(
    """
    import os, signal, subprocess, sys, threading, time
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    out = sys.argv[1]


    def say(line):
        # one write per line: torchrun's ranks write unbuffered, and print() writes the newline apart
        os.write(1, (line + "\\n").encode())


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))

    probe = subprocess.run(f"{sys.executable} -c 'import apex_not_installed'", shell=True, capture_output=True)
    helper = f"open(os.path.join({out!r}, 'helper.' + os.environ['RANK']), 'w').write('helped')"
    subprocess.run([sys.executable, "-c", "import os; " + helper], check=True)
    loader = DataLoader(list(range(32)), batch_size=4, num_workers=2)
    data = sum(int(batch.sum()) for batch in loader)

    background = (
        "import os, time; time.sleep(1.0)\\n"
        "for i in range(3):\\n"
        f"    os.write(2, b'rank {rank} upload %d\\\\n' % i)\\n"
        f"open({os.path.join(out, f'upload.{rank}')!r}, 'w').write('uploaded')\\n"
    )
    subprocess.Popen([sys.executable, "-c", background], start_new_session=True)

    ticker = threading.Thread(target=lambda: [say(f"rank {rank} tick {i}") for i in range(5)])
    ticker.start()
    for _ in range(5):
        os.kill(os.getpid(), signal.SIGUSR1)
    total = torch.zeros(1)
    for step in range(20):
        t = torch.full((1,), float(rank + step))
        dist.all_reduce(t)
        total += t
    ticker.join()
    with open(os.path.join(out, f"pid.{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    deadline = time.monotonic() + 60
    while len(got) < 6 and time.monotonic() < deadline:  # the sixth comes from the soak
        time.sleep(0.05)
    os.remove(os.path.join(out, f"pid.{rank}"))
    dist.barrier()
    with open(os.path.join(out, f"result.{rank}"), "w") as fh:
        fh.write(f"probe {probe.returncode} data {data} total {total.item():g} usr1 {len(got)}\\n")
    say(f"rank {rank} done: usr1 {len(got)}")
    dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(job: Path, out: Path, wrap: list[str]) -> dict:
    out.mkdir()
    argv = [*wrap, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(job), str(out)]
    started = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    signalled: set[int] = set()
    while proc.poll() is None and time.monotonic() - started < 240:
        for name in os.listdir(out):
            if name.startswith("pid.") and name not in {f"pid.{r}" for r in signalled}:
                try:
                    pid = int((out / name).read_text())
                except (OSError, ValueError):
                    continue  # being written
                os.kill(pid, signal.SIGUSR1)
                signalled.add(int(name.split(".")[1]))
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    code = proc.wait()
    ended = time.monotonic() - started
    stdout, stderr = proc.communicate(timeout=60)  # to their end: the background writers close them
    return {
        "code": code,
        "seconds": ended,
        "stdout": sorted(line for line in stdout.splitlines() if line),
        "stderr": sorted(line for line in stderr.splitlines() if line),
        "files": {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fpdoctor-soak-"))
    job = work / "job.py"
    job.write_text(JOB)
    began = time.monotonic()
    rows, same, plain_s, watched_s = [], 0, [], []
    try:
        for r in range(args.rounds):
            if time.monotonic() - began > args.max_seconds:
                print(f"stopped after {r} rounds: --max-seconds {args.max_seconds:g}")
                break
            report = work / f"report.{r}.json"
            plain = run_job(job, work / f"plain.{r}", [])
            watched = run_job(
                job, work / f"watched.{r}", [sys.executable, "-m", "fpdoctor", "run", "-o", str(report), "--"]
            )
            doc = json.loads(report.read_text())
            checks = {
                "exit": plain["code"] == watched["code"] == 0,
                "stdout": plain["stdout"] == watched["stdout"],
                "stderr": plain["stderr"] == watched["stderr"],
                "files": plain["files"] == watched["files"],
                "report ok": doc["verdict"] == "ok",
            }
            same += all(checks.values())
            plain_s.append(plain["seconds"])
            watched_s.append(watched["seconds"])
            rows.append((r, plain, watched, doc, checks))
            print(
                f"round {r}: exit {plain['code']}/{watched['code']}, "
                f"stdout {len(plain['stdout'])}/{len(watched['stdout'])} lines, "
                f"stderr {len(plain['stderr'])}/{len(watched['stderr'])} lines, "
                f"files {len(plain['files'])}/{len(watched['files'])}, "
                f"{plain['seconds']:.1f}/{watched['seconds']:.1f} s (plain/fpdoctor), report {doc['verdict']} "
                f"({len(doc['findings'])} note(s)); "
                + ", ".join(f"{k} {'same' if v else 'DIFFERENT'}" for k, v in checks.items())
            )
            if not all(checks.values()):
                for key in ("stdout", "stderr"):
                    if plain[key] != watched[key]:
                        print(f"  {key} plain only:", sorted(set(plain[key]) - set(watched[key]))[:10])
                        print(f"  {key} fpdoctor only:", sorted(set(watched[key]) - set(plain[key]))[:10])
        if rows:
            _, plain, _, _, _ = rows[-1]
            print(f"rounds identical: {same} of {len(rows)}")
            print(
                f"job wall time, median: plain {statistics.median(plain_s):.1f} s, "
                f"fpdoctor {statistics.median(watched_s):.1f} s"
            )
            print("files per run:", ", ".join(f"{k}={v.decode().strip()}" for k, v in plain["files"].items()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if rows and same == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
