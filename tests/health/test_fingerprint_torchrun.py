"""Four torchrun ranks on the CPU (gloo): one with a silent, intermittent matmul error is named.

The fault lives in a test-only fingerprint child (tests/fixtures/health/fp_faulty_child.py) that
one rank starts instead of the product's: a flipped low bit in one element of every third
torch.mm result. The product itself has no fault switch.
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

pytestmark = pytest.mark.serial  # 4-rank torchrun jobs within LIMIT_S

pytest.importorskip("torch")

RANK_SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "health" / "fp_rank.py"
WORLD = 4
LIMIT_S = 60.0  # the whole job, four ranks, on a 2-core machine


def _torchrun(out: Path, *options: str, world: int = WORLD) -> tuple[float, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    argv += [str(RANK_SCRIPT), str(out), "0.3", *options]
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=LIMIT_S + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"torchrun did not finish in {LIMIT_S + 30:.0f} s")
    elapsed = time.monotonic() - started
    assert proc.returncode == 0, err[-3000:]
    docs = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return elapsed, docs


def test_the_rank_with_an_intermittent_matmul_error_is_named(tmp_path):
    elapsed, docs = _torchrun(tmp_path, "--fault-rank", "2", "--every", "3")
    assert elapsed < LIMIT_S
    assert [d["reporting"] for d in docs] == [True, False, False, False]
    root = docs[0]
    # every rank judges every rank's rows alike; only rank 0 prints them
    assert all(d["findings"] == root["findings"] and d["rows"] == root["rows"] for d in docs[1:])
    assert [row["rank"] for row in root["rows"]] == [0, 1, 2, 3]
    named = {(f["name"], f["where"].get("rank")) for f in root["findings"]}
    assert named, root
    assert {rank for _, rank in named} == {2}
    assert {name for name, _ in named} <= {"gemm-mismatch", "rank-outlier"}
    verdicts = [row["verdict"] for row in root["rows"]]
    assert verdicts[2] in ("mismatch", "outlier") and verdicts[:2] + verdicts[3:] == ["ok"] * 3
    (finding,) = [f for f in root["findings"] if f["name"] == "gemm-mismatch"]
    assert finding["where"]["host"] and finding["where"]["device"] == "cpu"
    assert finding["message"].startswith("rank 2 on host ")


def test_the_same_job_without_the_fault_reports_nothing(tmp_path):
    elapsed, docs = _torchrun(tmp_path)
    assert elapsed < LIMIT_S
    root = docs[0]
    assert root["findings"] == []
    assert [row["verdict"] for row in root["rows"]] == ["ok"] * WORLD
    assert len({row["group"] for row in root["rows"]}) == 1
    assert len({json.dumps(row["digests"], sort_keys=True) for row in root["rows"]}) == 1


def test_a_rank_that_is_wrong_every_time_is_named_by_its_known_answer_alone(tmp_path):
    # every result flipped: its repeats agree with each other, but the exact known answer is wrong,
    # which decides: the rank has no vote, and no other rank is marked
    _, docs = _torchrun(tmp_path, "--fault-rank", "1", "--every", "1")
    root = docs[0]
    named = sorted((f["name"], f["where"].get("rank")) for f in root["findings"])
    assert named == [("gemm-mismatch", 1)]
    (wrong,) = root["findings"]
    assert "got the exact-integer known answer wrong in" in wrong["message"]
    assert {"bf16", "fp16", "fp32"} <= set(wrong["evidence"]["dtypes"])  # fp8 does not call torch.mm
    assert [row["verdict"] for row in root["rows"]] == ["ok", "mismatch", "ok", "ok"]


def test_a_job_with_its_own_process_group_keeps_it(tmp_path):
    _, docs = _torchrun(tmp_path, "--init-first", world=2)
    assert [d["group_after"] for d in docs] == [True, True]
    assert [d["reporting"] for d in docs] == [True, False]
    assert [row["rank"] for row in docs[0]["rows"]] == [0, 1] and docs[0]["findings"] == []
