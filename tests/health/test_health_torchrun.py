"""`torchrun -m fpdoctor health --device cpu`: every rank exits with the merged report's verdict.

Four ranks on the CPU (gloo) of a machine without an NVIDIA driver (tests/fixtures/health/
health_rank.py, the command line with NVML and the kernel log replaced). A rank that exits
otherwise than the others makes torchrun stop them and call the job FAILED, so the exit status is
decided after the merge, from the report rank 0 prints, and is the same on every rank.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.serial, pytest.mark.jobs]  # 4-rank torchrun jobs within LIMIT_S

pytest.importorskip("torch")

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "health_rank.py"
WORLD = 4
LIMIT_S = 60.0  # the whole job, four ranks, on a 2-core machine


def _torchrun(out: Path, *options: str) -> tuple[int, str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # a second for every rank to write its status before torchrun looks again (default 0.1 s)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
            "--monitor-interval=1", str(RANK_SCRIPT), str(out), "0.3", *options]  # fmt: skip
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {LIMIT_S:.0f} s")
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]
    return proc.returncode, err, docs


def test_a_job_whose_merged_verdict_is_ok_succeeds_on_every_rank(tmp_path):
    # rank 2's own NVML cannot be read; the report is rank 0's facts with every rank's fingerprints
    code, err, docs = _torchrun(tmp_path, "--nvml-broken", "2")
    assert code == 0, err[-3000:]
    assert "FAILED" not in err
    assert [d["exit"] for d in docs] == [0] * WORLD
    assert [d["reported"] for d in docs] == [True, False, False, False]
    report = json.loads((tmp_path / "report0.json").read_text())
    assert report["verdict"] == "ok" and report["data"]["complete"] is True
    assert report["data"]["status"] == "healthy" and "not_checked" not in report["data"]
    assert [row["rank"] for row in report["data"]["fingerprints"]["rows"]] == [0, 1, 2, 3]


def test_a_merged_report_without_a_verdict_is_exit_2_on_every_rank(tmp_path):
    code, _, docs = _torchrun(tmp_path, "--nvml-broken", "0")
    assert code != 0
    assert [d["exit"] for d in docs] == [2] * WORLD
    report = json.loads((tmp_path / "report0.json").read_text())
    assert report["data"]["complete"] is False and "NVML" in report["data"]["not_checked"]
