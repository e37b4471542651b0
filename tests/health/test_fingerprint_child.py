"""run_fingerprints: the child per device, its timeout, crashes, and what it returns."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from fpdoctor.health import fingerprint


def test_cpu_fingerprint_runs_in_a_child_and_is_ok():
    started = time.monotonic()
    result = fingerprint.run_fingerprints(0.3, device="cpu")
    assert time.monotonic() - started < 60
    assert result.reporting and result.findings == []
    (row,) = result.rows
    assert row["device"] == "cpu" and row["kind"] == "cpu" and row["rank"] is None
    assert row["verdict"] == "ok" and row["known_answer_ok"] is True and row["self_consistent"] is True
    assert set(row["known_answer"]) == set(row["digests"]) == {"bf16", "fp16", "fp32", "fp8"}
    assert all(len(d) == 16 for d in row["digests"].values())
    assert all(v > 0 for v in row["tflops"].values())
    assert row["threads"] >= 1 and row["name"]
    assert any("tf32" in n for n in result.notes)  # what was not run is said
    seconds = row["detail"]["seconds"]  # the node's time split, for the 10 s budget
    assert 0 < seconds["start-up"] < time.monotonic() - started and seconds["work"] >= 0.3 * 0.9


def test_two_runs_give_the_same_digests():
    first = fingerprint.run_fingerprints(0.0, device="cpu").rows[0]
    again = fingerprint.run_fingerprints(0.0, device="cpu").rows[0]
    assert first["digests"] == again["digests"]


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan"), float("inf"), "abc", "3", None, True])
def test_a_duration_that_is_not_zero_or_more_seconds_is_refused(bad):
    with pytest.raises(ValueError, match=r"^duration must be"):
        fingerprint.run_fingerprints(bad, device="cpu")


def test_duration_and_device_checks_name_the_option_as_the_caller_spells_it():
    with pytest.raises(ValueError, match=r"^--duration must be zero or more seconds, got -1; e\.g\. --duration 5$"):
        fingerprint.check_duration(-1, name="--duration")
    with pytest.raises(ValueError, match=r"^duration must be zero or more seconds, got -1; e\.g\. duration=5$"):
        fingerprint.check_duration(-1)
    with pytest.raises(ValueError, match=r"^--device must be cpu, cuda or cuda:N, got 'tpu'$"):
        fingerprint.check_device("tpu", name="--device")
    assert fingerprint.check_device(" CUDA:1 ") == "cuda:1" and fingerprint.check_duration(2) == 2.0


@pytest.fixture
def gpus(monkeypatch):
    """Pretend torch sees `n` GPUs (device_count never creates a CUDA context)."""
    torch = pytest.importorskip("torch")

    def set_count(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


def test_plain_cuda_means_every_gpu_of_the_node(gpus):
    gpus(4)
    assert fingerprint._devices("cuda", None) == (["cuda:0", "cuda:1", "cuda:2", "cuda:3"], [])
    assert fingerprint._devices(None, None) == fingerprint._devices("cuda", None)
    assert fingerprint._devices("cuda:2", None) == (["cuda:2"], [])
    rank = type("Dist", (), {"local_rank": 5})()
    assert fingerprint._devices("cuda", rank) == (["cuda:1"], [])  # under torchrun: this rank's GPU


def test_plain_cuda_without_a_gpu_is_a_note_like_the_default(gpus):
    gpus(0)
    note = "no GPU: fingerprints not run; --device cpu runs them on the CPU"
    assert fingerprint._devices("cuda", None) == ([], [note])


@pytest.mark.parametrize(("count", "have"), [(0, "none; use --device cpu"), (1, "cuda:0"), (2, "cuda:0 to cuda:1")])
def test_a_cuda_index_the_machine_lacks_is_refused(gpus, count, have):
    gpus(count)
    with pytest.raises(fingerprint.DeviceNotFound, match=f"^cuda:7 is not a GPU of this machine .*{have}"):
        fingerprint._devices("cuda:7", None)


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "mps", ""])
def test_an_unknown_device_is_refused(bad):
    with pytest.raises(ValueError, match="device must be"):
        fingerprint.run_fingerprints(1.0, device=bad)


def test_without_a_gpu_nothing_runs_and_a_note_says_so():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count():
        pytest.skip("this machine has a GPU; the no-GPU path needs none")
    result = fingerprint.run_fingerprints(1.0)
    assert result.rows == [] and result.findings == []
    assert result.notes == ["no GPU: fingerprints not run; --device cpu runs them on the CPU"]


def _fake_child(body: str) -> fingerprint.ChildCommand:
    """A child command that runs `body` instead of a fingerprint."""
    code = textwrap.dedent(body)
    return lambda spec: [sys.executable, "-c", code]


def test_a_child_killed_by_a_signal_is_a_finding():
    identity = json.dumps({"kind": "cuda", "uuid": "GPU-1234", "pci": "00000000:1B:00.0", "index": 3})
    command = _fake_child(
        f"""
        import os, signal
        print({fingerprint.READY + identity!r}, flush=True)
        print({fingerprint.START!r} + "seeded bf16", flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
        """,
    )
    result = fingerprint.run_fingerprints(0.1, device="cpu", child_command=command)
    (finding,) = result.findings
    assert finding.name == "probe-crashed"
    assert "GPU 3 (bus 00000000:1B:00.0, GPU-1234) died by SIGSEGV during seeded bf16" in finding.message
    assert finding.where["uuid"] == "GPU-1234" and finding.where["pci"] == "00000000:1B:00.0"
    assert result.rows[0]["verdict"] == "failed"


def test_a_hung_child_is_killed_and_reported(monkeypatch):
    monkeypatch.setattr(fingerprint, "WORK_SLACK_S", 1.0)
    command = _fake_child(
        f"""
        import time
        print({fingerprint.READY!r} + "{{}}", flush=True)
        print({fingerprint.START!r} + "known answer fp32", flush=True)
        time.sleep(120)
        """,
    )
    started = time.monotonic()
    result = fingerprint.run_fingerprints(0.5, device="cpu", child_command=command)
    assert time.monotonic() - started < 20
    (finding,) = result.findings
    assert finding.name == "probe-timed-out"
    assert "still in known answer fp32" in finding.message


def test_a_child_that_fails_to_start_is_a_note():
    command = _fake_child("import sys; sys.exit('RuntimeError: no kernel image is available for execution')")
    result = fingerprint.run_fingerprints(0.1, device="cpu", child_command=command)
    assert result.findings == []
    assert result.rows[0]["verdict"] == "failed"
    assert result.notes == ["host " + result.rows[0]["host"] + ", cpu: fingerprint not run: "
                            "RuntimeError: no kernel image is available for execution"]  # fmt: skip


def test_the_parent_imports_no_torch_for_its_own_modules():
    code = "import sys, fpdoctor.health.fingerprint, fpdoctor.health.ranks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
def test_every_visible_gpu_is_fingerprinted_without_cuda_in_this_process():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    # In a fresh interpreter: another test of this process may have created a CUDA context already.
    code = (
        "import json, torch; from fpdoctor.health import fingerprint\n"
        "r = fingerprint.run_fingerprints(0.0)\n"
        "print(json.dumps({'initialized': torch.cuda.is_initialized(), 'count': torch.cuda.device_count(),"
        " 'rows': r.rows, 'findings': [f.name for f in r.findings]}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["initialized"] is False  # the GPUs were used by the children only
    assert len(result["rows"]) == result["count"]
    for row in result["rows"]:
        assert row["kind"] == "cuda" and row["uuid"] and row["pci"] and row["cublas"] and row["sm_count"]
        assert row["known_answer_ok"] is True and row["self_consistent"] is True, row
        assert row["verdict"] in ("ok", "not comparable")
        assert {"bf16", "fp16", "tf32", "fp32"} <= set(row["digests"])
        assert row["detail"]["seconds"]["start-up"] > 0  # where the node's time went, for the 10 s budget
    assert result["findings"] == []


def test_a_rank_that_cannot_reach_the_others_reports_alone(monkeypatch):
    from fpdoctor.health import ranks

    def unreachable(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\nmore lines")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(ranks, "process_group", unreachable)
    result = fingerprint.run_fingerprints(0.0, device="cpu")
    assert result.reporting  # nobody else will report this rank's fingerprint
    assert [row["rank"] for row in result.rows] == [1] and result.rows[0]["verdict"] == "ok"
    assert (
        "rank 1: fingerprints not compared across ranks (RuntimeError: Connection closed by peer [127.0.0.1]:29500)"
        in result.notes
    )


def test_every_rank_gets_every_row_the_same_findings_and_what_each_rank_shares(monkeypatch):
    import contextlib
    import copy

    from fpdoctor.health import ranks

    def gather(group, payload):  # rank 0 is the other rank: its row is this rank's, renamed
        if "rows" in payload:
            theirs = copy.deepcopy(payload["rows"])
            for row in theirs:
                row["rank"] = 0
            return [{"rows": theirs, "notes": ["from rank 0"]}, payload]
        return [{"shared": "rank 0's facts"}, payload]

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(ranks, "process_group", lambda dist, timeout_s: contextlib.nullcontext())
    monkeypatch.setattr(ranks, "gather", gather)
    result = fingerprint.run_fingerprints(0.0, device="cpu", share=lambda: "rank 1's facts")
    assert not result.reporting  # rank 0 prints the report
    assert [row["rank"] for row in result.rows] == [0, 1] and [r["verdict"] for r in result.rows] == ["ok", "ok"]
    assert result.findings == [] and "rank 0: from rank 0" in result.notes
    assert result.shared == ["rank 0's facts", "rank 1's facts"]


def test_the_command_line_refuses_a_negative_duration_with_exit_2():
    from tests.conftest import run_fpdoctor

    result = run_fpdoctor("health", "--duration", "-1", timeout=60)
    assert result.code == 2
    assert result.err.strip().count("\n") == 0 and "--duration" in result.err
    assert "Traceback" not in result.err


def test_the_command_line_runs_cpu_fingerprints_end_to_end():
    from tests.conftest import run_fpdoctor

    result = run_fpdoctor("health", "--device", "cpu", "--duration", "0.2", "--format", "json", timeout=120)
    doc = json.loads(result.out)
    # the CPU's fingerprint is fine; the exit status is the GPUs' gate (2 where a driver's GPUs were
    # not checked; 0 on a machine without an NVIDIA driver, where the CPU is all --device cpu asks about)
    assert result.code == (0 if doc["data"]["complete"] else 2), result.err
    (row,) = doc["data"]["fingerprints"]["rows"]
    assert row["verdict"] == "ok" and row["known_answer_ok"] is True
    assert not [f for f in doc["findings"] if f["name"] in ("gemm-mismatch", "rank-outlier")]
