"""Grouping, majorities and outliers across GPUs and ranks, on rows as the fingerprint child makes them."""

from __future__ import annotations

import copy

import pytest

from fpdoctor.health import ranks

GOOD = {"bf16": "aaaa", "fp16": "bbbb", "fp32": "cccc"}


def _row(rank: int, **changes) -> dict:
    row = {
        "rank": rank,
        "host": f"n{rank // 8}",
        "device": f"cuda:{rank % 8}",
        "index": rank % 8,
        "pci": f"00000000:{0x10 + rank:02X}:00.0",
        "uuid": f"GPU-{rank:08d}",
        "name": "NVIDIA H100 80GB HBM3",
        "sm_count": 132,
        "threads": None,
        "isa": None,
        "mig": None,
        "cublas": "12.8.4",
        "driver": "580.159.04",
        "torch": "2.11.0+cu130",
        "kind": "cuda",
        "digests": dict(GOOD),
        "tflops": {"bf16": 700.0, "fp16": 690.0, "fp32": 50.0},
        "detail": {
            "known_answer": {d: {"ok": True} for d in GOOD},
            "seeded": {d: {"distinct": 1, "repeats": 10, "agreeing": 10} for d in GOOD},
        },
    }
    row.update(changes)
    return row


def _names(findings) -> list[tuple[str, int | None]]:
    return sorted((f.name, f.where.get("rank")) for f in findings)


def test_identical_gpus_agree_and_nothing_is_reported():
    rows = [_row(r) for r in range(4)]
    findings, _notes = ranks.judge(rows)
    assert findings == []
    assert {r["verdict"] for r in rows} == {"ok"}
    assert (
        rows[0]["group"] == "NVIDIA H100 80GB HBM3 · 132 SMs · cuBLAS 12.8.4 · driver 580.159.04 · torch 2.11.0+cu130"
    )


def test_the_member_that_disagrees_with_the_majority_is_named():
    rows = [_row(r) for r in range(4)]
    rows[2]["digests"]["bf16"] = "ffff"
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("rank-outlier", 2)]
    (finding,) = findings
    assert finding.severity.value == "error"
    assert finding.where == {
        "rank": 2,
        "host": "n0",
        "device": "cuda:2",
        "index": 2,
        "uuid": "GPU-00000002",
        "pci": "00000000:12:00.0",
    }
    assert "rank 2 on host n0, GPU 2 (bus 00000000:12:00.0, GPU-00000002)" in finding.message
    assert "bf16" in finding.message and "3 members" in finding.message
    assert finding.evidence["digests"]["bf16"] == {"digest": "ffff", "majority": "aaaa", "agreeing": 3, "compared": 4}
    assert [r["verdict"] for r in rows] == ["ok", "ok", "outlier", "ok"]


def test_other_models_and_software_are_not_comparable_never_an_alarm():
    rows = [
        _row(0),
        _row(1),
        _row(2, name="NVIDIA H20", sm_count=78, digests={"bf16": "1111"}),
        _row(3, mig="1g.10gb", sm_count=16, digests={"bf16": "2222"}),
        _row(4, cublas="12.4.5", digests={"bf16": "3333"}),
        _row(5, driver="550.90.07", digests={"bf16": "4444"}),
    ]
    findings, notes = ranks.judge(rows)
    assert findings == []
    assert [r["verdict"] for r in rows] == ["ok", "ok"] + ["not comparable"] * 4
    assert len({r["group"] for r in rows}) == 5
    assert any("5 fingerprint groups" in n for n in notes)


def test_two_members_that_disagree_have_no_majority():
    rows = [_row(0), _row(1)]
    rows[1]["digests"]["fp16"] = "eeee"
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("rank-outlier", 0), ("rank-outlier", 1)]
    assert {f.severity.value for f in findings} == {"warning"}
    assert "no majority" in findings[0].message
    assert {r["verdict"] for r in rows} == {"outlier"}


def test_a_wrong_known_answer_is_a_mismatch_on_its_own():
    rows = [_row(0)]
    rows[0]["detail"]["known_answer"]["fp16"] = {"ok": False, "wrong_repeats": 1, "first_wrong_rows": [9]}
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("gemm-mismatch", 0)]
    assert findings[0].evidence["known_answer"]["fp16"]["first_wrong_rows"] == [9]
    assert "known answer wrong in fp16" in findings[0].message
    assert rows[0]["verdict"] == "mismatch"


def test_repeats_that_disagree_are_a_mismatch():
    rows = [_row(r) for r in range(3)]
    rows[1]["detail"]["seeded"]["bf16"] = {"distinct": 2, "repeats": 30, "agreeing": 20}
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("gemm-mismatch", 1)]
    assert "2 different results in 30 repeats" in findings[0].message
    assert findings[0].evidence["repeats"] == {"bf16": {"distinct": 2, "repeats": 30, "agreeing": 20}}


def test_a_consistently_wrong_gpu_is_named_once_by_its_known_answer_and_has_no_vote():
    rows = [_row(r) for r in range(3)]
    rows[0]["detail"]["known_answer"]["bf16"] = {"ok": False}
    rows[0]["digests"]["bf16"] = "0bad"
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("gemm-mismatch", 0)]
    assert [r["verdict"] for r in rows] == ["mismatch", "ok", "ok"]


def test_a_far_slower_gpu_is_a_warning_outlier():
    rows = [_row(r) for r in range(4)]
    rows[3]["tflops"]["bf16"] = 400.0  # the median of 700, 640, 700, 400 is 670: 60%
    rows[1]["tflops"]["bf16"] = 640.0  # 96%: noise
    findings, _ = ranks.judge(rows)
    assert _names(findings) == [("rank-outlier", 3)]
    (finding,) = findings
    assert finding.severity.value == "warning" and finding.title == "One GPU is far slower than its peers"
    assert finding.evidence["throughput"]["bf16"]["ratio"] == pytest.approx(400 / 670, abs=1e-3)
    assert rows[3]["verdict"] == "outlier" and rows[1]["verdict"] == "ok"


def test_cpu_members_throughput_is_not_compared():
    rows = [_row(r, kind="cpu", name="AMD EPYC", sm_count=None, threads=1, isa="AVX512") for r in range(3)]
    rows[0]["tflops"]["bf16"] = 0.001
    findings, notes = ranks.judge(rows)
    assert findings == []
    assert any("not compared" in n for n in notes)
    assert rows[0]["group"] == "AMD EPYC · AVX512 · 1 threads · torch 2.11.0+cu130"


def test_a_crashed_or_hung_child_is_a_finding_and_an_error_a_note():
    rows = [_row(0), _row(1), _row(2), _row(3)]
    rows[1]["failure"] = {"kind": "crashed", "signal": "SIGSEGV", "step": "seeded bf16", "returncode": -11}
    rows[2]["failure"] = {"kind": "timeout", "step": "known answer fp32", "seconds": 150.0}
    rows[3]["failure"] = {"kind": "error", "error": "torch.OutOfMemoryError: CUDA out of memory"}
    findings, notes = ranks.judge(rows)
    assert _names(findings) == [("probe-crashed", 1), ("probe-timed-out", 2)]
    assert "died by SIGSEGV during seeded bf16" in findings[0].message
    assert findings[0].evidence["signal"] == "SIGSEGV"
    assert any("rank 3" in n and "out of memory" in n for n in notes)
    assert [r["verdict"] for r in rows] == ["ok", "failed", "failed", "failed"]
    assert rows[0]["group"] and [r["group"] for r in rows[1:]] == [None, None, None]


def test_a_lone_device_is_judged_on_its_own_not_as_not_comparable():
    rows = [_row(0)]
    rows[0]["rank"] = None  # no torchrun
    findings, _ = ranks.judge(rows)
    assert findings == [] and rows[0]["verdict"] == "ok"
    assert ranks.place(rows[0]) == "host n0, GPU 0 (bus 00000000:10:00.0, GPU-00000000)"


def test_judge_is_deterministic_and_keeps_the_rows_order():
    rows = [_row(r) for r in range(5)]
    rows[4]["digests"]["fp32"] = "dddd"
    again = copy.deepcopy(rows)
    assert [f.to_dict() for f in ranks.judge(rows)[0]] == [f.to_dict() for f in ranks.judge(again)[0]]
    assert [r["rank"] for r in rows] == list(range(5))


def test_notes_of_several_ranks_are_merged():
    merged = ranks.merge_notes([(0, ["no GPU"]), (1, ["no GPU", "x"]), (2, ["no GPU"])])
    assert merged == ["ranks 0, 1, 2: no GPU", "rank 1: x"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"RANK": "0", "WORLD_SIZE": "1"}, None),
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, ranks.DistEnv(3, 4, 1)),
        ({"RANK": "x", "WORLD_SIZE": "4"}, None),
    ],
)
def test_torchrun_environment(monkeypatch, env, expected):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert ranks.dist_env() == expected
