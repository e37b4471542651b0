"""A torchrun `health` job whose ranks were started with different flags (a launcher script that
gives one node `--duration 0`): what it does, held.

The ranks that fingerprint (`--duration` > 0, whatever `--device` each has) merge, judge the same
merged report and exit with one status. A rank started with `--duration 0` (or `--from`) reads
no fingerprints and never joins: it reports its node's facts and exits with their status at once.
The fingerprinting ranks wait for it at most the join timeout, then each reports alone (saying that
the fingerprints were not compared across ranks, and why) and exits with its own report's status.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.serial, pytest.mark.jobs]

pytest.importorskip("torch")

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "health_rank_flags.py"
JOIN_S = 3.0
LIMIT_S = 150.0  # two ranks and their fingerprint children, on a 2-core machine


def _torchrun(out: Path, *flags: str) -> tuple[int, str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(flags)}",
            "--monitor-interval=1", str(RANK_SCRIPT), str(out), str(JOIN_S), *flags]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {LIMIT_S:.0f} s")
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(flags))]
    return proc.returncode, err, docs


HEALTHY_SMI = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "smi_h100_580_healthy.txt"
CLEAN_LOG = "[    0.000000] Linux version 6.8.0-45-generic #45-Ubuntu SMP\n"


def test_a_rank_that_reads_no_fingerprints_never_joins_and_the_others_stop_waiting(tmp_path):
    """Rank 0 judges saved files (`--from`, facts only, as `--duration 0` does), rank 1 fingerprints."""
    log = tmp_path / "dmesg.txt"
    log.write_text(CLEAN_LOG)
    started = time.monotonic()
    code, err, docs = _torchrun(tmp_path, f"--from {HEALTHY_SMI} --from {log}", "--duration 0.3 --device cpu")
    assert code == 0, err[-3000:]
    assert [d["exit"] for d in docs] == [0, 0] and [d["reported"] for d in docs] == [True, True]
    facts_only, alone = (json.loads((tmp_path / f"report{r}.json").read_text()) for r in (0, 1))
    assert "fingerprints" not in facts_only["data"] and docs[0]["s"] < docs[1]["s"]
    rows = alone["data"]["fingerprints"]["rows"]
    assert [row["rank"] for row in rows] == [1]  # its own, compared with no other rank's
    assert any("rank 1: fingerprints not compared across ranks" in n for n in alone["data"]["fingerprints"]["notes"])
    assert time.monotonic() - started < LIMIT_S


def test_ranks_that_fingerprint_with_different_devices_still_merge_into_one_status(tmp_path):
    code, err, docs = _torchrun(tmp_path, "--duration 0.3 --device cpu", "--duration 0.5 --device cpu")
    assert code == 0, err[-3000:]
    assert [d["exit"] for d in docs] == [0, 0] and [d["reported"] for d in docs] == [True, False]
    merged = json.loads((tmp_path / "report0.json").read_text())
    assert [row["rank"] for row in merged["data"]["fingerprints"]["rows"]] == [0, 1]
