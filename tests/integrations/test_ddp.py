"""Both callbacks under DDP (2 ranks, gloo on loopback, CPU, launched as torchrun would): every rank
names the rank that held the fault, skips the same steps, and writes its own report."""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch.multiprocessing as mp

pytestmark = pytest.mark.jobs  # 2-rank gloo jobs

TIMEOUT_S = 120
NAN = float("nan")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(worker, tmp_path: Path, world: int = 2) -> list[dict]:
    """Run `worker(rank, out)` on `world` processes with torchrun's environment; each rank's results."""
    port = _free_port()
    ctx = mp.start_processes(
        _rank_main, args=(worker, world, port, str(tmp_path)), nprocs=world, join=False, start_method="spawn"
    )
    for _ in range(2 * TIMEOUT_S):
        if ctx.join(timeout=0.5):
            break
    else:
        for p in ctx.processes:
            p.kill()
        pytest.fail("the DDP ranks did not finish in time")
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, worker, world: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        TORCHELASTIC_RUN_ID="fpdoctor-test",
        HF_HUB_OFFLINE="1",
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    results: dict = {}
    try:
        worker(rank, out, results)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(results, default=str))
        # a Python DDP communication hook makes gloo abort now and then at interpreter exit, after
        # every result is written (see tests/numerics/test_sentinel_ddp.py)
        os._exit(0)


def _summary(report) -> list:
    return [[f.name, f.where.get("rank"), f.evidence.get("step"), f.evidence.get("buckets")] for f in report.findings]


def _lightning_worker(rank: int, out: str, results: dict) -> None:
    import torch

    from fpdoctor.integrations.lightning import FpDoctorCallback
    from tests.integrations.lit import Net, Weights, data, pl

    class OnRank1(Net):
        """Rank 1 only: a NaN in its batch at step 2, and a NaN in its local gradient at step 4."""

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_rank == 1 and self._step() == 2:
                x = x.clone()
                x[0, 0] = NAN
            return torch.nn.functional.mse_loss(self.net(x), y)

        def _grad_hook(self, grad):
            step = self._step()
            self.backwards[step] = self.backwards.get(step, 0) + 1
            if self.global_rank == 1 and step == 4 and self.backwards[step] == 1:
                grad = grad.clone()
                grad[0, 0] = NAN
            return grad

    callback = FpDoctorCallback(report_path=str(Path(out, "lightning.json")))
    weights = Weights()
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback, weights],
    )
    module = OnRank1()
    trainer.fit(module, data())
    report = callback.report
    results["findings"] = _summary(report)
    results["verdicts"] = report.data["verdicts"]
    results["skipped"] = report.data["skipped_steps"]
    results["unchanged"] = [
        all(torch.equal(a, b) for a, b in zip(weights.before[s], weights.before[s + 1], strict=True)) for s in (2, 4)
    ]
    results["weights"] = [float(p.detach().double().sum()) for p in module.parameters()]


@pytest.mark.timeout(300)
def test_lightning_ddp_names_the_rank_that_held_the_fault(tmp_path):
    pytest.importorskip("lightning.pytorch", reason="the Lightning callback's tests need lightning (`make test`)")
    ranks = _launch(_lightning_worker, tmp_path)
    for r in ranks:
        assert "error" not in r, r["error"]
    for r in ranks:
        names = [(name, rank, step) for name, rank, step, _ in r["findings"]]
        # every rank reports the same: rank 1's loss at step 2, rank 1's gradient at step 4
        assert ("nonfinite-loss", 1, 2) in names and ("deterministic-nonfinite", 1, 2) in names
        assert ("nonfinite-gradient", 1, 4) in names and ("transient-fault-suspected", 1, 4) in names
        assert not any(rank == 0 for _, rank, _ in names)
        (grad,) = [f for f in r["findings"] if f[0] == "nonfinite-gradient"]
        assert grad[3]  # the DDP bucket that held it, before the all-reduce
        assert r["verdicts"] == {"2": "deterministic-nonfinite", "4": "transient-fault-suspected"}
        assert r["skipped"] == 2 and r["unchanged"] == [True, True]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # both ranks skipped the same steps
    assert sorted(p.name for p in tmp_path.glob("lightning*.json")) == ["lightning.rank0.json", "lightning.rank1.json"]


def _hf_worker(rank: int, out: str, results: dict) -> None:
    import torch

    from fpdoctor.integrations.hf import FpDoctorCallback
    from tests.integrations.hf import (
        Tokens,
        Weights,
        arguments,
        poison_activation,
        poison_gradient,
        tiny_gpt2,
        transformers,
    )

    model = tiny_gpt2()
    box: list = []
    # rank 1 only: a NaN in an activation of its forward at step 3; +Inf in one of its local
    # gradients at step 2, on that step's own backward only (the replay's is finite)
    poison_activation(model, lambda: rank == 1 and box[0].state.global_step + 1 == 3)
    backwards: dict[int, int] = {}

    def once_at_step_2() -> bool:
        step = box[0].state.global_step + 1
        backwards[step] = backwards.get(step, 0) + 1
        return rank == 1 and step == 2 and backwards[step] == 1

    poison_gradient(model, once_at_step_2, float("inf"))
    callback = FpDoctorCallback(report_path=str(Path(out, "hf.json")))
    weights = Weights()
    args = arguments(Path(out, f"run{rank}"), max_steps=4, ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback, weights])
    box.append(trainer)
    trainer.train()
    report = callback.report
    results["findings"] = _summary(report)
    results["verdicts"] = report.data["verdicts"]
    results["unchanged"] = [
        all(torch.equal(a, b) for a, b in zip(weights.after[s - 1], weights.after[s], strict=True)) for s in (2, 3)
    ]
    results["weights"] = [float(p.detach().double().sum()) for p in model.parameters()]
    results["attributes_ranks"] = callback._watch.attributes_ranks if callback._watch is not None else None


@pytest.mark.timeout(300)
def test_hf_ddp_names_the_rank_that_held_the_fault(tmp_path):
    pytest.importorskip("transformers", reason="the Hugging Face callback's tests need transformers")
    pytest.importorskip("accelerate", reason="the Hugging Face Trainer needs accelerate (`make test`)")
    ranks = _launch(_hf_worker, tmp_path)
    for r in ranks:
        assert "error" not in r, r["error"]
    for r in ranks:
        names = [(name, rank, step) for name, rank, step, _ in r["findings"]]
        assert ("nonfinite-loss", 1, 3) in names and ("deterministic-nonfinite", 1, 3) in names
        assert ("nonfinite-gradient", 1, 2) in names and ("transient-fault-suspected", 1, 2) in names
        assert not any(rank == 0 for _, rank, _ in names)
        (grad,) = [f for f in r["findings"] if f[0] == "nonfinite-gradient"]
        assert grad[3]  # its DDP bucket, seen before the all-reduce and the Trainer's clipping
        assert r["verdicts"] == {"2": "transient-fault-suspected", "3": "deterministic-nonfinite"}
        assert r["unchanged"] == [True, True]
        assert r["attributes_ranks"] is True  # the DDP wrapper was found and watched
    assert ranks[0]["weights"] == ranks[1]["weights"]
