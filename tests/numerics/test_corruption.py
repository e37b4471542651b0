"""The corruption sentinel (numerics/training/corruption.py): a rank whose device computes finite
wrong numbers, named from the per-rank gradient norms in the step's all-reduce and a recomputation
of the model's GEMMs on every rank. gloo on loopback, CPU; the 16-rank simulation with its figures
is benchmarks/bench_sdc.py."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fpdoctor
from fpdoctor.numerics.training import corruption

TIMEOUT_S = 60
WORLD = 4
FAULTY = 2


@contextlib.contextmanager
def _rank_results(rank: int, world: int, port: int, out: str) -> Iterator[dict]:
    """One gloo rank: yields its results dict, written to out/rank{rank}.json whatever happens."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    results: dict = {}
    try:
        yield results
    except Exception as exc:
        results["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        dist.destroy_process_group()
        os._exit(0)  # torch's teardown of gloo's threads stays out of the test (test_sentinel_ddp.py)


def _spawn(worker, tmp_path: Path, world: int = WORLD) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    ctx = mp.start_processes(worker, args=(world, port, str(tmp_path)), nprocs=world, join=False, start_method="spawn")
    for _ in range(4 * TIMEOUT_S):
        if ctx.join(timeout=0.5):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("the gloo ranks did not finish in time")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert not [r["error"] for r in results if "error" in r]
    return results


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


BATCH = 128


def _train(rank: int, steps: int, *, guard: bool = True, fault=None, stop_at_finding: bool = False):
    """A teacher-student classification under DDP, each rank its own batches; `fault(layer)`
    registers a fault on this rank's middle Linear. Returns (ddp, sentinel or None, steps run)."""
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sentinel = fpdoctor.Sentinel(ddp, opt) if guard else None
    torch.manual_seed(123)
    teacher = nn.Linear(16, 4)
    g = torch.Generator().manual_seed(1000 + rank)
    if fault is not None:
        fault(model[2])

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        return loss

    for i in range(1, steps + 1):
        x = torch.randn(BATCH, 16, generator=g)
        with torch.no_grad():  # a tenth of the labels random: the loss, and the gradients' noise, settle
            y = torch.where(
                torch.rand(BATCH, generator=g) < 0.1,
                torch.randint(0, 4, (BATCH,), generator=g),
                teacher(x).argmax(dim=1),
            )
        if sentinel is None:
            step(x, y)
            opt.step()
        else:
            sentinel.step(step, x, y)
            if stop_at_finding and any(f.name == "silent-corruption-suspected" for f in sentinel.findings):
                return ddp, sentinel, i
    return ddp, sentinel, steps


def _bit_flip(rank: int, start_call: int, every: int):
    """From the `start_call`-th forward on, every `every`-th output of the layer on `rank` has its
    largest element times 2^16, as an exponent bit flipped from 0 to 1 makes it: a finite wrong
    number; the gradient is left to flow as computed."""

    def install(layer: nn.Module) -> None:
        if dist.get_rank() != rank:
            return
        calls = {"n": 0}

        def hook(module, args, out):
            calls["n"] += 1
            if calls["n"] < start_call or calls["n"] % every:
                return None
            wrong = out.detach().clone().view(-1)
            wrong[int(wrong.argmax())] *= 2.0**16
            return out + (wrong.view_as(out) - out).detach()

        layer.register_forward_hook(hook)

    return install


def _healthy_worker(rank: int, world: int, port: int, out: str) -> None:
    with _rank_results(rank, world, port, out) as results:
        _, sentinel, _ = _train(rank, 160)
        report = sentinel.report
        results["data"] = report.data["corruption"]
        results["line"] = dict(report.data["summary"])["corruption sentinel"]
        results["names"] = [f.name for f in report.findings]
        results["nonfinite"] = report.data["nonfinite_steps"]


@pytest.mark.jobs
def test_a_healthy_run_is_calibrated_says_so_and_gives_no_finding(tmp_path: Path) -> None:
    results = _spawn(_healthy_worker, tmp_path)
    for r in results:
        assert "silent-corruption-suspected" not in r["names"]
        assert r["nonfinite"] == 0
        data = r["data"]
        assert data["judged_steps"] == 160 and data["escalations"] == []
        cal = data["calibration"]
        assert cal["threshold"] == corruption.THRESHOLD and isinstance(cal["centre"], float)
        assert cal["spread"] > 0 and cal["window"][1] > cal["window"][0]
        assert "calibrated on steps" in r["line"] and f"{WORLD} ranks' gradient norms" in r["line"]
    # every rank read the same sums: the same spread over the same steps everywhere; each its own centre
    shared = {json.dumps({k: v for k, v in r["data"]["calibration"].items() if k != "centre"}) for r in results}
    assert len(shared) == 1


def _fault_worker(rank: int, world: int, port: int, out: str) -> None:
    with _rank_results(rank, world, port, out) as results:
        _, sentinel, ran = _train(rank, 160, fault=_bit_flip(FAULTY, start_call=60, every=4), stop_at_finding=True)
        report = sentinel.report
        results["ran"] = ran
        results["nonfinite"] = report.data["nonfinite_steps"]
        results["findings"] = [f.to_dict() for f in report.findings if f.name == "silent-corruption-suspected"]


@pytest.mark.jobs
def test_a_bit_flip_on_one_rank_names_that_rank_without_a_nan(tmp_path: Path) -> None:
    results = _spawn(_fault_worker, tmp_path)
    for r in results:
        assert r["nonfinite"] == 0  # found by the statistic and the recomputation alone
        # within one strike window of the first faulty forward (a flip the loss masks is no strike)
        assert 60 < r["ran"] < 60 + corruption.STRIKE_WINDOW, r["ran"]
        [finding] = r["findings"]
        assert finding["code"] == "TRN017" and finding["severity"] == "error"
        assert finding["where"]["rank"] == FAULTY and finding["where"]["device"] == "cpu"
        assert f"rank {FAULTY}" in finding["message"]
        evidence = finding["evidence"]
        assert evidence["calibration"]["steps"] >= corruption.SETTLE
        assert len(evidence["strikes"]) >= corruption.STRIKES
        assert all(z > corruption.THRESHOLD for z in evidence["z"])
        [named] = evidence["named"]
        assert named["identity"]["rank"] == FAULTY and "host" in named["identity"]
        assert "fp64 rounding bound" in named["why"]
        assert "fpdoctor health" in finding["fix"] and finding["fix_trial"]["status"] == "not-tried"
    assert len({r["ran"] for r in results}) == 1  # every rank decided at the same step


def _weights_worker(rank: int, world: int, port: int, out: str) -> None:
    with _rank_results(rank, world, port, out) as results:
        plain, _, _ = _train(rank, 60, guard=False)
        # a threshold no step passes under: every rank strikes, the escalation runs (and names nobody)
        corruption.THRESHOLD = 0.0
        watched, sentinel, _ = _train(rank, 60)
        data = sentinel.report.data["corruption"]
        results["escalations"] = len(data["escalations"])
        results["named"] = [e["named"] for e in data["escalations"]]
        results["equal"] = all(
            torch.equal(a, b) for a, b in zip(plain.state_dict().values(), watched.state_dict().values(), strict=True)
        )


@pytest.mark.jobs
def test_the_observer_leaves_the_weights_bitwise_as_a_plain_run_even_when_it_escalates(tmp_path: Path) -> None:
    results = _spawn(_weights_worker, tmp_path)
    for r in results:
        assert r["equal"]
        assert r["escalations"] == corruption.ESCALATIONS
        assert r["named"] == [[]] * corruption.ESCALATIONS  # a healthy machine: recomputation agrees


# -- the decision from the gathered recomputations, one process ------------------------------------


def _entry(rank: int, worst: list[float], sums: list[list[float]], weights: list[float]) -> dict:
    return {
        "identity": {"rank": rank, "host": f"node{rank // 4}", "device": "cpu"},
        "gemms": ["a", "b"],
        "worst": worst,
        "sums": sums,
        "weights": weights,
    }


def test_the_rank_out_of_its_fp64_bound_is_named_and_a_kernel_out_everywhere_is_not() -> None:
    good = [[1.0, 2.0], [3.0, 4.0]]
    everyone = [_entry(r, [0.1, 0.2], good, [1.0, 2.0]) for r in range(8)]
    everyone[5] = _entry(5, [0.1, 4e6], good, [1.0, 2.0])
    named, note = corruption.disagreeing(everyone)
    assert [n["identity"]["rank"] for n in named] == [5] and not note
    assert "b 4e+06x" in named[0]["why"]
    out_everywhere = [_entry(r, [3.0, 0.2], good, [1.0, 2.0]) for r in range(8)]
    named, note = corruption.disagreeing(out_everywhere)
    assert named == [] and "the kernel, not one device" in note


def test_a_rank_differing_bit_for_bit_or_in_its_weights_is_named_where_the_others_agree() -> None:
    good = [[1.0, 2.0], [3.0, 4.0]]
    everyone = [_entry(r, [0.1, 0.2], good, [1.0, 2.0]) for r in range(4)]
    everyone[3] = _entry(3, [0.1, 0.2], [[1.0, 2.0000001], [3.0, 4.0]], [1.0, 2.0])
    named, _ = corruption.disagreeing(everyone)
    assert [n["identity"]["rank"] for n in named] == [3] and "bit for bit" in named[0]["why"]
    everyone[3] = _entry(3, [0.1, 0.2], good, [1.0, 2.5])
    named, _ = corruption.disagreeing(everyone)
    assert [n["identity"]["rank"] for n in named] == [3] and "replica of the weights" in named[0]["why"]
    # two ranks each differing their own way: nobody disagrees with everyone
    everyone[2] = _entry(2, [0.1, 0.2], good, [1.0, 3.5])
    named, note = corruption.disagreeing(everyone)
    assert named == [] and "the ranks agree" in note


def test_the_recomputation_sees_a_stale_result_and_a_healthy_layer_stays_within_its_bound() -> None:
    model = _model()
    healthy = corruption.recompute(model)
    assert len(healthy["gemms"]) == 3 and all(w <= 1.0 for w in healthy["worst"])
    previous: dict = {}

    def stale(module, args, out):  # each call returns the one before's result: a buffer not rewritten
        last, previous["out"] = previous.get("out"), out.detach().clone()
        return last if last is not None and last.shape == out.shape else None

    model[2].register_forward_hook(stale)
    faulty = corruption.recompute(model)
    assert faulty["worst"][0] <= 1.0 and faulty["worst"][2] <= 1.0
    assert faulty["worst"][1] > 1e3


# -- the packed exchange, one process: WORLD watches summed as the all-reduce would ----------------


def _watches(world: int) -> list[corruption.CorruptionWatch]:
    out = []
    for rank in range(world):
        w = corruption.CorruptionWatch(nn.Linear(1, 1), None, torch.device("cpu"))
        w.world, w.rank, w.off = world, rank, None
        out.append(w)
    return out


def _step(watches, step: int, norms: list[float | None], flags: list[tuple[float, float]]) -> list[list[float]]:
    """Each watch packs its flags and norm, the packs are summed (the all-reduce), each reads the sum."""
    packs = [
        w.pack(torch.tensor(f), None if n is None else torch.tensor(n))
        for w, n, f in zip(watches, norms, flags, strict=True)
    ]
    total = torch.stack([p[:2] for p in packs]).sum(dim=0)
    agreed = []
    for w, p in zip(watches, packs, strict=True):
        w._reads[step] = corruption.FlagRead(torch.cat([total, p[2:]]), exact=True)
        counts = [v & (2**14 - 1) for v in (int(total[0]), int(total[0]) >> 14)]
        agreed.append([float(c != 0) for c in counts])
    return agreed


def test_the_packed_sums_give_back_the_flags_as_their_maximum_and_count_ranks_exactly() -> None:
    world = 5
    watches = _watches(world)
    flags = [(0.0, 0.0), (1.0, 0.0), (0.0, float("nan")), (0.0, 0.0), (1.0, 1.0)]
    agreed = _step(watches, 1, [1.0, 2.0, float("nan"), 0.0, None], flags)
    assert agreed == [[1.0, 1.0]] * world
    a, b, _ = watches[0]._reads[1].ints()
    assert a & (2**14 - 1) == 2 and (a >> 14) & (2**14 - 1) == 2  # two ranks each, counted exactly
    assert (b >> 52) & (2**11 - 1) == 1  # one rank sent no norm: the step is not judged
    assert _step(watches, 2, [1.0] * world, [(0.0, 0.0)] * world) == [[0.0, 0.0]] * world


def test_the_device_packing_and_the_host_packing_agree_bit_for_bit() -> None:
    [watch] = _watches(1)
    watch.world, watch._centre = 4, 0.37
    norms = [None, 0.0, 1e-30, 0.5, 3.0, 1e12, 1e30, float("inf"), float("nan")]
    for flags in ([0.0, 0.0], [1.0, 0.0], [0.0, float("nan")], [1.0, 1.0]):
        for norm in norms:
            for ask in (False, True):
                packs = []
                for on_device in (False, True):
                    watch._ask = ask
                    given = None if norm is None else torch.tensor(norm)
                    packs.append(watch.pack(torch.tensor(flags), given, on_device=on_device).tolist())
                assert packs[0] == packs[1], (flags, norm, ask)
                x = packs[0][2]
                assert 0 <= x < 2 * corruption._OFFSET
                if norm is not None and math.isnan(norm):
                    assert x == corruption._OFFSET  # the centre: a non-finite step is not judged anyway


def test_each_rank_judges_itself_from_the_sums_and_the_odd_one_asks_for_an_escalation() -> None:
    world, faulty = 6, 4
    watches = _watches(world)
    g = torch.Generator().manual_seed(0)
    offsets = [0.3 * r for r in range(world)]  # data that differ by rank for good: each its own centre
    asks = []
    for step in range(1, 140):
        noise = (0.05 * torch.randn(world, generator=g)).tolist()
        logs = [2.0 - 0.01 * step + o + e for o, e in zip(offsets, noise, strict=True)]  # the loss falls
        if step >= 100 and step % 3 == 0:
            logs[faulty] += 1.5  # finite and wrong: 4.5x the norm
        _step(watches, step, [math.exp(v) for v in logs], [(0.0, 0.0)] * world)
        for w in watches:
            w.observe(step, True, lambda f: pytest.fail("no finding without an escalation"))
        asks.append([w._ask for w in watches])
        for w in watches:
            w._ask = False  # as sent by the next exchange
    spreads = {w.calibration.spread for w in watches if w.calibration is not None}
    assert len(spreads) == 1 and 0.03 < spreads.pop() < 0.1  # the same spread everywhere, about the noise
    assert [round(w._centre, 1) for w in watches] != [0.0] * world
    assert [w.strike_count for w in watches if w.rank != faulty] == [0] * (world - 1)
    assert watches[faulty].strike_count >= corruption.STRIKES
    first = next(i for i, a in enumerate(asks, start=1) if any(a))
    assert asks[first - 1] == [r == faulty for r in range(world)] and first < 100 + corruption.STRIKE_WINDOW
