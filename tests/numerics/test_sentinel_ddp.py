"""The sentinel under DDP (gloo on loopback, CPU): every rank names the rank that held the fault."""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import gc
import json
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fpdoctor
from tests.conftest import one_job_at_a_time

pytestmark = pytest.mark.jobs  # 2- and 3-rank gloo jobs

TIMEOUT_S = 60


@contextlib.contextmanager
def _rank_results(rank: int, world: int, port: int, out: str, *, timeout_s: float) -> Iterator[dict]:
    """One gloo rank of a spawned test: yields the results dict, which is written to
    out/rank{rank}.json whatever happens (an exception becomes results["error"])."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    results: dict = {}
    try:
        yield results
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        dist.destroy_process_group()
        _exit_now()


def _exit_now() -> None:
    """End a worker once its results are written. Where an all-reduce carries the backward's
    Python context into gloo's threads (torch's own default_hooks.allreduce_hook, 3 of 12 runs
    here, and plain DDP's own all-reduce), a rank sometimes aborts at interpreter exit
    ("terminate called without an active exception"). The sentinel's hook no longer does (the
    last test below); ending here keeps torch's teardown out of every other test."""
    os._exit(0)


def _spawn(worker, world: int, tmp_path: Path, limit_s: float = 2 * TIMEOUT_S) -> list[dict]:
    """Run `worker` on `world` gloo ranks (spawned, bounded in time); each rank's results."""
    ctx = mp.start_processes(
        worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=False, start_method="spawn"
    )
    for _ in range(int(2 * limit_s)):
        if ctx.join(timeout=0.5):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("the DDP ranks did not finish in time")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _batches(rank: int, n: int = 4):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def _run(ddp, opt, guard, batches, fault=None):
    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        return loss

    for i, (clean, y) in enumerate(batches):
        x = clean if fault is None else fault(i, clean)
        if guard is None:
            step(x, y)
            opt.step()
        else:
            guard.step(step, x, y)


def _summary(guard) -> list:
    return [
        [f.name, {k: v for k, v in f.where.items() if k in ("rank", "step", "op", "host", "device")}, f.evidence]
        for f in guard.report.findings
    ]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    with _rank_results(rank, world, port, out, timeout_s=TIMEOUT_S) as results:
        # a one-off fault on rank 1: a NaN written into one local gradient, once
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        guard = fpdoctor.Sentinel(ddp, opt)
        fired = {"n": 0}

        def flip(grad):
            fired["n"] += 1
            if rank == 1 and fired["n"] == 2:
                grad = grad.clone()
                grad[0, 0] = float("nan")
            return grad

        model[0].weight.register_hook(flip)
        _run(ddp, opt, guard, _batches(rank))
        results["transient"] = _summary(guard)
        results["transient_verdicts"] = guard.report.data["verdicts"]

        # a NaN in rank 1's batch at step 2: deterministic, named by the replay on rank 1
        model = _model()
        ddp = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        guard = fpdoctor.Sentinel(ddp, opt)

        def poison(i, x):
            if rank == 1 and i == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            return x

        _run(ddp, opt, guard, _batches(rank), poison)
        results["deterministic"] = _summary(guard)

        # finite steps: bitwise the unguarded DDP run
        params = []
        for guarded in (False, True):
            model = _model(seed=5)
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.AdamW(ddp.parameters(), lr=0.01)
            _run(ddp, opt, fpdoctor.Sentinel(ddp, opt) if guarded else None, _batches(rank, 3))
            params.append([p.detach().clone() for p in model.parameters()])
        results["bitwise"] = all(torch.equal(a, b) for a, b in zip(*params, strict=True))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
def test_every_rank_names_the_rank_that_held_the_fault(tmp_path):
    # three ranks: the fault's rank is neither the first nor the last, and a third of each
    # gradient is not exact in binary (the average DDP computes, bit for bit); the 2-rank jobs
    # below, and watch's under torchrun, cover two
    results = _spawn(_worker, 3, tmp_path)
    for r, res in enumerate(results):
        assert "error" not in res, (r, res)
        transient = res["transient"]
        assert [name for name, _, _ in transient] == ["nonfinite-gradient", "transient-fault-suspected"], r
        grad_finding, verdict = transient
        for where in (grad_finding[1], verdict[1]):
            assert (where["rank"], where["step"]) == (1, 2)
        assert grad_finding[2]["kind"] == "nan" and "module.0.weight" in grad_finding[2]["parameters"]
        assert "buckets" in grad_finding[2]
        assert res["transient_verdicts"] == {"2": "transient-fault-suspected"}
        assert verdict[2]["kind"] == "nan"  # the bad step's own kind
        for _, where, evidence in transient + res["deterministic"]:  # every training finding says where
            assert where["host"] and where["device"] == "cpu" and evidence["step"] == where["step"], where

        deterministic = res["deterministic"]
        names = [name for name, _, _ in deterministic]
        assert names[:2] == ["deterministic-nonfinite", "nonfinite-loss"], (r, names)  # the cause first
        assert all(where.get("rank") == 1 for _, where, _ in deterministic), (r, deterministic)
        assert deterministic[0][1]["op"] and deterministic[0][1]["step"] == 2
        assert res["bitwise"], r
    assert all(res["deterministic"] == results[0]["deterministic"] for res in results)  # one story on every rank
    assert all(res["transient"] == results[0]["transient"] for res in results)


def _pair_worker(rank: int, world: int, port: int, out: str) -> None:
    """The two 2-rank scenarios below, one after the other on the same ranks (one job, not two: each
    spawned rank imports torch anew); each scenario's objects are gone before the next begins, and
    each writes its results under its own key."""
    # a short timeout: a collective issued on one rank only would hang both, and fail here in time
    with _rank_results(rank, world, port, out, timeout_s=15) as results:
        results["collective"] = _collective(rank)
        gc.collect()
        results["leak"] = _leak(rank)


@pytest.fixture(scope="module")
def pair_job(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Each rank's results of the 2-rank job of `_pair_worker`, run once for the module's tests."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    out = tmp_path_factory.mktemp("pair")
    with one_job_at_a_time(tmp_path_factory):  # set up before the tests' own lock is taken
        return _spawn(_pair_worker, 2, out, limit_s=90)


def _collective(rank: int) -> dict:
    results: dict = {}
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    guard = fpdoctor.Sentinel(ddp, opt)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # a logging collective inside the step, replayed on every rank
        return loss

    for i, (clean, y) in enumerate(_batches(rank, 3)):
        x = clean.clone()
        if rank == 1 and i == 0:  # the very first iteration: DDP still rebuilds its buckets
            x[0, 0] = float("nan")
        guard.step(step, x, y)
    results["findings"] = _summary(guard)
    results["verdicts"] = guard.report.data["verdicts"]
    results["finite"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return results


def test_every_rank_replays_so_collectives_inside_the_step_match(pair_job):
    results = [{"error": res["error"]} if "error" in res else res["collective"] for res in pair_job]
    for r, res in enumerate(results):
        assert "error" not in res, (r, res)
        names = [name for name, _, _ in res["findings"]]
        assert names[:2] == ["deterministic-nonfinite", "nonfinite-loss"], (r, names)
        assert all(where.get("rank") == 1 and where.get("step") == 1 for _, where, _ in res["findings"]), r
        assert res["verdicts"] == {"1": "deterministic-nonfinite"}
        assert res["finite"], r
    assert results[0]["findings"] == results[1]["findings"]


@contextlib.contextmanager
def _where_backward_contexts_go() -> Iterator[list[bool]]:
    """For each Python context torch stashes for a backward (torch 2.13 does), whether the thread
    that dropped its last reference was the main one. gloo's worker thread doing it at interpreter
    shutdown aborts the process (torchprivate.without_backward_context)."""
    freed: list[bool] = []
    stash = getattr(torch._C, "_stash_obj_in_tls", None)

    class Tracker:
        def __del__(self) -> None:
            freed.append(threading.get_ident() == threading.main_thread().ident)

    if stash is None:
        yield freed
        return
    var: contextvars.ContextVar[Tracker] = contextvars.ContextVar("fpdoctor_test_tracker")

    def tracking(key: str, obj: object) -> None:
        if key == "context" and isinstance(obj, contextvars.Context):
            obj.run(var.set, Tracker())  # freed with the context
        stash(key, obj)

    torch._C._stash_obj_in_tls = tracking
    try:
        yield freed
    finally:
        torch._C._stash_obj_in_tls = stash


def _leak(rank: int) -> dict:
    results: dict = {}
    with _where_backward_contexts_go() as freed:
        model = _model()
        # small buckets: several per backward, so that the records of one backward are several
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        guard = fpdoctor.Sentinel(ddp, opt)
        watch = guard._judge.bucket_watch
        x, y = _batches(rank, 1)[0]
        for _ in range(20):  # the model trains on without the sentinel's step
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        results["records_while_held"] = len(watch._records)
        results["buckets"] = len({r[0] for r in watch._records})
        ref = weakref.ref(watch)
        del guard, watch
        gc.collect()
        results["watch_collected"] = ref() is None
        for _ in range(3):  # the hook left on the model still all-reduces, as DDP does
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        results["params"] = [p.detach().sum().item() for p in model.parameters()]
        del ddp, opt, model
        gc.collect()  # the DDP model goes, and with it the last backward's all-reduces
        results["contexts_freed_on_main"] = freed[:]
    return results


def test_the_bucket_hook_keeps_one_backward_and_lets_the_sentinel_go(pair_job):
    results = [{"error": res["error"]} if "error" in res else res["leak"] for res in pair_job]
    for r, res in enumerate(results):
        assert "error" not in res, (r, res)
        assert res["buckets"] > 1, r
        assert res["records_while_held"] == res["buckets"], r  # one backward's, not 20
        if hasattr(torch._C, "_stash_obj_in_tls"):  # 23 backwards' contexts, each dropped by the main thread
            assert len(res["contexts_freed_on_main"]) >= 20 and all(res["contexts_freed_on_main"]), r
        assert res["watch_collected"], r
    assert results[0]["params"] == results[1]["params"]  # the replicas still average their gradients
