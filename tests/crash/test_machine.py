"""What the machine says about a crash: kernel-log lines since the start, environment verdicts, GPUs."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from fpdoctor.crash.machine import EnvironmentJoin, gpu_for, new_lines
from tests.conftest import FIXTURES

KERNEL = FIXTURES / "crash" / "kernel"
H20_FACTS = Path(__file__).resolve().parents[2] / "src" / "fpdoctor" / "casebook" / "data" / "h20_sigfpe.facts.json"


def lines(name: str) -> list[str]:
    return (KERNEL / name).read_text().splitlines()


def test_only_lines_after_the_start_count():
    boot = 1_000_000.0  # seconds since the epoch at boot; the log's stamps are seconds since boot
    before = new_lines(lines("xid_uptime.log"), start=boot + 14350.0, boot=boot)
    # Xid 31 came before the start; 62 and 45 after (same GPU, same burst)
    assert [f.evidence["xid"] for f in before.findings] == [62, 45]
    assert len(before.lines) == 2 and before.lines[1].endswith("Xid (PCI:0000:0a:00): 45, pid='<unknown>', "
                                                              "name=<unknown>, Ch 00000008")  # fmt: skip
    assert all(f.name == "xid-error" and f.where["pci"] == "0000:0a:00.0" for f in before.findings)
    assert before.oom_killed == {698405: lines("xid_uptime.log")[3]}
    after_all = new_lines(lines("xid_uptime.log"), start=boot + 500_000.0, boot=boot)
    assert (after_all.lines, after_all.findings, after_all.oom_killed) == ([], [], {})


def test_without_a_boot_time_uptime_stamps_are_not_provably_new():
    log = new_lines(lines("xid_uptime.log"), start=0.0, boot=None)
    assert log.findings == [] and log.oom_killed == {}
    assert log.note is not None and "3 NVIDIA line(s)" in log.note


def test_oom_killer_lines_with_wall_clock_times():
    killed_at = datetime.datetime.fromisoformat("2024-04-29T14:55:41.679700+02:00").timestamp()
    log = new_lines(lines("oom_iso_ert7797.log"), start=killed_at - 60, boot=None)
    assert list(log.oom_killed) == [1440763]
    assert (
        "Out of memory: Killed process 1440763" in log.oom_killed[1440763] or "pid=1440763" in log.oom_killed[1440763]
    )
    assert new_lines(lines("oom_iso_ert7797.log"), start=killed_at + 60, boot=None).oom_killed == {}


def test_environment_verdicts_from_saved_facts():
    facts = json.loads(H20_FACTS.read_text())
    join = EnvironmentJoin(facts, "file h20.facts.json")
    join.start()
    env = join.result(["Fatal Python error: Floating point exception"], timeout=30)
    assert env.note is None and env.source == "file h20.facts.json"
    names = [f.name for f in env.findings]
    assert "cublas-h20-sigfpe" in names and all(f.severity.value != "info" for f in env.findings)
    h20 = next(f for f in env.findings if f.name == "cublas-h20-sigfpe")
    assert h20.evidence["matched"]  # the crash's own text is a symptom the rule quotes
    assert env.gpus and facts == json.loads(H20_FACTS.read_text())  # the caller's facts unchanged


def test_gpu_behind_a_cuda_device():
    gpus = [
        {"index": 0, "uuid": "GPU-aaaa-0", "name": "NVIDIA H20"},
        {"index": 1, "uuid": "GPU-bbbb-1", "name": "NVIDIA H20"},
        {"index": 2, "uuid": "GPU-cccc-2", "name": "NVIDIA H20"},
    ]
    assert gpu_for(gpus, None, 1)["uuid"] == "GPU-bbbb-1"
    assert gpu_for(gpus, "2,0", 0) == {"cuda": 0, "index": 2, "uuid": "GPU-cccc-2", "name": "NVIDIA H20"}
    assert gpu_for(gpus, "GPU-bbbb", 0)["index"] == 1  # CUDA_VISIBLE_DEVICES may name UUID prefixes
    assert gpu_for(gpus, "0", 3) == {"cuda": 3}  # not visible: nothing invented
    assert gpu_for([], None, 0) == {"cuda": 0, "index": 0}
    assert gpu_for(gpus, None, None) == {}
