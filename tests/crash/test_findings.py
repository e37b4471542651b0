"""Findings from collected processes: where.op as ARCHITECTURE.md says, the GPU a rank was on, the re-run command."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from fpdoctor.cli.run import program
from fpdoctor.crash import rerun_command
from fpdoctor.crash.collect import Collected, Process
from fpdoctor.crash.findings import Context, Event, fatal_signal, overload_name, rank_stopped
from fpdoctor.crash.launcher import Launched
from fpdoctor.crash.machine import Environment


def test_where_op_is_the_overload_name_as_numerics_findings_give_it():
    assert overload_name("aten::addmm") == "aten.addmm.default"
    assert overload_name("aten::add.Tensor") == "aten.add.Tensor"
    assert overload_name("aten::add_.Tensor") == "aten.add_.Tensor"
    assert overload_name("fpdoctor_fixture::gemm") == "fpdoctor_fixture.gemm.default"
    assert overload_name("aten.addmm.default") == "aten.addmm.default"  # already str(OpOverload)
    assert overload_name("?") is None and overload_name(None) is None


def test_the_names_agree_with_torch():
    torch = pytest.importorskip("torch")
    for op in (torch.ops.aten.addmm.default, torch.ops.aten.add.Tensor, torch.ops.aten.sum.dim_IntList):
        assert overload_name(op.name()) == str(op)


def _context(p: Process, gpus: list[dict] | None = None) -> Context:
    launched = Launched(argv=["torchrun", "train.py"], pid=1, returncode=1, started=0.0, ended=1.0,
                        stdout_tail=None, stderr_tail=b"")  # fmt: skip
    collected = Collected(processes=[p], direct=p, launcher_failures=[], stream_dumps=[], native=[], stderr_text="")
    env = Environment(gpus=gpus) if gpus is not None else None
    return Context(launched=launched, collected=collected, breadcrumbs=False, environment=env)


def _rank(visible: str | None, *, local_rank: int = 1, ops: list[dict] | None = None) -> Process:
    record = {"pid": 42, "rank": str(local_rank), "local_rank": str(local_rank), "world_size": "4", "host": "node7"}
    if visible is not None:
        record["cuda_visible_devices"] = visible
    return Process(pid=42, record=record, returncode=-8, ops=ops or [])


def _where(p: Process, gpus: list[dict] | None = None) -> dict:
    ctx = _context(p, gpus)
    return fatal_signal(ctx, p, p.outcome(), first=True).to_dict()["where"]


UUID = "GPU-5d0c7a4e-1b2f-4c3d-9e8f-000000000003"
GPUS = [{"index": i, "uuid": f"GPU-5d0c7a4e-1b2f-4c3d-9e8f-00000000000{i}", "name": "NVIDIA H20"} for i in range(4)]


def test_a_ranks_gpu_from_its_record_without_the_gpu_list():
    """No GPU list (no NVML, the environment not read in time): CUDA_VISIBLE_DEVICES in the
    process record still names the GPU."""
    where = _where(_rank("2,3"))
    assert (where["rank"], where["host"], where["device"], where["gpu"]) == (1, "node7", "cuda:1", 3)
    where = _where(_rank(UUID))
    assert (where["device"], where["uuid"]) == ("cuda:0", UUID)
    assert "device" not in _where(_rank(None))  # a CPU job: no GPU, nothing invented
    assert "device" not in _where(_rank("-1"))


def test_one_visible_gpu_per_rank_is_cuda_0():
    """A scheduler that gives each rank one GPU (CUDA_VISIBLE_DEVICES=3): the rank's cuda:0 is
    GPU 3, whatever its LOCAL_RANK."""
    where = _where(_rank("3"), GPUS)
    assert (where["device"], where["gpu"], where["uuid"]) == ("cuda:0", 3, UUID)
    where = _where(_rank(None, local_rank=3), GPUS)  # every GPU visible: one per local rank
    assert (where["device"], where["gpu"], where["uuid"]) == ("cuda:3", 3, UUID)


def test_the_op_in_flight_names_the_device():
    op = {"op": "aten::addmm", "module": "fc", "shapes": [[2, 3]], "dtypes": ["float16"], "device": "cuda:2",
          "thread": 1, "done": False}  # fmt: skip
    where = _where(_rank(None, ops=[op]), GPUS)
    assert (where["op"], where["module"], where["device"], where["gpu"]) == ("aten.addmm.default", "fc", "cuda:2", 2)


def test_a_stopped_rank_carries_rank_host_and_device():
    first, other = _rank("0,1", local_rank=1), _rank("0,1", local_rank=0)
    other.pid, other.returncode = 43, -15
    ctx = _context(first)
    where = rank_stopped(ctx, other, Event(first, first.outcome(), 1.0)).to_dict()["where"]
    assert (where["rank"], where["host"], where["device"], where["gpu"]) == (0, "node7", "cuda:0", 0)


def test_the_rerun_command_is_exact():
    argv = [sys.executable, "my train.py", "--name", "it's a run", "--lr=1e-3"]
    rerun = rerun_command(argv, "facts dir/h20.json", wait_s=30.0, program=["fpdoctor"])
    words = ["fpdoctor", "run", "--breadcrumbs", "--env-from", "facts dir/h20.json", "--wait", "30", "--", *argv]
    assert shlex.split(rerun) == words
    # the default wait is left out; a facts dict (the Python API) has no path to give
    assert shlex.split(rerun_command(["python", "t.py"], {"gpus": []})) == [
        "fpdoctor", "run", "--breadcrumbs", "--", "python", "t.py"
    ]  # fmt: skip


def test_the_rerun_starts_fpdoctor_as_this_shell_can(monkeypatch, tmp_path):
    """`fpdoctor` only when that name on PATH is this installation's; else this interpreter's -m."""
    monkeypatch.setenv("PATH", str(tmp_path))
    assert program() == [sys.executable, "-m", "fpdoctor"]
    other = tmp_path / "fpdoctor"
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    assert program() == [sys.executable, "-m", "fpdoctor"]  # another installation's
    here = Path(sys.executable).parent
    if not (here / "fpdoctor").exists():
        pytest.skip("no fpdoctor script beside this interpreter")
    monkeypatch.setenv("PATH", os.pathsep.join([str(here), str(tmp_path)]))
    assert program() == ["fpdoctor"]


def test_a_kernel_log_finding_names_the_rank_whose_gpu_it_is():
    """Under torchrun an Xid names a bus id; the report adds the rank on that GPU (LOCAL_RANK's
    GPU from the list NVML gave, bus ids compared in any spelling)."""
    from fpdoctor import catalog
    from fpdoctor.crash.findings import on_ranks

    gpus = [{**g, "pci_bus_id": f"00000000:{0x18 + 0x10 * g['index']:02X}:00.0"} for g in GPUS]
    ranks = [_rank(None, local_rank=r) for r in range(4)]
    ctx = _context(ranks[0], gpus)
    xid = catalog.make("xid-error", message="Xid 79 on GPU 0000:38:00.0.", where={"pci": "PCI:0000:38:00"})
    elsewhere = catalog.make("xid-error", message="Xid 13.", where={"pci": "0000:99:00.0"})
    named, unowned = on_ranks([xid, elsewhere], ctx, ranks)
    assert named.where["rank"] == 2 and named.where["device"] == "cuda:2" and named.where["host"] == "node7"
    assert named.message.endswith("This is rank 2's GPU (cuda:2).") and named.where["pci"] == "PCI:0000:38:00"
    assert unowned is elsewhere  # no rank on that GPU: as the kernel log said it
    other_node = catalog.make("xid-error", message="Xid 79.", where={"pci": "0000:38:00.0", "host": "node8"})
    assert on_ranks([other_node], ctx, ranks) == [other_node]  # the same bus id on another node's log


def test_a_child_exception_quoted_by_mp_spawn_is_the_last_of_its_chain():
    """mp.spawn quotes the traceback the failed process printed: a chained one ends in the
    exception that ended it, and that one is the child's."""
    from fpdoctor.crash.collect import _reported_exception

    quoted = (
        'Traceback (most recent call last):\n  File "/w/spawn.py", line 3, in load\n    open(path)\n'
        "FileNotFoundError: shard 3\n\nDuring handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "/lib/torch/multiprocessing/spawn.py", line 87, in _wrap\n'
        '    fn(i, *args)\n  File "/w/spawn.py", line 9, in work\n    raise ValueError("no data,\\nretry")\n'
        "ValueError: no data,\nretry\n"
    )
    parent = {
        "time": 5.0,
        "message": "\n\n-- Process 1 terminated with the following error:\n" + quoted,
        "traceback": "Traceback ...\ntorch.multiprocessing.spawn.ProcessRaisedException: \n\n"
        "-- Process 1 terminated with the following error:\n" + quoted,
    }
    record = _reported_exception(parent, 1, 4.5)
    assert record is not None
    assert (record["type"], record["message"], record["time"]) == ("ValueError", "no data,\nretry", 4.5)
    assert [f["function"] for f in record["frames"]] == ["_wrap", "work"]
    assert _reported_exception(parent, 0, 4.5) is None  # another process's quote
