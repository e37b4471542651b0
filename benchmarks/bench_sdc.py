"""Silent data corruption at the scale of the incident, simulated: gloo ranks on this machine.

`--ranks` processes (default 16, as `--per-node` ranks on each of ranks/per-node "nodes": each
rank's host name is its node's, node0..node3) train one model under DDP with the Sentinel, each
rank on batches of its own (a teacher-student classification, a tenth of the labels random, AdamW).
On one rank (`--faulty`, default 13: node3) a forward hook on the middle Linear corrupts that
layer's output every `--every`-th call, from the `--warm`-th step on, and leaves the gradient to
flow as computed (the value wrong, the graph as the kernel's):

- bitflip: exponent bit 27 of the output's largest element flipped (x in [2, 2^17): x * 2^16);
- tile: a 16 x 16 tile of the output multiplied by 16 (a tile written from a wrong accumulator);
- stale: the whole output replaced by the previous call's (a buffer not rewritten).

Each fault runs on a fresh model until a rank is named (silent-corruption-suspected on every rank)
or `--limit` steps after the first faulty call; the figure is steps from the first faulty call to
the finding, whether the named rank is the faulty one, and whether any step went non-finite
(the sentinel must find it with no NaN). A healthy run of `--healthy` steps counts strikes,
escalations and findings per 1000 steps (false alarms). The cost: plain DDP, the Sentinel with the
corruption sentinel switched off, and with it on, stepped in alternating blocks of `--block` steps,
medians of the per-step wall time over the blocks (the ranks step in lockstep). Then, in this
process, the host's per-step work of the judgement at 256 and 10,000 ranks (synthetic norms), and
the all-reduce's bytes.

Run: python benchmarks/bench_sdc.py [--ranks 16] [--per-node 4] [--healthy 1000] [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fpdoctor
from fpdoctor.numerics.observe.gradcheck import FlagRead
from fpdoctor.numerics.training import corruption
from fpdoctor.numerics.training.distributed import BucketWatch

FAULTS = ("bitflip", "tile", "stale")
BATCH, DIM, HIDDEN, CLASSES = 64, 32, 128, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
    )


class Fault:
    """A forward hook on one rank's Linear: every `every`-th call from `start` on, its output wrong."""

    def __init__(self, kind: str, start: int, every: int) -> None:
        self.kind, self.start, self.every = kind, start, every
        self.calls = 0
        self.injected = 0
        self.first: int | None = None  # the call of the first injection
        self._previous: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        previous, self._previous = self._previous, out.detach().clone()
        if self.calls < self.start or self.calls % self.every:
            return None
        wrong = out.detach().clone()
        if self.kind == "bitflip":
            flat = wrong.view(-1)
            i = int(flat.argmax())
            bits = flat[i : i + 1].view(torch.int32)
            bits ^= 1 << 27  # in place through the view: the element's exponent bit 4
        elif self.kind == "tile":
            wrong[:16, :16] *= 16.0
        elif self.kind == "stale":
            if previous is None or previous.shape != out.shape:
                return None
            wrong = previous
        self.injected += 1
        if self.first is None:
            self.first = self.calls
        return out + (wrong - out).detach()


def _data(rank: int, seed: int) -> Any:
    torch.manual_seed(123)
    teacher = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, CLASSES))
    g = torch.Generator().manual_seed(seed * 1000 + rank)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(BATCH, DIM, generator=g)
        with torch.no_grad():
            noisy = torch.rand(BATCH, generator=g) < 0.1
            y = torch.where(noisy, torch.randint(0, CLASSES, (BATCH,), generator=g), teacher(x).argmax(dim=1))
        return x, y

    return batch


class Run:
    """One model under DDP on this rank, stepped plain or through a Sentinel."""

    def __init__(self, rank: int, seed: int, *, guard: bool, corrupt: bool = True) -> None:
        self.model = _model()
        self.ddp = nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-3)
        self.sentinel = fpdoctor.Sentinel(self.ddp, self.opt) if guard else None
        if self.sentinel is not None and not corrupt:
            self.sentinel._judge.corruption.switch_off("switched off for the benchmark's side-by-side cost")
        self.batch = _data(rank, seed)

    def _step_fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(self.ddp(x), y)
        loss.backward()
        return loss

    def step(self) -> None:
        x, y = self.batch()
        if self.sentinel is None:
            self._step_fn(x, y)
            self.opt.step()
        else:
            self.sentinel.step(self._step_fn, x, y)

    def named(self) -> list[Any]:
        assert self.sentinel is not None
        return [f for f in self.sentinel.findings if f.name == "silent-corruption-suspected"]


def _worker(rank: int, world: int, port: int, out: str, args: dict[str, Any]) -> None:
    node = f"node{rank // args['per_node']}"
    socket.gethostname = lambda: node  # type: ignore[assignment]  # the simulated node's name, this process only
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    results: dict[str, Any] = {"rank": rank, "host": node}
    try:
        results["healthy"] = _healthy(rank, args)
        results["faults"] = {kind: _fault(rank, kind, args) for kind in args["faults"]}
        results["cost"] = _cost(rank, args)
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        dist.destroy_process_group()
        os._exit(0)  # gloo's threads at interpreter exit (tests/numerics/test_sentinel_ddp.py)


def _healthy(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    run = Run(rank, seed=1, guard=True)
    assert run.sentinel is not None
    watch = run.sentinel._judge.corruption
    watch.trace = []
    for _ in range(args["healthy"]):
        run.step()
    report = run.sentinel.report
    data = report.data["corruption"]
    zs = sorted(abs(z) for _, row in watch.trace for z in row)
    return {
        "steps": args["healthy"],
        "strikes": data["strikes"],
        "escalations": len(data["escalations"]),
        "findings": len(run.named()),
        "nonfinite": report.data["nonfinite_steps"],
        "calibration": data.get("calibration"),
        "zs": [round(z, 3) for z in zs],  # this rank's |z| of every judged step (main pools the ranks')
        "line": dict(report.data["summary"])["corruption sentinel"],
    }


def _fault(rank: int, kind: str, args: dict[str, Any]) -> dict[str, Any]:
    run = Run(rank, seed=2 + FAULTS.index(kind), guard=True)
    assert run.sentinel is not None
    fault = Fault(kind, start=args["warm"], every=args["every"])
    if rank == args["faulty"]:
        run.model[2].register_forward_hook(fault)
    step = 0
    while step < args["warm"] + args["limit"]:
        step += 1
        run.step()
        if run.named():  # decided from the agreed norms: every rank stops at the same step
            break
    report = run.sentinel.report
    found = run.named()
    out: dict[str, Any] = {
        "steps": step,
        "nonfinite": report.data["nonfinite_steps"],
        "escalations": len(report.data["corruption"]["escalations"]),
        "injected": fault.injected if rank == args["faulty"] else None,
    }
    if found:
        f = found[0]
        out.update(
            named=f.where.get("rank"), where=f.where, after=step - args["warm"] + 1, message=f.message,
            strikes=f.evidence["strikes"], z=f.evidence["z"], why=f.evidence["named"][0]["why"],
        )  # fmt: skip
    return out


def _cost(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    variants = {
        "plain": Run(rank, seed=9, guard=False),
        "sentinel": Run(rank, seed=9, guard=True, corrupt=False),
        "sentinel+corruption": Run(rank, seed=9, guard=True),
    }
    for run in variants.values():  # warm: DDP's first iterations rebuild buckets, the watch calibrates
        for _ in range(40):
            run.step()
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args["rounds"]):
        for name, run in variants.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args["block"]):
                run.step()
            cpu[name].append((time.process_time() - start_cpu) / args["block"])
            wall[name].append((time.perf_counter() - start) / args["block"])
    # the collective alone: the flags' all-reduce (2 floats, MAX) and the exchange's (2 int64, SUM), and
    # what one float per rank would cost (2 + world floats, MAX: the earlier exchange)
    for name, n, dtype, op in (
        ("allreduce flags", 2, torch.float32, dist.ReduceOp.MAX),
        ("allreduce exchange", 2, torch.int64, dist.ReduceOp.SUM),
        ("allreduce per-rank", 2 + dist.get_world_size(), torch.float32, dist.ReduceOp.MAX),
    ):
        spent, spent_cpu = [], []
        for _ in range(args["rounds"]):
            flags = torch.zeros(n, dtype=dtype)
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args["block"]):
                dist.all_reduce(flags.clone(), op=op)
            spent.append((time.perf_counter() - start) / args["block"])
            spent_cpu.append((time.process_time() - start_cpu) / args["block"])
        wall[name], cpu[name] = spent, spent_cpu
    watched = variants["sentinel+corruption"].sentinel
    assert watched is not None
    strikes = {
        "strikes": watched._judge.corruption.strike_count,
        "escalations": len(watched._judge.corruption.escalations),
    }
    # CPU time is this process's, gloo's threads included: what the rank spends, whoever waits for whom
    return (
        strikes
        | {name: statistics.median(t) for name, t in wall.items()}
        | {f"{name} cpu": statistics.median(t) for name, t in cpu.items()}
    )


def _spawn(args: dict[str, Any]) -> list[dict[str, Any]]:
    world = args["ranks"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_worker, args=(world, port, out, args), nprocs=world, join=False, start_method="spawn")
        while not ctx.join(timeout=1.0):
            pass
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


def _others(logs: list[float]) -> tuple[int, int]:
    """The other ranks' share of the sums (their X and X^2 summed), from their log-norms `logs`."""
    xs = [round(v / corruption.QUANTUM) + corruption._OFFSET for v in logs]
    return sum(xs), sum(x * x for x in xs)


def _sums(packed: torch.Tensor, others: tuple[int, int]) -> torch.Tensor:
    """What the all-reduce gives this rank (`packed`) with the other ranks' share `others`: [A, B, X]
    as `exchange` reads them back (no flags set, no rank asking)."""
    mine = int(packed[2])
    return torch.tensor([(mine + others[0]) << 28, mine * mine + others[1], mine], dtype=torch.int64)


def _host_cost(world: int, steps: int = 300) -> dict[str, float]:
    """The corruption sentinel's host work per step at `world` ranks, outside any process group: the
    two sums packed as `exchange` packs them, and the sums judged (synthetic, healthy; the
    calibrations' share included), microseconds per step. Neither grows with the world."""
    watch = corruption.CorruptionWatch(nn.Linear(1, 1), None, torch.device("cpu"))
    watch.world, watch.off = world, None
    g = torch.Generator().manual_seed(0)
    base = torch.randn(world, generator=g) * 0.1
    flags, norm = torch.zeros(2, dtype=torch.bool), torch.ones(())
    # the other ranks' shares made beforehand: lists of `world` floats made in the timed loop would
    # put their garbage collection into it
    shares = [_others((base + 0.02 * torch.randn(world, generator=g)).tolist()[1:]) for _ in range(steps)]
    build, judge = [], []
    for step, others in enumerate(shares, start=1):
        start = time.perf_counter()
        FlagRead(watch.pack(flags, norm), exact=True)
        build.append(time.perf_counter() - start)
        watch._reads[step] = FlagRead(_sums(watch.pack(flags, norm), others), exact=True)
        start = time.perf_counter()
        watch.observe(step, True, lambda finding: None)
        judge.append(time.perf_counter() - start)
    judged = judge[corruption.CALIBRATION_STEPS :]
    return {"build_us": 1e6 * statistics.median(build), "judge_us": 1e6 * statistics.mean(judged)}


def _own_cost(model: nn.Module, step: Any, world: int = 16, rounds: int = 15, block: int = 10) -> dict[str, float]:
    """The corruption sentinel's own work per step against the CPU step it watches, in this process,
    alternating blocks, medians: the norm over the gradient bytes in DDP's buckets (its first of
    1 MB, then 25 MB), then `exchange` and `observe` as a step runs them, the all-reduce replaced by
    adding the other `world` - 1 ranks' share (synthetic, healthy): the step makes its all-reduce of
    two numbers either way."""
    step()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    first, rest = 2**18, 25 * 2**18  # DDP's bucket caps in float32 elements
    buckets = [grads[:first], *grads[first:].split(rest)] if grads.numel() > first else [grads]
    bucket_watch = BucketWatch(nn.Linear(1, 1))
    watch = corruption.CorruptionWatch(nn.Linear(1, 1), bucket_watch, torch.device("cpu"))
    watch.world, watch.off = world, None
    g = torch.Generator().manual_seed(0)
    base = torch.randn(world, generator=g) * 0.1
    total = corruption.CALIBRATION_STEPS + 5 + rounds * block
    scale = math.log(float(torch.linalg.vector_norm(grads)))  # about this rank's own log-norm: a healthy spread
    shares = [_others((scale + base + 0.02 * torch.randn(world, generator=g)).tolist()[1:]) for _ in range(total)]
    # the other ranks' share of [A, B] per step, made beforehand: the stand-in for the all-reduce is one add
    others = [torch.tensor([s << 28, q], dtype=torch.int64) for s, q in shares]
    flags = torch.zeros(2)
    n = 0

    def reduce(packed: torch.Tensor) -> None:  # the other ranks' share added, as the all-reduce would
        packed.add_(others[n])

    watch.reduce = reduce

    def own() -> None:
        nonlocal n
        norms = [torch.linalg.vector_norm(b, dtype=torch.float32) for b in buckets]
        bucket_watch._norms = norms  # as the DDP hook leaves them
        watch.exchange(flags, n)
        watch.observe(n, True, lambda finding: None)
        n += 1

    for _ in range(corruption.CALIBRATION_STEPS + 5):
        own()
    steps, owns = [], []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(block):
            step()
        steps.append((time.process_time() - start) / block)
        start = time.process_time()
        for _ in range(block):
            own()
        owns.append((time.process_time() - start) / block)
    return {"step_ms": 1e3 * statistics.median(steps), "own_us": 1e6 * statistics.median(owns)}


def _cpu_steps() -> dict[str, Any]:
    """The CPU steps the own work is put against: this benchmark's MLP (a batch of 64) and the small
    transformer of the numerics budgets (benchmarks/models.py, 8 x 64 tokens), AdamW, one thread."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import batch, make_step, small_transformer

    torch.set_num_threads(1)
    mlp = _model()
    opt = torch.optim.AdamW(mlp.parameters(), lr=1e-3)
    data = _data(0, 1)

    def mlp_step() -> None:
        x, y = data()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(mlp(x), y).backward()
        opt.step()

    lm = small_transformer()
    lm_opt = torch.optim.AdamW(lm.parameters(), lr=1e-4)
    lm_fn = make_step(lm, lm_opt)
    tokens, targets = batch()

    def lm_step() -> None:
        lm_fn(tokens, targets)
        lm_opt.step()

    return {"mlp": _own_cost(mlp, mlp_step), "small transformer": _own_cost(lm, lm_step)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--faulty", type=int, default=None, help="the faulty rank (default: the last node's second)")
    parser.add_argument("--healthy", type=int, default=1000)
    parser.add_argument("--warm", type=int, default=100, help="healthy steps before the first faulty call")
    parser.add_argument("--every", type=int, default=4, help="every N-th call of the layer is corrupted")
    parser.add_argument("--limit", type=int, default=200, help="steps after the first faulty call, at most")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--block", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="4 ranks, 300 healthy steps, 3 cost rounds")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    ns = parser.parse_args()
    if ns.quick:
        ns.ranks, ns.healthy, ns.rounds = 4, 300, 3
    faulty = ns.faulty if ns.faulty is not None else max(0, ns.ranks - ns.per_node + 1)
    args = {
        "ranks": ns.ranks, "per_node": ns.per_node, "faulty": faulty, "healthy": ns.healthy, "warm": ns.warm,
        "every": ns.every, "limit": ns.limit, "faults": ns.faults.split(","), "rounds": ns.rounds, "block": ns.block,
    }  # fmt: skip
    nodes = math.ceil(ns.ranks / ns.per_node)
    print(
        f"{ns.ranks} gloo ranks ({nodes} nodes of {ns.per_node}), {os.cpu_count()} CPU cores; fault on rank {faulty} "
        f"(node{faulty // ns.per_node}) every {ns.every}-th call of its middle Linear from step {ns.warm}"
    )
    started = time.perf_counter()
    results = _spawn(args)
    wall = time.perf_counter() - started
    errors = [f"rank {r['rank']}: {r['error']}" for r in results if "error" in r]
    if errors:
        print("\n".join(errors))
        return 1
    figures: dict[str, Any] = {"ranks": ns.ranks, "per_node": ns.per_node, "faulty": faulty, "wall_s": wall}

    healthy = dict(results[0]["healthy"])
    findings = sum(r["healthy"]["findings"] for r in results) / ns.ranks  # the same on every rank
    healthy["strikes"] = sum(r["healthy"]["strikes"] for r in results)  # each rank counts its own
    zs = sorted(z for r in results for z in r["healthy"].pop("zs"))
    del healthy["zs"]
    healthy["z_p99"], healthy["z_max"] = (zs[int(0.99 * (len(zs) - 1))], zs[-1]) if zs else (math.nan, math.nan)
    per_k = 1000 / healthy["steps"]
    figures["healthy"] = healthy | {"false_alarms_per_1000": findings * per_k}
    print(
        f"\nhealthy, {healthy['steps']} steps x {ns.ranks} ranks: findings {findings * per_k:.2f} / 1000 steps, "
        f"escalations {healthy['escalations'] * per_k:.2f} / 1000, strikes {healthy['strikes'] * per_k:.2f} / 1000 "
        f"(|z| p99 {healthy['z_p99']:.2f}, max {healthy['z_max']:.2f}, threshold {corruption.THRESHOLD:g}); "
        f"non-finite steps {healthy['nonfinite']}"
    )
    print(f"  {healthy['line']}")

    figures["faults"] = {}
    columns = f"{'fault':8} {'found after':>12} {'named':>6} {'right':>6} {'NaN steps':>10} {'escalations':>12}"
    print(f"\n{columns}  strikes (z)")
    for kind in args["faults"]:
        r = results[0]["faults"][kind]
        injected = results[faulty]["faults"][kind]["injected"]
        right = r.get("named") == faulty
        after = f"{r['after']} steps" if "after" in r else f"> {ns.limit}"
        z = ", ".join(f"{v:g}" for v in r.get("z", []))
        print(
            f"{kind:8} {after:>12} {r.get('named', '-')!s:>6} {right!s:>6} {r['nonfinite']:>10} "
            f"{r['escalations']:>12}  {r.get('strikes', '-')} ({z}); {injected} faulty calls"
        )
        figures["faults"][kind] = r | {"right": right, "injected": injected}
    named = next((r for r in figures["faults"].values() if "message" in r), None)
    if named is not None:
        print(f"  e.g. {named['message']}")

    cost = {name: statistics.median(r["cost"][name] for r in results) for name in results[0]["cost"]}
    figures["cost"] = cost
    print(
        f"\nper step, medians of {ns.rounds} alternating blocks of {ns.block} steps (CPU: a rank's own, median rank):"
    )
    for unit, suffix in (("wall", ""), ("CPU", " cpu")):
        plain, guarded, full = (cost[n + suffix] for n in ("plain", "sentinel", "sentinel+corruption"))
        figures["cost"][f"ratio{suffix.replace(' ', '_')}"] = full / guarded
        print(
            f"  {unit:4}: plain DDP {plain * 1e3:.2f} ms, Sentinel {guarded * 1e3:.2f} ms, Sentinel + corruption "
            f"sentinel {full * 1e3:.2f} ms: the corruption sentinel x{full / guarded:.3f} "
            f"({(full / guarded - 1) * 100:+.1f}%; budget +3% of a CPU step)"
        )

    print(f"  (the measured corruption sentinel: {cost['strikes']:g} strikes, {cost['escalations']:g} escalations)")
    parts = [
        f"{label} {cost[name] * 1e3:.2f} ms wall, {cost[name + ' cpu'] * 1e3:.2f} ms CPU"
        for name, label in (
            ("allreduce flags", "the flags alone (2 floats, MAX)"),
            ("allreduce exchange", "the exchange (2 int64, SUM)"),
            ("allreduce per-rank", f"one float per rank ({2 + ns.ranks} floats, MAX)"),
        )
    ]
    print("  the all-reduce alone (gloo): " + "; ".join(parts))
    own = _cpu_steps()
    figures["own"] = own
    for name, o in own.items():
        share = o["own_us"] / (o["step_ms"] * 1e3)
        o["share"] = share
        print(
            f"  own work, {name}: {o['own_us']:.0f} us per step of {o['step_ms']:.2f} ms CPU = {share:.2%} "
            "(in one process, alternating blocks)"
        )
    figures["host"] = {}
    for world in (16, 256, 10_000):
        host = _host_cost(world)
        figures["host"][world] = host | {"allreduce_bytes": 16}
        print(
            f"host work at {world:>6} ranks: packing {host['build_us']:.0f} us, judgement {host['judge_us']:.0f} us "
            "per step; the all-reduce carries 16 bytes (2 int64) at any world size"
        )
    if ns.json:
        Path(ns.json).write_text(json.dumps(figures, indent=1, default=str))
    print(f"\n{wall:.0f} s for the simulation")
    ok = findings == 0 and all(r["right"] and r["nonfinite"] == 0 for r in figures["faults"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
