"""The failure named first is the one that caused the others, when it left no trace of its own.

A rank killed by SIGKILL (the out-of-memory killer) or gone by os._exit writes nothing; its
launcher then stops the survivors (SIGTERM) or their collective loses its peer. `fpdoctor run`
names the rank that went first from the order of deaths it saw, torchrun's failure summary and
mp.spawn's ProcessExitedException, never a survivor the launcher stopped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

SPAWN = """
import os, signal, sys, time
import torch.multiprocessing as mp

def work(index, mode):
    if index == 1:
        time.sleep(1)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    time.sleep(60)  # until mp.spawn stops it

if __name__ == "__main__":
    mp.spawn(work, args=(sys.argv[1],), nprocs=2)
"""

GLOO = """
import os, signal, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == 1:
    time.sleep(1)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)
dist.all_reduce(torch.ones(4))  # loses its peer
time.sleep(60)
"""


def _run(tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess[bytes], dict]:
    out = tmp_path / "report.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "fpdoctor", "run", "-o", str(out), "--", *command],
        capture_output=True,
        timeout=200,
        check=False,
        env=env,
    )
    return result, json.loads(out.read_text(encoding="utf-8"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _assert_rank_1_leads(doc: dict, mode: str) -> None:
    first = doc["findings"][0]
    assert first["where"]["rank"] == 1, [(f["name"], f["where"].get("rank")) for f in doc["findings"]]
    if mode == "kill":
        assert first["name"] == "fatal-signal" and first["evidence"]["signal"] == "SIGKILL"
        assert "out-of-memory killer" in first["evidence"]["explanation"] and "dmesg" in first["fix"]
        assert "It may be the kernel's out-of-memory killer" in first["message"] and "dmesg" in first["message"]
    else:
        assert first["name"] == "nonzero-exit" and first["evidence"]["exit_code"] == 3
        assert "os._exit(3)" in first["message"]
    assert "the first process to fail" in first["message"]
    (stopped,) = [f for f in doc["findings"] if f["name"] == "rank-stopped"]
    assert stopped["where"]["rank"] == 0 and stopped["evidence"]["first_failure"] == "rank 1"
    assert stopped["severity"] == "info"
    assert dict(doc["data"]["summary"])["first failure"].startswith("rank 1 ")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_under_mp_spawn_the_rank_that_died_without_a_trace_leads(tmp_path, mode):
    """mp.spawn sees process 1 end (SIGKILL, exit code 3), terminates process 0 and raises
    ProcessExitedException: process 0's SIGTERM is the consequence."""
    script = tmp_path / "spawn.py"
    script.write_text(SPAWN, encoding="utf-8")
    result, doc = _run(tmp_path, sys.executable, str(script), mode)
    assert result.returncode == 1, result.stderr[-2000:]
    _assert_rank_1_leads(doc, mode)
    assert doc["findings"][1]["evidence"]["ended"] == "terminated"


@pytest.mark.serial
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_under_torchrun_the_rank_that_died_first_leads_not_the_one_whose_collective_lost_it(tmp_path, mode):
    """Rank 1 is killed (or os._exits) while rank 0 waits in all_reduce; rank 0's gloo 'Connection
    closed by peer' comes at once and torchrun then tears the job down: rank 1 is named first."""
    script = tmp_path / "job.py"
    script.write_text(GLOO, encoding="utf-8")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    result, doc = _run(tmp_path, *torchrun, str(script), mode)
    assert result.returncode == 1, result.stderr[-2000:]  # torchrun's own status
    _assert_rank_1_leads(doc, mode)


def test_a_command_that_only_exited_non_zero_is_never_ok_in_its_report_file(tmp_path):
    """Nothing crashed: the command's stderr is left as it is, and the -o report's verdict is an
    error that says the status, never OK beside exit status 3."""
    code = "import sys; print('bad input', file=sys.stderr); sys.exit(3)"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, check=False)
    result, doc = _run(tmp_path, sys.executable, "-c", code)
    assert (result.returncode, result.stderr) == (plain.returncode, plain.stderr) == (3, b"bad input\n")
    assert doc["verdict"] == "error" and doc["data"]["exit_status"] == 3
    (finding,) = doc["findings"]
    assert finding["name"] == "nonzero-exit" and finding["evidence"]["exit_code"] == 3
    assert "exited with status 3" in finding["message"]
